"""``embodied-bus top``: a live terminal view of the bus.

Per stream: rate, bandwidth, gaps, drops, latency. Per fusion pipeline (``frames/*`` streams):
frames, completeness, skew, late samples, added latency. Per action kind and priority: queued,
leased, retrying, dead, and the queue's totals (Zenoh: once a queue service answers; Pulsar:
read from the action state log in the background, as ``embodied-bus actions`` reads it, so the
first figures come once the log has been read).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from embodied_bus.actions import Planner
from embodied_bus.bus import Bus, open_bus
from embodied_bus.cli.common import (
    add_bus_args,
    add_metrics_arg,
    fmt_table,
    install_stop_signals,
    queue_backlog,
)
from embodied_bus.cli.streams import stream_rows
from embodied_bus.errors import EmbodiedBusError, EncodingError
from embodied_bus.fusion.codec import FRAME_ENCODING, decode_frame
from embodied_bus.metrics import MetricsExporter
from embodied_bus.model.qos import SubscriptionOptions
from embodied_bus.streams.subscriber import Subscription

__all__ = ["FusionView", "PulsarBacklog", "add_parser"]

_log = logging.getLogger("embodied_bus.cli.top")

COLUMNS = ["stream", "rate_hz", "bandwidth_MBps", "gaps", "dropped", "latency_p50_ms", "latency_p99_ms"]
ACTION_COLUMNS = ["kind/priority", "queued", "leased", "retrying", "dead", "blocked"]
#: Longest wait for the action queue service's answer per refresh, seconds.
ACTIONS_TIMEOUT_S = 0.5
#: Pause between two reads of the Pulsar action backlog, seconds.
PULSAR_BACKLOG_EVERY_S = 1.0


@dataclass
class FusionView:
    """What ``top`` learns about one fusion pipeline from its frames."""

    frames: int = 0
    complete: int = 0
    late: int = 0
    skew_ms: deque[float] = field(default_factory=lambda: deque(maxlen=1000))
    added_ms: deque[float] = field(default_factory=lambda: deque(maxlen=1000))

    def row(self, name: str) -> dict[str, Any]:
        def p99(d: deque[float]) -> float | None:
            return round(float(np.percentile(list(d), 99)), 2) if d else None

        return {
            "pipeline": name,
            "frames": self.frames,
            "complete_pct": round(100 * self.complete / self.frames, 1) if self.frames else None,
            "skew_p99_ms": p99(self.skew_ms),
            "added_p99_ms": p99(self.added_ms),
            "late": self.late,
        }


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("top", help="live view: streams, fusion pipelines (and action queues)")
    add_bus_args(p)
    p.add_argument("--interval", type=float, default=1.0, help="refresh period in seconds")
    p.add_argument("--duration", type=float, default=0.0, help="stop after S seconds (0 = Ctrl-C)")
    p.add_argument("--json", action="store_true", help="print one JSON snapshot per refresh")
    add_metrics_arg(p)
    p.set_defaults(func=run)


async def _watch(sub: Subscription, views: dict[str, FusionView], stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            s = await sub.recv(timeout_s=0.2)
        except TimeoutError:
            continue
        if s.header.encoding != FRAME_ENCODING:
            continue
        try:
            f = decode_frame(s.payload)
        except EncodingError:
            continue
        v = views.setdefault(s.stream, FusionView())
        if f.pane:
            continue
        v.frames += 1
        v.complete += f.complete
        v.late = max(v.late, v.late + f.late_count)
        if f.max_skew_ns is not None:  # None: no member besides the reference
            v.skew_ms.append(f.max_skew_ns / 1e6)
        if f.last_arrival_ns:
            v.added_ms.append((s.header.publish_ns - f.last_arrival_ns) / 1e6)


class PulsarBacklog:
    """The action backlog on Pulsar, read by a planner from the action state log in a
    background task: a refresh of ``top`` never waits for it (the first read replays the log),
    it shows the latest answer."""

    def __init__(self, bus: Bus) -> None:
        self._planner = Planner(bus)
        #: The latest backlog and totals, None until the log has been read once.
        self.latest: dict[str, Any] | None = None
        #: Why the latest read failed, if it did.
        self.error: str | None = None
        self._task = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            try:
                reply = await self._planner.backlog()
            except (EmbodiedBusError, TimeoutError) as err:  # shown; the next read may succeed
                self.error = str(err) or type(err).__name__
            else:
                as_dict = reply.as_dict()
                self.latest = {"backlog": as_dict["backlog"], "totals": as_dict["stats"]}
                self.error = None
            await asyncio.sleep(PULSAR_BACKLOG_EVERY_S)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self._planner.close()


async def _action_backlog(bus: Bus, pulsar: PulsarBacklog | None) -> dict[str, Any] | None:
    """The action backlog and totals: on Zenoh the queue service's answer (None where none
    answers), on Pulsar the latest read of the state log (None before the first)."""
    if pulsar is not None:
        return pulsar.latest
    reply = await queue_backlog(bus, ACTIONS_TIMEOUT_S)
    if reply is None:
        return None
    as_dict = reply.as_dict()
    return {"backlog": as_dict["backlog"], "totals": as_dict["stats"]}


def _actions_text(bus: Bus, actions: dict[str, Any] | None, pulsar: PulsarBacklog | None = None) -> str:
    if actions is None:
        if pulsar is not None:
            if pulsar.error is not None:
                return f"actions: cannot read the action state log: {pulsar.error}"
            return "actions: reading the action state log ..."
        return "actions: no action queue service answered"
    rows = [{"kind/priority": k, **v} for k, v in sorted(actions["backlog"].items())]
    table = fmt_table(rows, ACTION_COLUMNS) if rows else "actions: none queued"
    totals = actions.get("totals")
    return table + (f"\ntotals: {json.dumps(totals)}" if totals else "")


async def run(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    install_stop_signals(stop)
    views: dict[str, FusionView] = {}
    async with open_bus(args.bus, namespace=args.ns) as bus:
        sub = await bus.subscribe(None, options=SubscriptionOptions(capacity=4096))
        exporter = MetricsExporter(args.metrics_port) if args.metrics_port is not None else None
        if exporter is not None:
            exporter.add_streams(lambda: stream_rows(sub))
        task = asyncio.create_task(_watch(sub, views, stop))
        pulsar = PulsarBacklog(bus) if bus.engine_name == "pulsar" else None
        t0 = time.monotonic()
        tty = sys.stdout.isatty() and not args.json
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), args.interval)
            except TimeoutError:
                pass
            rows = [r for r in stream_rows(sub) if not str(r["stream"]).startswith("frames/")]
            fusion = [v.row(k) for k, v in sorted(views.items())]
            actions = await _action_backlog(bus, pulsar)
            if args.json:
                print(
                    json.dumps(
                        {
                            "t_s": round(time.monotonic() - t0, 1),
                            "streams": rows,
                            "fusion": fusion,
                            "actions": actions,
                        }
                    ),
                    flush=True,
                )
            else:
                screen = [
                    f"embodied-bus top — {args.bus} (namespace {bus.namespace})  "
                    f"t = {time.monotonic() - t0:.0f} s",
                    "",
                    fmt_table(rows, COLUMNS) if rows else "no streams yet",
                    "",
                ]
                if fusion:
                    screen.append(
                        fmt_table(
                            fusion,
                            ["pipeline", "frames", "complete_pct", "skew_p99_ms", "added_p99_ms", "late"],
                        )
                    )
                screen += ["", _actions_text(bus, actions, pulsar)]
                print(("\x1b[2J\x1b[H" if tty else "") + "\n".join(screen), flush=True)
            if args.duration and time.monotonic() - t0 >= args.duration:
                stop.set()
        await task
        if pulsar is not None:
            await pulsar.close()
        if exporter is not None:
            exporter.close()
    return 0
