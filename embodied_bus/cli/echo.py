"""``embodied-bus echo``: print the samples of a stream with their header fields."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from embodied_bus.bus import open_bus
from embodied_bus.cli.common import add_bus_args, install_stop_signals
from embodied_bus.model.qos import Backpressure, SubscriptionOptions
from embodied_bus.model.sample import Sample

__all__ = ["add_parser", "describe"]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("echo", help="print samples of a stream with their header fields")
    p.add_argument("stream", nargs="?", default=None, help="stream name (default: every stream)")
    add_bus_args(p)
    p.add_argument("--count", type=int, default=0, help="exit after N samples (0 = never)")
    p.add_argument(
        "--timeout",
        type=float,
        default=0.0,
        metavar="S",
        help="exit with status 1 if no sample arrives for S seconds (0 = wait forever)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument(
        "--failover",
        metavar="GROUP",
        help="active/standby: of the echoes of this group only the oldest live one prints; when it "
        "dies another takes over, with nothing lost (each sample acknowledged once printed)",
    )
    p.set_defaults(func=run)


def describe(s: Sample) -> dict[str, object]:
    """Header fields of a sample as a JSON-ready dict."""
    h = s.header
    return {
        "stream": h.stream,
        "modality": h.modality.name.lower(),
        "seq": h.seq,
        "stamp_ns": h.stamp_ns,
        "bucket": h.bucket,
        "encoding": h.encoding,
        "frame_id": h.frame_id,
        "size": len(s.payload),
        "latency_ms": round(s.latency_ns / 1e6, 3),
        "flags": int(h.flags),
        "out_of_order": s.out_of_order,
    }


async def run(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    install_stop_signals(stop)
    async with open_bus(args.bus, namespace=args.ns) as bus:
        options = None
        if args.failover:
            options = SubscriptionOptions(
                capacity=1000, backpressure=Backpressure.BLOCK, auto_ack=False, failover_group=args.failover
            )
        sub = await bus.subscribe(args.stream, options=options)
        if args.failover:
            print(f"echo: a member of failover group {args.failover}", file=sys.stderr, flush=True)
        n = 0
        while not stop.is_set() and (args.count == 0 or n < args.count):
            try:
                s = await sub.recv(timeout_s=args.timeout or 0.5)
            except TimeoutError:
                if args.timeout:
                    print(f"no sample within {args.timeout:g} s", flush=True)
                    return 1
                continue
            n += 1
            d = describe(s)
            if args.json:
                print(json.dumps(d), flush=True)
            else:
                print(" ".join(f"{k}={v}" for k, v in d.items()), flush=True)
            s.ack()  # printed (a no-op unless --failover)
    return 0
