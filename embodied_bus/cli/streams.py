"""``embodied-bus streams``: list live streams with rate, gaps and latency."""

from __future__ import annotations

import argparse
import asyncio
import json

from embodied_bus.bus import open_bus
from embodied_bus.cli.common import add_bus_args, fmt_table, install_stop_signals
from embodied_bus.model.qos import SubscriptionOptions
from embodied_bus.streams.subscriber import Subscription

__all__ = ["COLUMNS", "add_parser", "drain", "stream_rows"]

COLUMNS = [
    "stream",
    "received",
    "rate_hz",
    "bandwidth_MBps",
    "gaps",
    "missing",
    "out_of_order",
    "duplicates",
    "dropped",
    "latency_p50_ms",
    "latency_p99_ms",
]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("streams", help="list live streams with rate, gaps and latency")
    add_bus_args(p)
    p.add_argument("--duration", type=float, default=3.0, help="seconds to listen (default: 3)")
    p.add_argument("--json", action="store_true", help="print a JSON document")
    p.set_defaults(func=run)


def stream_rows(sub: Subscription) -> list[dict[str, object]]:
    """One summary row per stream seen by the subscription."""
    return [sub.stats[k].as_dict() for k in sorted(sub.stats)]


async def drain(sub: Subscription, stop: asyncio.Event) -> None:
    """Consume samples (statistics are kept by the subscription) until ``stop``."""
    while not stop.is_set():
        try:
            await sub.recv(timeout_s=0.2)
        except TimeoutError:
            continue


async def run(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    install_stop_signals(stop)
    async with open_bus(args.bus, namespace=args.ns) as bus:
        sub = await bus.subscribe(None, options=SubscriptionOptions(capacity=1024))
        task = asyncio.create_task(drain(sub, stop))
        try:
            await asyncio.wait_for(stop.wait(), args.duration)
        except TimeoutError:
            pass
        stop.set()
        await task
        rows = stream_rows(sub)
        if args.json:
            print(
                json.dumps(
                    {
                        "bus": args.bus,
                        "namespace": bus.namespace,
                        "streams": rows,
                        "malformed": sub.malformed,
                    },
                    indent=2,
                )
            )
        elif rows:
            print(fmt_table(rows, COLUMNS))
        else:
            print(f"no streams seen on {args.bus} (namespace {bus.namespace}) in {args.duration:g} s")
    return 0
