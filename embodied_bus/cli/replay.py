"""``embodied-bus replay``: recordings into the bus (or, with ``--ros``, onto ROS 2 topics over
rmw_zenoh) with faithful timing; space (on a terminal) or SIGUSR1 pauses and resumes."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import yaml

from embodied_bus.bus import open_bus
from embodied_bus.cli.common import add_bus_args, add_clock_arg, bucket_clock, install_stop_signals
from embodied_bus.cli.view import add_view_arg, serving_view
from embodied_bus.errors import BusConfigError
from embodied_bus.replay.player import ReplayOptions, ReplaySummary, replay
from embodied_bus.replay.targets import ReplayControl
from embodied_bus.ros.config import RobotConfig, RosLink, load_robot_config

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
    p.add_argument(
        "--start-paused", action="store_true", help="wait for space (or SIGUSR1) before the first message"
    )
    p.add_argument(
        "--wait-subscribers",
        type=float,
        default=0.0,
        metavar="S",
        help="before the first message, wait up to S seconds for a subscriber on every topic",
    )
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    r = p.add_argument_group(
        "ROS 2 (through rclpy where this Python has it, else rmw_zenoh with no ROS install)"
    )
    r.add_argument(
        "--ros", action="store_true", help="publish the topics as ROS 2 topics instead of bus streams"
    )
    r.add_argument(
        "--clock",
        type=float,
        nargs="?",
        const=40.0,
        default=None,
        metavar="HZ",
        help="with --ros: publish /clock (rosgraph_msgs/Clock) at HZ (default 40) for use_sim_time",
    )
    r.add_argument(
        "--rmw-zenoh",
        action="store_true",
        help="with --ros: speak rmw_zenoh directly even where rclpy is there",
    )
    r.add_argument(
        "--connect", metavar="ENDPOINT", action="append", default=None, help="the robot's Zenoh router(s)"
    )
    r.add_argument("--host-router", metavar="ENDPOINT", help="be the Zenoh router, on ENDPOINT")
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


def _options(args: argparse.Namespace) -> ReplayOptions:
    mapping = mapping_from_config(args.config) if args.config else {}
    for item in args.map:
        topic, sep, stream = item.partition("=")
        if not sep or not topic or not stream:
            raise BusConfigError(f"--map expects /topic=stream, got {item!r}")
        mapping[topic] = stream
    return ReplayOptions(
        rate=args.rate,
        fast=args.fast,
        loop=args.loop,
        start_s=args.start,
        duration_s=args.duration,
        topics=tuple(args.topics) if args.topics else None,
        mapping=mapping,
        stamp=args.stamp,
        clock=bucket_clock(args.spec, config=args.config),
        wait_subscribers_s=args.wait_subscribers,
    )


@contextlib.contextmanager
def _progress_bar(enabled: bool) -> Iterator[Any]:
    if not enabled:
        yield None
        return
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
        yield progress_cb
    finally:
        bar.stop()


@contextlib.contextmanager
def pause_controls(control: ReplayControl) -> Iterator[None]:
    """Space on a terminal, or SIGUSR1 from anywhere, pauses and resumes the replay."""
    loop = asyncio.get_running_loop()

    def toggle() -> None:
        control.toggle()
        print("paused (space or SIGUSR1 resumes)" if control.paused else "resumed", file=sys.stderr)

    with contextlib.suppress(NotImplementedError, RuntimeError, AttributeError):
        loop.add_signal_handler(signal.SIGUSR1, toggle)
    restore: Any = None
    fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None
    if fd is not None:
        import termios
        import tty

        restore = termios.tcgetattr(fd)
        tty.setcbreak(fd)

        def on_key() -> None:
            if os.read(fd, 1) == b" ":
                toggle()

        loop.add_reader(fd, on_key)
    try:
        yield
    finally:
        if fd is not None:
            import termios

            loop.remove_reader(fd)
            termios.tcsetattr(fd, termios.TCSADRAIN, restore)
        with contextlib.suppress(NotImplementedError, RuntimeError, AttributeError):
            loop.remove_signal_handler(signal.SIGUSR1)


def _ros_link(args: argparse.Namespace) -> RosLink:
    cfg = load_robot_config(args.config) if args.config else RobotConfig()
    link = cfg.ros
    return RosLink(
        link.domain_id,
        link.distro,
        "embodied_bus_player",
        link.namespace,
        tuple(args.connect) if args.connect else link.connect,
        args.host_router or (None if args.connect else link.host_router),
        link.interfaces,
    )


@contextlib.asynccontextmanager
async def _ros_target(args: argparse.Namespace, control: ReplayControl) -> AsyncIterator[Any]:
    """Through rclpy where this Python has it (the ROS install's middleware, DDS included),
    else over rmw_zenoh with no ROS install."""
    from embodied_bus.ros.rclpy_replay import rclpy_available, rclpy_replay_target

    if rclpy_available() and not args.rmw_zenoh:
        async with rclpy_replay_target(
            "embodied_bus_player", clock_hz=args.clock, rate=args.rate, control=control
        ) as target:
            print("replay: ROS 2 node embodied_bus_player through rclpy", file=sys.stderr)
            yield target
        return
    async with _rmw_zenoh_target(args, control) as rmw_target:
        yield rmw_target


@contextlib.asynccontextmanager
async def _rmw_zenoh_target(args: argparse.Namespace, control: ReplayControl) -> AsyncIterator[Any]:
    from embodied_bus.ros.rmw_bridge import open_rmw_session
    from embodied_bus.ros.rmw_node import RmwNode
    from embodied_bus.ros.rmw_replay import RosReplayTarget
    from embodied_bus.rosmsg.interfaces import Interfaces

    link = _ros_link(args)
    session = await open_rmw_session(link)
    node = RmwNode(session, link, Interfaces(link.distro, link.interfaces))
    target = RosReplayTarget(node, clock_hz=args.clock, rate=args.rate, control=control)
    stop_clock = asyncio.Event()
    ticking = asyncio.create_task(target.run_clock(stop_clock))
    print(
        f"replay: ROS 2 node {link.node_name} on ROS domain {link.domain_id} (rmw_zenoh) via "
        f"{link.host_router or ', '.join(link.connect)}",
        file=sys.stderr,
    )
    try:
        yield target
    finally:
        stop_clock.set()
        await ticking
        node.close()
        await asyncio.to_thread(session.close)


async def run(args: argparse.Namespace) -> int:
    if args.clock is not None and not args.ros:
        raise BusConfigError("--clock publishes ROS 2 /clock: use it with --ros")
    opts = _options(args)
    stop = asyncio.Event()
    install_stop_signals(stop)
    control = ReplayControl()
    if args.start_paused:
        if args.fast:
            raise BusConfigError("--start-paused pauses a timed replay: not with --fast")
        control.pause()
        print("paused (space or SIGUSR1 starts)", file=sys.stderr)
    summary: ReplaySummary
    with _progress_bar(sys.stderr.isatty() and not args.json) as progress_cb, pause_controls(control):
        if args.ros:
            async with _ros_target(args, control) as target:
                summary = await replay(
                    target, args.paths, opts, stop=stop, progress=progress_cb, control=control
                )
        else:
            async with open_bus(args.bus, namespace=args.ns) as bus, serving_view(bus, args.view):
                summary = await replay(
                    bus, args.paths, opts, stop=stop, progress=progress_cb, control=control
                )
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
