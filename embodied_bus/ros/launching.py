"""What the launch files start, as one table: ``ros2 launch`` and the tests read the same plan.

Every process a launch file starts meets the others, and the robot's ROS 2 nodes, through the
robot's Zenoh router: ``rmw_zenohd`` on ``tcp/localhost:7447`` by default, or a router the
launch starts itself with ``router:=true``. A bus that reaches no other process (``zenoh:``, an
embedded peer with no endpoint) is refused with the fix in the message; with ``router:=true`` it
is joined to that router. On Pulsar the action queue service is left out (the cluster is the
queue). ``rclpy:=false`` starts ``embodied-bus ros-bridge`` (rmw_zenoh, no ROS install) in
place of the rclpy bridge nodes.

The launch API is imported only by :func:`launch_description`, so the plan is plain Python.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from embodied_bus.engines.urls import parse_bus_url, with_connect
from embodied_bus.errors import BusConfigError
from embodied_bus.ros.config import load_robot_config

__all__ = [
    "LAUNCH_FILES",
    "ROBOT_ROUTER",
    "LaunchArgs",
    "LaunchFile",
    "ProcessSpec",
    "launch_description",
    "require_shared_bus",
    "share_dirs",
]

PACKAGE = "embodied_bus"
#: The robot's Zenoh router as rmw_zenoh nodes reach it (``rmw_zenohd``'s default endpoint).
ROBOT_ROUTER = "tcp/localhost:7447"
#: Where a router started by ``router:=true`` listens (empty: ``embodied-bus router``'s default,
#: every IPv6 and IPv4 address, or IPv4 only on a host without IPv6, port 7447).
ROUTER_LISTEN = ""


def share_dirs() -> list[Path]:
    """Where the package's shared files (``config/``, ``launch/``, ``data/``) may be, in order:
    the ament index (``$AMENT_PREFIX_PATH``), this Python's ``share/``, the source tree."""
    found: list[Path] = []
    for prefix in filter(None, os.environ.get("AMENT_PREFIX_PATH", "").split(os.pathsep)):
        marker = Path(prefix) / "share" / "ament_index" / "resource_index" / "packages" / PACKAGE
        if marker.exists():
            found.append(Path(prefix) / "share" / PACKAGE)
    found.append(Path(sys.prefix) / "share" / PACKAGE)
    found.append(Path(__file__).resolve().parents[2])
    return found


def shared_file(relative: str) -> Path:
    """The first of :func:`share_dirs` that holds ``relative``, or BusConfigError naming where
    it looked."""
    for base in share_dirs():
        if (base / relative).exists():
            return base / relative
    raise BusConfigError(f"{relative} not found in {', '.join(map(str, share_dirs()))}")


def require_shared_bus(url: str, *, who: str) -> str:
    """``url`` if other processes can reach the bus through it, else BusConfigError naming the
    fix. For processes that only work together (launch files, the bridge nodes)."""
    if parse_bus_url(url).reaches_other_processes:
        return url
    raise BusConfigError(
        f"{who}: bus {url!r} is an embedded Zenoh peer that no other process can reach (no "
        f"endpoint, multicast scouting off); give the robot's router, e.g. "
        f"zenoh://localhost:7447 (rmw_zenohd), or start one with router:=true "
        f"(`embodied-bus router`)"
    )


def router_connect_endpoint(listen: str) -> str:
    """The endpoint local processes connect to for a router listening on ``listen``."""
    proto, _, rest = (listen or "tcp/[::]:7447").partition("/")
    host, _, port = rest.rpartition(":")
    if host in ("0.0.0.0", "[::]", "::", ""):
        host = "localhost"
    return f"{proto}/{host}:{port}"


