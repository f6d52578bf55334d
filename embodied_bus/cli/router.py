"""``embodied-bus router``: host a Zenoh router in this process (no separate zenohd needed)."""

from __future__ import annotations

import argparse
import asyncio

from embodied_bus.bus import open_bus
from embodied_bus.cli.common import install_stop_signals

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("router", help="host a Zenoh router for the robot's processes")
    p.add_argument(
        "--listen",
        action="append",
        default=None,
        help="endpoint to listen on (repeatable; default tcp/0.0.0.0:7447)",
    )
    p.add_argument(
        "--multicast-scouting",
        action="store_true",
        help="let peers on the LAN discover this router by multicast",
    )
    p.set_defaults(func=run)


async def run(args: argparse.Namespace) -> int:
    listen = ",".join(args.listen or ["tcp/0.0.0.0:7447"])
    url = f"zenoh:?mode=router&listen={listen}"
    if args.multicast_scouting:
        url += "&scouting=multicast"
    stop = asyncio.Event()
    install_stop_signals(stop)
    async with open_bus(url):
        print(f"zenoh router listening on {listen}; Ctrl-C to stop", flush=True)
        await stop.wait()
    return 0
