"""``embodied-bus replay``: recordings into the bus with faithful timing."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from embodied_bus.bus import open_bus
from embodied_bus.cli.common import add_bus_args, add_clock_arg, bucket_clock, install_stop_signals
from embodied_bus.cli.view import add_view_arg, serving_view
from embodied_bus.errors import BusConfigError
from embodied_bus.replay.player import ReplayOptions, replay

__all__ = ["add_parser", "mapping_from_config"]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("replay", help="replay rosbag2 (sqlite3, MCAP), legacy .db3 and ROS 1 bags")
    p.add_argument("paths", nargs="+", metavar="PATH")
    add_bus_args(p)
    add_view_arg(p)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--rate", type=float, default=1.0, help="speed factor (default 1.0)")
    g.add_argument("--fast", action="store_true", help="as fast as possible, deterministic order")
    p.add_argument("--loop", action="store_true", help="start over at the end")
    p.add_argument("--start", type=float, default=0.0, metavar="S", help="skip the first S seconds")
    p.add_argument("--duration", type=float, default=None, metavar="S", help="replay S seconds")
    p.add_argument("--topics", nargs="+", default=None, help="only these topics")
    p.add_argument(
        "--map",
        action="append",
        default=[],
        metavar="/topic=stream",
        help="publish a topic under another stream name (repeatable)",
    )
    p.add_argument(
        "--config",
        help="robot YAML: its streams: map topics to streams, its clock: or fusion: gives the bucket clock",
    )
    add_clock_arg(p)
    p.add_argument(
        "--stamp",
        choices=["header", "log"],
        default="header",
        help="sensor header stamps (zero ones fall back to log time, flagged) or log time",
    )
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(func=run)


def mapping_from_config(path: str) -> dict[str, str]:
    """Topic → stream from a robot YAML: ``streams: {stream: {topic: /x}}`` or ``{/topic: stream}``."""
    try:
        doc = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise BusConfigError(f"cannot read {path!r}: {err}") from err
    streams = doc.get("streams", {}) if isinstance(doc, dict) else {}
    out: dict[str, str] = {}
    for key, value in (streams or {}).items():
        if isinstance(value, dict) and "topic" in value:
            out[str(value["topic"])] = str(key)
        elif isinstance(value, str):
            out[str(key)] = value
    return out


async def run(args: argparse.Namespace) -> int:
    mapping = mapping_from_config(args.config) if args.config else {}
    for item in args.map:
        topic, sep, stream = item.partition("=")
        if not sep or not topic or not stream:
            raise BusConfigError(f"--map expects /topic=stream, got {item!r}")
        mapping[topic] = stream
    opts = ReplayOptions(
        rate=args.rate,
        fast=args.fast,
        loop=args.loop,
        start_s=args.start,
        duration_s=args.duration,
        topics=tuple(args.topics) if args.topics else None,
        mapping=mapping,
        stamp=args.stamp,
        clock=bucket_clock(args.spec, config=args.config),
    )
    stop = asyncio.Event()
    install_stop_signals(stop)
    progress_cb: Any = None
    bar: Any = None
    if sys.stderr.isatty() and not args.json:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        bar = Progress(
            TextColumn("replay"),
            BarColumn(),
            TextColumn("{task.percentage:>3.0f}%"),
            TextColumn("{task.fields[n]} msgs"),
            TimeRemainingColumn(),
            transient=True,
        )
        task_id = bar.add_task("replay", total=1.0, n=0)

        def progress_cb(frac: float, n: int) -> None:
            bar.update(task_id, completed=frac, n=n)

        bar.start()
    try:
        async with open_bus(args.bus, namespace=args.ns) as bus, serving_view(bus, args.view):
            summary = await replay(bus, args.paths, opts, stop=stop, progress=progress_cb)
    finally:
        if bar is not None:
            bar.stop()
    doc = summary.as_dict()
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        for topic, reason in doc["skipped"].items():
            print(f"skipped {topic}: {reason}", file=sys.stderr)
        print(
            f"replayed {doc['total']} messages of {len(doc['messages'])} topics in {doc['wall_s']} s"
            f" (timing error p50 {doc['timing_error_p50_ms']} ms, p99 {doc['timing_error_p99_ms']} ms)"
        )
    return 0
