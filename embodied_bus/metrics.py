"""Prometheus metrics of the long-running commands (``--metrics-port``).

Values are read from the live objects (subscription statistics, fusion metrics) when Prometheus
scrapes, through a custom collector: nothing is counted twice and nothing runs on the hot path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["MetricsExporter"]


class MetricsExporter:
    """Serves ``/metrics`` on a port; register sources with :meth:`add_streams` and
    :meth:`add_fusion`.

    Args:
        port: TCP port (0 picks a free one; see :attr:`port`).
        addr: Bind address (default all interfaces).
    """

    def __init__(self, port: int, addr: str = "0.0.0.0") -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self._stream_sources: list[Callable[[], list[dict[str, Any]]]] = []
        self._fusion_sources: list[Callable[[], dict[str, Any]]] = []
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)  # type: ignore[arg-type]
        self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        self.port = self._server.server_port

    def add_streams(self, source: Callable[[], list[dict[str, Any]]]) -> None:
        """A callable returning rows like ``StreamStats.as_dict()``."""
        self._stream_sources.append(source)

    def add_fusion(self, source: Callable[[], dict[str, Any]]) -> None:
        """A callable returning ``FusionWorker.summary()``."""
        self._fusion_sources.append(source)

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

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()