@dataclass(frozen=True, slots=True)
class LaunchArgs:
    """The launch arguments, parsed.

    Attributes:
        config: Robot YAML path.
        bus: Bus URL; empty: the config's ``bus:``, then ``$EMBODIED_BUS_URL``.
        namespace: Bus and ROS namespace; empty: the config's.
        router: Start a Zenoh router (``embodied-bus router``) for the robot.
        router_listen: Where that router listens.
        queue: Host the action queue service; None: where the bus needs one (not on Pulsar).
        queue_db: The queue service's SQLite file.
        rclpy: rclpy bridge nodes (any RMW); False: ``embodied-bus ros-bridge`` (rmw_zenoh).
        out: The demo's output directory.
    """

    config: str = ""
    bus: str = ""
    namespace: str = ""
    router: bool = False
    router_listen: str = ROUTER_LISTEN
    queue: bool | None = None
    queue_db: str = "actions.db"
    rclpy: bool = True
    out: str = "out/demo"

    @classmethod
    def from_strings(cls, values: Mapping[str, str]) -> LaunchArgs:
        """From launch argument strings (``"true"``/``"false"``; empty ``queue`` = automatic)."""

        def flag(name: str, text: str) -> bool:
            low = text.strip().lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise BusConfigError(f"launch argument {name}:={text!r} must be true or false")

        known = {f for f in cls.__dataclass_fields__}
        unknown = set(values) - known
        if unknown:
            raise BusConfigError(f"unknown launch argument(s) {sorted(unknown)}; known: {sorted(known)}")
        kw: dict[str, Any] = {k: v for k, v in values.items() if k in ("config", "bus", "namespace")}
        kw |= {k: v for k, v in values.items() if k in ("router_listen", "queue_db", "out") and v}
        for name in ("router", "rclpy"):
            if name in values:
                kw[name] = flag(name, values[name])
        if values.get("queue", "").strip():
            kw["queue"] = flag("queue", values["queue"])
        return cls(**kw)


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    """One process a launch file starts: a name for its log lines and the exact command."""

    name: str
    command: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Resolved:
    """Launch arguments with the config found and the bus settled."""

    args: LaunchArgs
    bus: str
    namespace: str
    needs_queue_service: bool
    #: ``--seal`` / ``--trust`` of the queue service (the config's ``security:``), or nothing.
    queue_credentials: tuple[str, ...] = ()


def resolve(args: LaunchArgs, who: str) -> Resolved:
    """Find the config (default: the package's ``config/robot.yaml``) and settle the one bus
    every process of the launch uses."""
    if not args.config:
        args = replace(args, config=str(shared_file("config/robot.yaml")))
    cfg = load_robot_config(args.config)
    url = cfg.bus_url(args.bus)
    settings = parse_bus_url(url)
    if args.router and not settings.reaches_other_processes:
        url = with_connect(url, [router_connect_endpoint(args.router_listen)])
    url = require_shared_bus(url, who=who)
    sec = cfg.security
    creds: tuple[str, ...] = ()
    if sec is not None and sec.queue_key:
        creds = ("--seal", sec.queue_key, "--trust", sec.allow_list)
    return Resolved(args, url, args.namespace or cfg.namespace or "", settings.needs_queue_service, creds)


def _python(module: str, *argv: str) -> tuple[str, ...]:
    return (sys.executable, "-m", module, *argv)


def _cli(name: str, *argv: str) -> ProcessSpec:
    return ProcessSpec(name, _python(f"{PACKAGE}.cli.main", *argv))


def _bus_argv(r: Resolved) -> tuple[str, ...]:
    return ("--bus", r.bus, *(("--ns", r.namespace) if r.namespace else ()))


def _ros_node(r: Resolved, name: str) -> ProcessSpec:
    ros_args: list[str] = ["--ros-args", "-r", f"__node:={name}"]
    if r.namespace:
        ros_args += ["-r", f"__ns:=/{r.namespace}"]
    for param in (f"config:={r.args.config}", f"bus:={r.bus}", f"bus_namespace:={r.namespace}"):
        ros_args += ["-p", param]
    return ProcessSpec(name, _python(f"{PACKAGE}.ros.nodes.{name}", *ros_args))


def router_plan(r: Resolved) -> list[ProcessSpec]:
    """The Zenoh router, when asked for."""
    listen = ("--listen", r.args.router_listen) if r.args.router_listen else ()
    return [_cli("zenoh_router", "router", *listen)] if r.args.router else []


def bridge_plan(r: Resolved) -> list[ProcessSpec]:
    """Sensor topics into the bus, fused frames and streams back to ROS, action submissions."""
    if r.args.rclpy:
        return [_ros_node(r, "sensor_bridge"), _ros_node(r, "frame_bridge")]
    argv = ["ros-bridge", "--config", r.args.config, *_bus_argv(r), "--actions"]
    if r.namespace:  # the ROS namespace of the rclpy nodes it stands in for
        argv += ["--ros-namespace", f"/{r.namespace}"]
    if r.args.router:
        argv += ["--connect", router_connect_endpoint(r.args.router_listen)]
    return [_cli("ros_bridge", *argv)]


def fusion_plan(r: Resolved) -> list[ProcessSpec]:
    """One fusion worker for the config's ``fusion:`` spec."""
    return [_cli("fusion_worker", "fuse", "--config", r.args.config, *_bus_argv(r))]


