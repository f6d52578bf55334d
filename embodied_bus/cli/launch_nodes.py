"""Processes for launch files: ``ros2 run embodied_bus fusion_worker`` and ``queue_service``.

``fusion_worker --config robot.yaml [--bus URL] [--ns NS]`` runs ``embodied-bus fuse`` with the
robot YAML's ``fusion:`` spec; ``queue_service [--config robot.yaml] [--db FILE] [--bus URL]
[--ns NS]`` runs the durable action queue service (``embodied-bus queue``). Neither needs rclpy.
An empty ``--bus`` or ``--ns`` means the config's ``bus:`` / ``namespace:``; ROS arguments
appended by ``ros2 launch`` are ignored.
"""

from __future__ import annotations

import argparse
import sys

from embodied_bus.cli.main import main as cli_main
from embodied_bus.errors import EmbodiedBusError
from embodied_bus.ros.config import RobotConfig, load_robot_config
from embodied_bus.ros.launching import require_shared_bus

__all__ = ["fusion_worker", "queue_service", "resolve_bus", "strip_ros_args"]


def strip_ros_args(argv: list[str]) -> list[str]:
    """Drop ``--ros-args ... [--]`` sections that launch_ros appends."""
    out: list[str] = []
    inside = False
    for a in argv:
        if a == "--ros-args":
            inside = True
        elif inside and a == "--":
            inside = False
        elif not inside:
            out.append(a)
    return out


def resolve_bus(prog: str, argv: list[str], *, config_required: bool) -> tuple[argparse.Namespace, list[str]]:
    """Parse ``--config/--bus/--ns`` and return them with the bus options for the CLI, where an
    empty value falls back to the config, then to ``$EMBODIED_BUS_URL`` / the embedded default.

    Raises:
        BusConfigError: The bus is an isolated embedded peer: these processes work with others.
    """
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--config", required=config_required, default="")
    p.add_argument("--bus", default="")
    p.add_argument("--ns", default="")
    args, rest = p.parse_known_args(strip_ros_args(argv))
    cfg = load_robot_config(args.config) if args.config else None
    bus = (cfg or RobotConfig()).bus_url(args.bus)
    require_shared_bus(bus, who=prog)
    ns = args.ns or (cfg.namespace if cfg else None)
    opts = ["--bus", bus] + (["--ns", ns] if ns else [])
    return args, opts + rest


def fusion_worker(args: list[str] | None = None) -> int:
    """Run ``embodied-bus fuse`` for the robot YAML."""
    try:
        ns, opts = resolve_bus("fusion_worker", sys.argv[1:] if args is None else args, config_required=True)
    except EmbodiedBusError as err:
        print(f"fusion_worker: error: {err}", file=sys.stderr)
        return 1
    return cli_main(["fuse", "--config", ns.config, *opts])


def queue_service(args: list[str] | None = None) -> int:
    """Run ``embodied-bus queue``."""
    try:
        _, opts = resolve_bus("queue_service", sys.argv[1:] if args is None else args, config_required=False)
    except EmbodiedBusError as err:
        print(f"queue_service: error: {err}", file=sys.stderr)
        return 1
    return cli_main(["queue", *opts])
