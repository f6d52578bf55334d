"""``embodied-bus demo``: synthetic lidar / camera / GPS / IMU over embedded Zenoh, live stats."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from embodied_bus.bus import open_bus
from embodied_bus.cli.common import fmt_table, install_stop_signals
from embodied_bus.cli.streams import drain, stream_rows
from embodied_bus.model.qos import SubscriptionOptions
from embodied_bus.sim.synthetic import DEFAULT_SENSORS, run_sensor
from embodied_bus.testing.ports import free_port

__all__ = ["add_parser"]

LIVE_COLUMNS = [
    "stream",
    "received",
    "rate_hz",
    "bandwidth_MBps",
    "gaps",
    "dropped",
    "latency_p50_ms",
    "latency_p99_ms",
]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="synthetic sensors over embedded Zenoh with live stats")
    p.add_argument("--duration", type=float, default=10.0, help="seconds to run (default: 10)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


async def run(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    install_stop_signals(stop)
    port = free_port()
    # Two real Zenoh sessions on loopback: the "robot" (listening peer) and a monitor.
    robot_url = f"zenoh:?listen=tcp/127.0.0.1:{port}"
    monitor_url = f"zenoh://127.0.0.1:{port}"
    tty = sys.stdout.isatty() and not args.json
    async with (
        open_bus(robot_url, namespace="demo") as robot,
        open_bus(monitor_url, namespace="demo") as monitor,
    ):
        sub = await monitor.subscribe(None, options=SubscriptionOptions(capacity=4096))
        pubs = [
            await robot.publisher(s.stream, modality=s.modality, encoding=s.encoding, frame_id=s.frame_id)
            for s in DEFAULT_SENSORS
        ]
        for p in pubs:
            await p.wait_for_subscribers(5.0)
        drainer = asyncio.create_task(drain(sub, stop))
        sensors = [
            asyncio.create_task(run_sensor(p, s, stop, seed=i))
            for i, (p, s) in enumerate(zip(pubs, DEFAULT_SENSORS, strict=False))
        ]
        t0 = time.monotonic()
        if not args.json:
            print(
                f"embodied_bus demo: 4 synthetic sensors over embedded Zenoh "
                f"(tcp/127.0.0.1:{port}) for {args.duration:g} s",
                flush=True,
            )
        while not stop.is_set() and time.monotonic() - t0 < args.duration:
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass
            if not args.json:
                table = fmt_table(stream_rows(sub), LIVE_COLUMNS)
                if tty:
                    print("\x1b[2J\x1b[H" + f"t = {time.monotonic() - t0:4.1f} s\n" + table, flush=True)
                else:
                    print(f"-- t = {time.monotonic() - t0:4.1f} s\n{table}", flush=True)
        stop.set()
        sent = dict(zip([s.stream for s in DEFAULT_SENSORS], await asyncio.gather(*sensors), strict=False))
        # give in-flight samples a moment to land before the final numbers
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and any(
            sub.stats.get(k) is None or sub.stats[k].received < v for k, v in sent.items()
        ):
            await asyncio.sleep(0.02)
        drainer.cancel()
        rows = stream_rows(sub)
        for r in rows:
            r["sent"] = sent.get(str(r["stream"]), 0)
        summary = {
            "bus": "zenoh (embedded peers on loopback)",
            "duration_s": args.duration,
            "streams": rows,
            "malformed": sub.malformed,
        }
        if args.json:
            print(json.dumps(summary, indent=2))
        else:
            print("\nsummary")
            print(
                fmt_table(
                    rows,
                    ["stream", "sent", "received", "gaps", "dropped", "latency_p50_ms", "latency_p99_ms"],
                )
            )
        ok = all(r["received"] for r in rows) and len(rows) == len(DEFAULT_SENSORS)
    return 0 if ok else 1
