"""Prometheus metrics of the long-running commands (``--metrics-port``).

Values are read from the live objects (subscription statistics, fusion metrics) when Prometheus
scrapes, through a custom collector: nothing is counted twice and nothing runs on the hot path.

``embodied-bus actions --metrics-port`` also serves the action backlog as JSON on ``/backlog``,
for autoscalers that read a JSON value over HTTP (KEDA's ``metrics-api`` scaler).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = ["BACKLOG_PATH", "MetricsExporter"]


#: Path of the JSON backlog (:meth:`MetricsExporter.add_actions`).
BACKLOG_PATH = "/backlog"


class MetricsExporter:
    """Serves ``/metrics`` on a port; register sources with :meth:`add_streams`,
    :meth:`add_fusion`, :meth:`add_executor` and :meth:`add_actions` (which also serves
    :data:`BACKLOG_PATH`).

    Args:
        port: TCP port (0 picks a free one; see :attr:`port`).
        addr: Bind address (default all interfaces).
    """

    def __init__(self, port: int, addr: str = "0.0.0.0") -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self._stream_sources: list[Callable[[], list[dict[str, Any]]]] = []
        self._fusion_sources: list[Callable[[], dict[str, Any]]] = []
        self._actions_source: Callable[[], dict[str, Any]] | None = None
        self._executor_sources: list[Callable[[], dict[str, Any]]] = []
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)  # type: ignore[arg-type]
        self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        prometheus_app = self._server.get_app()

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            source = self._actions_source
            if environ.get("PATH_INFO") == BACKLOG_PATH and source is not None:
                body = json.dumps(source()).encode()
                start_response("200 OK", [("Content-Type", "application/json")])
                return [body]
            assert prometheus_app is not None
            return prometheus_app(environ, start_response)  # type: ignore[no-any-return]

        self._server.set_app(app)
        self.port = self._server.server_port

    def add_streams(self, source: Callable[[], list[dict[str, Any]]]) -> None:
        """A callable returning rows like ``StreamStats.as_dict()``."""
        self._stream_sources.append(source)

    def add_fusion(self, source: Callable[[], dict[str, Any]]) -> None:
        """A callable returning ``FusionWorker.summary()``."""
        self._fusion_sources.append(source)

    def add_actions(self, source: Callable[[], dict[str, Any]]) -> None:
        """A callable returning the action view of ``embodied-bus actions`` (``backlog`` per
        ``kind/p<priority>``, ``kinds``, ``totals``, ``redeliveries``): exported as gauges and
        served as JSON on :data:`BACKLOG_PATH`. Called on the server's thread: return a
        snapshot, do not wait on the bus."""
        self._actions_source = source

    def add_executor(self, source: Callable[[], dict[str, Any]]) -> None:
        """A callable returning ``Executor.stats()``."""
        self._executor_sources.append(source)

    def _collect_executors(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        if not self._executor_sources:
            return
        done = CounterMetricFamily(
            "embodied_bus_executor_actions",
            "actions whose handler returned (completed) or raised (failed)",
            labels=["executor", "outcome"],
        )
        unreported = CounterMetricFamily(
            "embodied_bus_executor_unreported", "outcomes the queue did not accept", labels=["executor"]
        )
        by_executor = ["executor"]
        running = GaugeMetricFamily("embodied_bus_executor_running", "actions running", labels=by_executor)
        slots = GaugeMetricFamily("embodied_bus_executor_slots", "concurrency limit", labels=by_executor)
        for source in self._executor_sources:
            st = source()
            name = str(st["executor"])
            done.add_metric([name, "completed"], float(st["completed"]))
            done.add_metric([name, "failed"], float(st["failed"]))
            unreported.add_metric([name], float(st["unreported"]))
            running.add_metric([name], float(st["running"]))
            slots.add_metric([name], float(st["concurrency"]))
        yield from (done, unreported, running, slots)

    def _collect_actions(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        source = self._actions_source
        if source is None:
            return
        view = source()
        backlog = GaugeMetricFamily(
            "embodied_bus_actions",
            "actions per kind, priority and state (queued, leased, retrying, dead)",
            labels=["kind", "priority", "state"],
        )
        for key, row in sorted(view.get("backlog", {}).items()):
            kind, _, prio = key.rpartition("/p")
            for state, n in row.items():
                backlog.add_metric([kind, prio, state], float(n))
        totals = GaugeMetricFamily(
            "embodied_bus_actions_kept", "actions the queue keeps per status", labels=["status"]
        )
        for status, n in sorted(view.get("totals", {}).items()):
            totals.add_metric([status], float(n))
        yield backlog
        yield totals
        if view.get("redeliveries") is not None:
            yield GaugeMetricFamily(
                "embodied_bus_actions_redeliveries",
                "attempts started on actions started before",
                value=float(view["redeliveries"]),
            )

    def collect(self) -> Iterator[Any]:
        """Prometheus collector protocol."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        counters = {
            k: CounterMetricFamily(f"embodied_bus_stream_{k}", f"samples {k} per stream", labels=["stream"])
            for k in ("received", "gaps", "missing", "dropped", "duplicates", "out_of_order")
        }
        rate = GaugeMetricFamily("embodied_bus_stream_rate_hz", "samples per second", labels=["stream"])
        lat = GaugeMetricFamily(
            "embodied_bus_stream_latency_p99_ms", "publish to receive p99", labels=["stream"]
        )
        for source in self._stream_sources:
            for row in source():
                s = str(row["stream"])
                for k, fam in counters.items():
                    fam.add_metric([s], float(row.get(k) or 0))
                rate.add_metric([s], float(row.get("rate_hz") or 0))
                if row.get("latency_p99_ms") is not None:
                    lat.add_metric([s], float(row["latency_p99_ms"]))
        yield from counters.values()
        yield rate
        yield lat
        fams: dict[str, Any] = {
            "frames": CounterMetricFamily("embodied_bus_fusion_frames", "frames emitted"),
            "late": CounterMetricFamily("embodied_bus_fusion_late", "late samples"),
            "dropped_incomplete": CounterMetricFamily(
                "embodied_bus_fusion_dropped", "incomplete buckets dropped"
            ),
            "completeness_pct": GaugeMetricFamily(
                "embodied_bus_fusion_completeness_pct", "complete frames %"
            ),
            "skew_p99_ms": GaugeMetricFamily("embodied_bus_fusion_skew_p99_ms", "member skew p99"),
            "added_latency_p99_ms": GaugeMetricFamily(
                "embodied_bus_fusion_added_latency_p99_ms", "latency added by fusion p99"
            ),
            "added_latency_on_completion_p99_ms": GaugeMetricFamily(
                "embodied_bus_fusion_added_latency_on_completion_p99_ms",
                "latency added by fusion p99, frames emitted on completion",
            ),
            "forced": CounterMetricFamily(
                "embodied_bus_fusion_forced", "frames forced out by the lateness bound or an idle flush"
            ),
        }
        for fusion_source in self._fusion_sources:
            summary = fusion_source()
            for k, fam in fams.items():
                if summary.get(k) is not None:
                    fam.add_metric([], float(summary[k]))
        yield from fams.values()
        yield from self._collect_actions()
        yield from self._collect_executors()

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()
