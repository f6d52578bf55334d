"""``embodied-bus record``: bus streams and fused frames into MCAP for Foxglove."""

from __future__ import annotations

import argparse
import asyncio
import json

from embodied_bus.bus import open_bus
from embodied_bus.cli.common import add_bus_args, install_stop_signals, serve_until
from embodied_bus.replay.recorder import record

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("record", help="record streams and fused frames to MCAP (ROS 2 schemas)")
    p.add_argument("out", metavar="OUT.mcap")
    add_bus_args(p)
    p.add_argument("--streams", nargs="+", default=None, help="streams to record (default: all)")
    p.add_argument("--frames", nargs="+", default=[], metavar="NAME", help="fusion pipelines to record")
    p.add_argument("--duration", type=float, default=0.0, help="stop after S seconds (0 = Ctrl-C)")
    p.set_defaults(func=run)


async def run(args: argparse.Namespace) -> int:
    streams = None
    if args.streams or args.frames:
        streams = list(args.streams or []) + [f"frames/{n}" for n in args.frames]
    stop = asyncio.Event()
    install_stop_signals(stop)
    async with open_bus(args.bus, namespace=args.ns) as bus:
        ready = asyncio.Event()
        task = asyncio.create_task(record(bus, args.out, streams, stop, ready=ready))
        await ready.wait()
        print(f"recording {', '.join(streams) if streams else 'every stream'} to {args.out}", flush=True)
        await serve_until(stop, [task], duration_s=args.duration)
        counts = await task
    print(json.dumps({"out": args.out, "messages": counts}))
    return 0
