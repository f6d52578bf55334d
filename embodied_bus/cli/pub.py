"""``embodied-bus pub``: publish synthetic samples."""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

from embodied_bus.bus import open_bus
from embodied_bus.cli.common import add_bus_args, add_clock_arg, bucket_clock, install_stop_signals
from embodied_bus.model.qos import Backpressure, PublisherOptions

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("pub", help="publish synthetic samples on a stream")
    p.add_argument("stream", help="stream name, e.g. lidar/front")
    add_bus_args(p)
    p.add_argument("--modality", default="other", help="lidar, camera, gps, imu, ... (default: other)")
    p.add_argument("--rate", type=float, default=10.0, help="samples per second (default: 10)")
    p.add_argument("--count", type=int, default=0, help="samples to send, 0 = until Ctrl-C")
    p.add_argument("--size", type=int, default=1024, help="payload bytes (default: 1024)")
    p.add_argument("--encoding", default="raw")
    p.add_argument("--frame-id", default="")
    p.add_argument(
        "--wait-subscriber",
        type=float,
        default=0.0,
        metavar="S",
        help="wait up to S seconds for a subscriber before sending",
    )
    p.add_argument("--block", action="store_true", help="lossless publishing (backpressure=block)")
    add_clock_arg(p)
    p.set_defaults(func=run)


async def run(args: argparse.Namespace) -> int:
    if args.rate <= 0:
        raise SystemExit("--rate must be positive")
    if args.size < 0:
        raise SystemExit("--size must be >= 0")
    stop = asyncio.Event()
    install_stop_signals(stop)
    opts = PublisherOptions(backpressure=Backpressure.BLOCK if args.block else Backpressure.DROP_OLDEST)
    payload = np.random.default_rng(0).integers(0, 255, args.size, dtype=np.uint8).tobytes()
    async with open_bus(args.bus, namespace=args.ns) as bus:
        pub = await bus.publisher(
            args.stream,
            modality=args.modality,
            encoding=args.encoding,
            frame_id=args.frame_id,
            clock=bucket_clock(args.spec),
            options=opts,
        )
        if args.wait_subscriber > 0 and not await pub.wait_for_subscribers(args.wait_subscriber):
            print(f"no subscriber on {args.stream!r} after {args.wait_subscriber:g} s; sending anyway")
        period = 1.0 / args.rate
        start = time.monotonic()
        n = 0
        while not stop.is_set() and (args.count == 0 or n < args.count):
            await pub.publish(payload, stamp_ns=time.time_ns())
            n += 1
            delay = start + n * period - time.monotonic()
            if delay > 0:
                try:
                    await asyncio.wait_for(stop.wait(), delay)
                except TimeoutError:
                    pass
        await pub.flush()
        print(f"published {n} samples on {args.stream!r} ({pub.dropped} dropped by the engine)")
    return 0
