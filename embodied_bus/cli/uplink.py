"""``embodied-bus uplink``: forward a robot's streams to its fleet across a link that drops."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from embodied_bus.bus import open_bus
from embodied_bus.cli.common import install_stop_signals
from embodied_bus.errors import BusConfigError
from embodied_bus.uplink import Uplink, UplinkConfig, uplink_config_from_dict
from embodied_bus.uplink.down import run_down

__all__ = ["add_parser", "parse_stream_arg"]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "uplink",
        help="forward a robot's streams up to the fleet (store-and-forward), state and actions down",
        description="Forwards chosen streams of the robot's bus to the fleet bus through an on-disk "
        "spool that rides out link loss (class 0 first when the link returns; the lowest class loses "
        "samples first when the spool is full), and mirrors state tables and action kinds down.",
    )
    p.add_argument("--from", dest="source", default="zenoh://localhost:7447", help="the robot's bus")
    p.add_argument("--to", default="", help="the fleet bus (e.g. pulsar://fleet:6650?listener=robots)")
    p.add_argument("--robot", default="", help="the robot's namespace on the fleet bus")
    p.add_argument("--ns", default=None, help="the robot's own namespace (default: the robot YAML's)")
    p.add_argument("--config", default=None, help="robot YAML with an uplink: section")
    p.add_argument(
        "--stream",
        action="append",
        default=[],
        metavar="NAME[:CLASS[:RATE_HZ[:DOWN_RATE_HZ]]]",
        help="forward this stream (repeatable; adds to the YAML's), e.g. lidar/top:3:2:0",
    )
    p.add_argument("--spool", default="", help="the spool file (default uplink-<robot>.db)")
    p.add_argument("--spool-limit-mb", type=float, default=None, help="the spool's size limit, MiB")
    p.add_argument(
        "--stats-every", type=float, default=10.0, metavar="S", help="print figures (JSON), 0: never"
    )
    p.set_defaults(func=run)


def parse_stream_arg(text: str) -> tuple[str, dict[str, Any]]:
    """``NAME[:CLASS[:RATE_HZ[:DOWN_RATE_HZ]]]`` as a stream name and its route document."""
    name, *rest = text.split(":")
    keys = ("class", "rate_hz", "down_rate_hz")
    if len(rest) > len(keys):
        raise BusConfigError(f"--stream {text!r}: expected NAME[:CLASS[:RATE_HZ[:DOWN_RATE_HZ]]]")
    doc: dict[str, Any] = {}
    for key, value in zip(keys, rest, strict=False):
        if value == "":
            continue
        try:
            doc[key] = int(value) if key == "class" else float(value)
        except ValueError:
            raise BusConfigError(f"--stream {text!r}: {key} {value!r} is not a number") from None
    return name, doc


def _config(args: argparse.Namespace) -> tuple[UplinkConfig, str | None]:
    section: dict[str, Any] = {}
    namespace = args.ns
    if args.config:
        try:
            doc = yaml.safe_load(Path(args.config).read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise BusConfigError(f"{args.config}: {err}") from None
        if not isinstance(doc, dict):
            raise BusConfigError(f"{args.config}: expected a mapping")
        section = dict(doc.get("uplink") or {})
        namespace = namespace or doc.get("namespace")
    streams = dict(section.get("streams") or {})
    for text in args.stream:
        name, route = parse_stream_arg(text)
        streams[name] = route
    section["streams"] = streams
    if args.spool_limit_mb is not None:
        section["spool_limit_mb"] = args.spool_limit_mb
    where = f"{args.config}: uplink" if args.config else "uplink"
    cfg = uplink_config_from_dict(section, where=where, robot=args.robot, to=args.to, spool=args.spool)
    if not cfg.to:
        raise BusConfigError("no fleet bus: pass --to URL (or uplink.to in the robot YAML)")
    return cfg, namespace


async def run(args: argparse.Namespace) -> int:
    cfg, namespace = _config(args)
    stop = asyncio.Event()
    install_stop_signals(stop)
    async with (
        open_bus(args.source, namespace=namespace) as robot,
        open_bus(cfg.to, namespace=cfg.robot) as fleet,
    ):
        uplink = Uplink(robot, fleet, cfg)
        print(
            json.dumps({"uplink": cfg.robot, "from": args.source, "to": cfg.to, "spool": str(cfg.spool)}),
            flush=True,
        )
        tasks = [
            asyncio.create_task(uplink.run(stop)),
            asyncio.create_task(run_down(robot, fleet, cfg, stop)),
        ]
        if args.stats_every > 0:
            tasks.append(asyncio.create_task(_progress(uplink, args.stats_every, stop)))
        try:
            await asyncio.gather(*tasks)
        finally:
            stop.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        print(json.dumps(uplink.report()), flush=True)
    return 0


async def _progress(uplink: Uplink, every_s: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except TimeoutError:
            print(json.dumps(uplink.report()), file=sys.stdout, flush=True)
