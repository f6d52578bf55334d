"""``embodied-bus view``: serve the bus live to Foxglove (streams, fused frames, action queue).

Also ``--view [PORT]`` on ``demo``, ``replay`` and ``fuse`` (:func:`add_view_arg`,
:func:`serving_view`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

from embodied_bus.bus import Bus, open_bus
from embodied_bus.cli.common import add_bus_args, add_credential_args, install_stop_signals, queue_backend
from embodied_bus.errors import BusConfigError

__all__ = ["add_parser", "add_view_arg", "serving_view"]

LAYOUT_HINT = "layout: embodied-bus view --write-layout embodied_bus.json, then Layouts → Import in Foxglove"


def add_view_arg(p: argparse.ArgumentParser) -> None:
    """``--view [PORT]``: serve the bus to Foxglove while the command runs."""
    p.add_argument(
        "--view",
        type=int,
        nargs="?",
        const=8765,
        default=None,
        metavar="PORT",
        help="serve the bus live to Foxglove on this port while running (default port 8765)",
    )


@contextlib.asynccontextmanager
async def serving_view(bus: Bus, port: int | None, *, host: str = "127.0.0.1") -> AsyncIterator[None]:
    """Serve ``bus`` (with its action queue) on ``port`` for the body; nothing if ``port`` is None."""
    if port is None:
        yield
        return
    from embodied_bus.actions.queue import QueueOptions, open_queue
    from embodied_bus.viz.live import LiveView, ViewOptions

    queue = open_queue(bus, QueueOptions(request_timeout_s=1.0))
    try:
        async with LiveView(bus, ViewOptions(host=host, port=port), queue=queue) as view:
            print(f"live view for Foxglove: {view.url}  ({LAYOUT_HINT})", file=sys.stderr, flush=True)
            yield
    finally:
        await queue.close()


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "view", help="serve the bus live to Foxglove: streams, fused frames, the action queue, statistics"
    )
    add_bus_args(p)
    p.add_argument("--host", default="127.0.0.1", help="interface to serve on (0.0.0.0: every one)")
    p.add_argument("--port", type=int, default=8765, help="WebSocket port (default: %(default)s)")
    p.add_argument("--streams", nargs="+", metavar="STREAM", help="streams to show (default: every stream)")
    p.add_argument(
        "--frames", nargs="+", metavar="PIPELINE", help="fusion pipelines to show (default: every one)"
    )
    p.add_argument("--no-actions", action="store_true", help="do not show the action queue")
    p.add_argument(
        "--duration", type=float, default=0.0, help="stop after this many seconds (default: never)"
    )
    p.add_argument(
        "--write-layout",
        metavar="FILE.json",
        help="write the Foxglove layout of the demo to this file and exit",
    )
    p.add_argument("--json", action="store_true", help="print what was forwarded per channel as JSON at exit")
    add_credential_args(p)
    p.set_defaults(func=run)


async def run(args: argparse.Namespace) -> int:
    from embodied_bus.actions.queue import QueueOptions, open_queue
    from embodied_bus.viz.layout import write_layout
    from embodied_bus.viz.live import LiveView, ViewOptions

    if args.write_layout:
        print(write_layout(Path(args.write_layout)))
        return 0
    if not 0 <= args.port <= 65535:
        raise BusConfigError(f"--port {args.port}: expected 0-65535")
    stop = asyncio.Event()
    install_stop_signals(stop)
    options = ViewOptions(
        host=args.host,
        port=args.port,
        streams=tuple(args.streams) if args.streams else None,
        pipelines=tuple(args.frames) if args.frames else None,
    )
    backend = queue_backend(args)
    async with open_bus(args.bus, namespace=args.ns) as bus:
        queue = (
            None if args.no_actions else open_queue(bus, QueueOptions(request_timeout_s=1.0, backend=backend))
        )
        try:
            async with LiveView(bus, options, queue=queue) as view:
                print(
                    f"serving {args.bus} (namespace {bus.namespace}) to Foxglove on {view.url}\n"
                    f"  Foxglove: Open connection → Foxglove WebSocket → {view.url}\n  {LAYOUT_HINT}",
                    file=sys.stderr,
                    flush=True,
                )
                t0 = time.monotonic()
                while not stop.is_set():
                    try:
                        await asyncio.wait_for(stop.wait(), 1.0)
                    except TimeoutError:
                        pass
                    if args.duration and time.monotonic() - t0 >= args.duration:
                        break
                if args.json:
                    print(json.dumps(view.view_stats()))
        finally:
            if queue is not None:
                await queue.close()
    return 0
