"""``embodied-bus router``: host a Zenoh router in this process (no separate zenohd needed)."""

from __future__ import annotations

import argparse
import asyncio

from embodied_bus.bus import open_bus
from embodied_bus.cli.common import install_stop_signals
from embodied_bus.errors import BusConnectionError

__all__ = ["DEFAULT_LISTEN", "add_parser"]

#: Where the router listens unless told: every address, IPv6 and IPv4 (a dual-stack socket),
#: else IPv4 only on a host without IPv6; rmw_zenoh's router port.
DEFAULT_LISTEN = ("tcp/[::]:7447", "tcp/0.0.0.0:7447")


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("router", help="host a Zenoh router for the robot's processes")
    p.add_argument(
        "--listen",
        action="append",
        default=None,
        help="endpoint to listen on (repeatable; default tcp/[::]:7447, or tcp/0.0.0.0:7447 on a host "
        "without IPv6)",
    )
    p.add_argument(
        "--multicast-scouting",
        action="store_true",
        help="let peers on the LAN discover this router by multicast",
    )
    p.set_defaults(func=run)


async def run(args: argparse.Namespace) -> int:
    tries = [args.listen] if args.listen else [[endpoint] for endpoint in DEFAULT_LISTEN]
    stop = asyncio.Event()
    install_stop_signals(stop)
    for i, endpoints in enumerate(tries):
        listen = ",".join(endpoints)
        url = f"zenoh:?mode=router&listen={listen}" + (
            "&scouting=multicast" if args.multicast_scouting else ""
        )
        try:
            bus = await open_bus(url)
        except BusConnectionError:
            if i + 1 == len(tries):
                raise
            continue  # no IPv6 here: IPv4 only
        try:
            print(f"zenoh router listening on {listen}; Ctrl-C to stop", flush=True)
            await stop.wait()
        finally:
            await bus.close()
        break
    return 0
