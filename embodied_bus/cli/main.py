"""Entry point of ``embodied-bus``."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import signal
import sys

from embodied_bus import __version__
from embodied_bus.cli import (
    actions,
    demo,
    doctor,
    echo,
    fuse,
    info,
    keys,
    plot,
    pub,
    record,
    replay,
    ros_bridge,
    router,
    sim,
    stage,
    state,
    streams,
    top,
    uplink,
    view,
)
from embodied_bus.errors import EmbodiedBusError
from embodied_bus.loop import loop_runner

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="embodied-bus",
        description="Robot middleware: sensor streams over Zenoh (embedded) and Apache Pulsar.",
        epilog="A running command prints every thread's stack to stderr on SIGUSR1 "
        "(kill -USR1 PID), to see where it waits.",
    )
    parser.add_argument("--version", action="version", version=f"embodied-bus {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    subcommands = (
        demo,
        pub,
        echo,
        streams,
        top,
        view,
        info,
        replay,
        record,
        sim,
        fuse,
        stage,
        plot,
        router,
        ros_bridge,
        keys,
        state,
        uplink,
        doctor,
    )
    for module in subcommands:
        module.add_parser(sub)
    actions.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    with contextlib.suppress(AttributeError, OSError, ValueError):  # stderr without a file (embedded)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        _, run = loop_runner()
        return int(run(args.func(args)) or 0)
    except EmbodiedBusError as err:
        print(f"embodied-bus {args.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