def executors_plan(r: Resolved) -> list[ProcessSpec]:
    """The action queue service where the bus needs one, and the rclpy action bridge (ROS
    planners in, ROS 2 action servers out)."""
    out = []
    if r.needs_queue_service and r.args.queue is not False:
        out.append(
            _cli("queue_service", "queue", *_bus_argv(r), "--db", r.args.queue_db, *r.queue_credentials)
        )
    if r.args.rclpy:
        out.append(_ros_node(r, "action_bridge"))
    return out


@dataclass(frozen=True, slots=True)
class LaunchArgument:
    """A declared launch argument: name, default, what it means."""

    name: str
    default: str
    description: str


_CONFIG = LaunchArgument("config", "", "robot YAML (empty: config/robot.yaml of the package)")
_BUS = LaunchArgument(
    "bus",
    "",
    "bus URL (empty: the config's bus:); one all processes share, e.g. zenoh://localhost:7447",
)
_NS = LaunchArgument("namespace", "", "ROS and bus namespace (empty: the config's)")
_ROUTER = LaunchArgument("router", "false", "start a Zenoh router for the robot (when no rmw_zenohd runs)")
_ROUTER_LISTEN = LaunchArgument("router_listen", ROUTER_LISTEN, "where that router listens")
_RCLPY = LaunchArgument(
    "rclpy", "true", "rclpy bridge nodes; false: embodied-bus ros-bridge (rmw_zenoh, no rclpy)"
)
_QUEUE = LaunchArgument("queue", "", "host the action queue service (empty: yes, except on Pulsar)")
_QUEUE_DB = LaunchArgument("queue_db", "actions.db", "the queue service's SQLite file")
_OUT = LaunchArgument("out", "out/demo", "the demo's output directory")
_COMMON = (_CONFIG, _BUS, _NS, _ROUTER, _ROUTER_LISTEN)

Plan = Callable[[Resolved], list[ProcessSpec]]


@dataclass(frozen=True, slots=True)
class LaunchFile:
    """A launch file under ``launch/``: its arguments and the parts of the plan it starts."""

    name: str
    arguments: tuple[LaunchArgument, ...]
    parts: tuple[Plan, ...]

    def processes(self, args: LaunchArgs) -> list[ProcessSpec]:
        """The processes for ``args``; BusConfigError naming what is wrong."""
        r = resolve(args, f"{self.name}.launch.py")
        return [spec for part in self.parts for spec in part(r)]


def demo_processes(args: LaunchArgs) -> list[ProcessSpec]:
    """``demo.launch.py``: the README's demo, on its own embedded bus (data from the ament
    index or the installed ``share/``)."""
    return [_cli("demo", "demo", "--out", args.out)]


#: The launch files that start the robot's processes, by name.
LAUNCH_FILES: dict[str, LaunchFile] = {
    f.name: f
    for f in (
        LaunchFile("bridge", (*_COMMON, _RCLPY), (router_plan, bridge_plan)),
        LaunchFile("fusion", _COMMON, (router_plan, fusion_plan)),
        LaunchFile("executors", (*_COMMON, _RCLPY, _QUEUE, _QUEUE_DB), (router_plan, executors_plan)),
        LaunchFile(
            "robot",
            (*_COMMON, _RCLPY, _QUEUE, _QUEUE_DB),
            (router_plan, bridge_plan, fusion_plan, executors_plan),
        ),
    )
}


def launch_description(name: str) -> Any:
    """The ``LaunchDescription`` of ``launch/<name>.launch.py`` (imports the ROS 2 launch API):
    its arguments declared, and its processes started from this module's plan."""
    from launch.actions import DeclareLaunchArgument, ExecuteProcess, OpaqueFunction
    from launch.substitutions import LaunchConfiguration

    from launch import LaunchDescription  # type: ignore[attr-defined]

    launch_file = LAUNCH_FILES.get(name)
    arguments = launch_file.arguments if launch_file else (_OUT,)

    def start(context: Any) -> list[Any]:
        values = {a.name: LaunchConfiguration(a.name).perform(context) for a in arguments}
        args = LaunchArgs.from_strings(values)
        specs = launch_file.processes(args) if launch_file else demo_processes(args)
        return [ExecuteProcess(cmd=list(s.command), name=s.name, output="screen") for s in specs]

    declared = [
        DeclareLaunchArgument(a.name, default_value=a.default, description=a.description) for a in arguments
    ]
    return LaunchDescription([*declared, OpaqueFunction(function=start)])
