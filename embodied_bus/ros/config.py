"""The robot YAML (``config/robot.yaml``) shared by the rclpy nodes and the rmw_zenoh bridge.

Which ROS topics become which bus streams, which bus streams and fused frames go back to ROS,
the fusion spec, and which action kinds are forwarded to which ROS 2 action servers. Validated
on load; every error names the offending key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from embodied_bus.errors import BusConfigError
from embodied_bus.fusion.spec import FusionSpec, spec_from_dict
from embodied_bus.rosmsg.rmw_zenoh import DEFAULT_ROUTER_ENDPOINT, QosProfile, RmwZenohError

__all__ = [
    "ActionRoute",
    "FrameRoute",
    "RobotConfig",
    "RobotConfigError",
    "RosLink",
    "TopicRoute",
    "load_robot_config",
    "robot_config_from_dict",
]

#: Default ROS topic where ROS-side planners submit actions (std_msgs/String, JSON).
DEFAULT_SUBMIT_TOPIC = "/embodied_bus/actions/submit"
#: Default ROS topic where the bridge reports action outcomes (std_msgs/String, JSON).
DEFAULT_RESULTS_TOPIC = "/embodied_bus/actions/results"


class RobotConfigError(BusConfigError):
    """The robot YAML is invalid; the message names the key."""


@dataclass(frozen=True, slots=True)
class TopicRoute:
    """One ROS topic ↔ one bus stream.

    Attributes:
        topic: Fully qualified ROS topic, e.g. ``/lidar/points``.
        ros_type: e.g. ``sensor_msgs/msg/PointCloud2``.
        stream: Bus stream name, e.g. ``lidar/top``.
        qos: QoS of the ROS endpoint the bridge creates.
    """

    topic: str
    ros_type: str
    stream: str
    qos: QosProfile


@dataclass(frozen=True, slots=True)
class FrameRoute:
    """Fused frames → ROS: each member on ``<namespace>/<stream>`` with its original type and
    stamp, frame statistics as ``diagnostic_msgs/DiagnosticArray`` on ``diagnostics``."""

    stream: str
    namespace: str
    diagnostics: str


@dataclass(frozen=True, slots=True)
class ActionRoute:
    """Queue actions of ``kind`` → the ROS 2 action server ``action`` of type ``action_type``."""

    kind: str
    action: str
    action_type: str
    timeout_s: float


@dataclass(frozen=True, slots=True)
class RosLink:
    """How the bridge joins the ROS 2 graph over rmw_zenoh.

    Attributes:
        domain_id: ``ROS_DOMAIN_ID``.
        distro: Distribution whose type hashes are used (jazzy or newer).
        node_name: Name of the bridge's ROS node.
        namespace: ROS namespace of the bridge node.
        connect: Zenoh endpoints of the robot's router (rmw_zenoh's default: tcp/localhost:7447).
        host_router: Host the router in the bridge process on this endpoint (e.g.
            ``tcp/[::]:7447``) so rmw_zenoh nodes need no ``rmw_zenohd``; None to connect instead.
    """

    domain_id: int = 0
    distro: str = "jazzy"
    node_name: str = "embodied_bus_bridge"
    namespace: str = ""
    connect: tuple[str, ...] = (DEFAULT_ROUTER_ENDPOINT,)
    host_router: str | None = None


@dataclass(frozen=True, slots=True)
class RobotConfig:
    """Everything in the robot YAML."""

    ros: RosLink = field(default_factory=RosLink)
    inbound: tuple[TopicRoute, ...] = ()
    outbound: tuple[TopicRoute, ...] = ()
    frames: tuple[FrameRoute, ...] = ()
    actions: tuple[ActionRoute, ...] = ()
    submit_topic: str = DEFAULT_SUBMIT_TOPIC
    results_topic: str = DEFAULT_RESULTS_TOPIC
    fusion: FusionSpec | None = None
    bus: str | None = None
    namespace: str | None = None


def _mapping(where: str, value: Any) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise RobotConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _str(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise RobotConfigError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def _topic(where: str, value: Any) -> str:
    topic = _str(where, value)
    if not topic.startswith("/") or topic.endswith("/") or "//" in topic:
        raise RobotConfigError(f"{where}: {topic!r} is not a fully qualified ROS topic (/a/b)")
    return topic


def _type(where: str, value: Any) -> str:
    t = _str(where, value)
    parts = t.split("/")
    if len(parts) != 3 or not all(parts):
        raise RobotConfigError(f"{where}: {t!r} is not a ROS type (pkg/msg/Name)")
    return t


def _unknown(where: str, doc: Mapping[str, Any], known: set[str]) -> None:
    extra = set(doc) - known
    if extra:
        raise RobotConfigError(f"{where}: unknown key(s) {sorted(extra)}; known: {sorted(known)}")


def _qos(where: str, value: Any, default: str) -> QosProfile:
    try:
        return QosProfile.parse(value if value is not None else default)
    except RmwZenohError as err:
        raise RobotConfigError(f"{where}: {err}") from None


def robot_config_from_dict(doc: Mapping[str, Any], *, where: str = "robot") -> RobotConfig:
    """Validate a parsed robot YAML.

    Raises:
        RobotConfigError: The message names the offending key.
    """
    doc = _mapping(where, doc)
    _unknown(where, doc, {"bus", "namespace", "ros", "streams", "publish", "fusion", "actions"})
    ros_doc = _mapping(f"{where}.ros", doc.get("ros"))
    _unknown(
        f"{where}.ros", ros_doc, {"domain_id", "distro", "node_name", "namespace", "connect", "host_router"}
    )
    domain = ros_doc.get("domain_id", 0)
    if isinstance(domain, bool) or not isinstance(domain, int) or not 0 <= domain <= 232:
        raise RobotConfigError(f"{where}.ros.domain_id: expected 0..232, got {domain!r}")
    connect = ros_doc.get("connect", [DEFAULT_ROUTER_ENDPOINT])
    if isinstance(connect, str):
        connect = [connect]
    if not isinstance(connect, list) or not all(isinstance(c, str) for c in connect):
        raise RobotConfigError(f"{where}.ros.connect: expected a list of Zenoh endpoints")
    host_router = ros_doc.get("host_router")
    if host_router is not None:
        host_router = _str(f"{where}.ros.host_router", host_router)
    distro = str(ros_doc.get("distro", "jazzy")).lower()
    if distro == "humble":
        raise RobotConfigError(
            f"{where}.ros.distro: humble is not interoperable over rmw_zenoh (no type hashes); "
            "use jazzy or newer"
        )
    link = RosLink(
        domain_id=domain,
        distro=distro,
        node_name=_str(f"{where}.ros.node_name", ros_doc.get("node_name", "embodied_bus_bridge")),
        namespace=str(ros_doc.get("namespace", "") or ""),
        connect=tuple(connect),
        host_router=host_router,
    )

    inbound = []
    for stream, opts in _mapping(f"{where}.streams", doc.get("streams")).items():
        w = f"{where}.streams.{stream}"
        opts = _mapping(w, opts)
        _unknown(w, opts, {"topic", "type", "qos"})
        inbound.append(
            TopicRoute(
                topic=_topic(f"{w}.topic", opts.get("topic")),
                ros_type=_type(f"{w}.type", opts.get("type")),
                stream=str(stream),
                qos=_qos(f"{w}.qos", opts.get("qos"), "sensor_data"),
            )
        )

    pub_doc = _mapping(f"{where}.publish", doc.get("publish"))
    _unknown(f"{where}.publish", pub_doc, {"streams", "frames"})
    outbound = []
    for i, item in enumerate(pub_doc.get("streams") or []):
        w = f"{where}.publish.streams[{i}]"
        item = _mapping(w, item)
        _unknown(w, item, {"stream", "topic", "type", "qos"})
        outbound.append(
            TopicRoute(
                topic=_topic(f"{w}.topic", item.get("topic")),
                ros_type=_type(f"{w}.type", item.get("type")),
                stream=_str(f"{w}.stream", item.get("stream")),
                qos=_qos(f"{w}.qos", item.get("qos"), "default"),
            )
        )
    frames = []
    for i, item in enumerate(pub_doc.get("frames") or []):
        w = f"{where}.publish.frames[{i}]"
        item = _mapping(w, item)
        _unknown(w, item, {"stream", "namespace", "diagnostics"})
        ns = _topic(f"{w}.namespace", item.get("namespace", "/fused"))
        frames.append(
            FrameRoute(
                stream=_str(f"{w}.stream", item.get("stream", "frames/fused")),
                namespace=ns,
                diagnostics=_topic(f"{w}.diagnostics", item.get("diagnostics", ns + "/diagnostics")),
            )
        )

    fusion = spec_from_dict(doc["fusion"], where=f"{where}.fusion") if doc.get("fusion") else None

    act_doc = _mapping(f"{where}.actions", doc.get("actions"))
    _unknown(f"{where}.actions", act_doc, {"submit_topic", "results_topic", "routes"})
    actions = []
    for kind, opts in _mapping(f"{where}.actions.routes", act_doc.get("routes")).items():
        w = f"{where}.actions.routes.{kind}"
        opts = _mapping(w, opts)
        _unknown(w, opts, {"action", "type", "timeout_s"})
        timeout = opts.get("timeout_s", 600)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise RobotConfigError(f"{w}.timeout_s: expected seconds > 0, got {timeout!r}")
        action_type = _type(f"{w}.type", opts.get("type"))
        if action_type.split("/")[1] != "action":
            raise RobotConfigError(f"{w}.type: {action_type!r} is not an action type (pkg/action/Name)")
        actions.append(
            ActionRoute(str(kind), _topic(f"{w}.action", opts.get("action")), action_type, float(timeout))
        )
    return RobotConfig(
        ros=link,
        inbound=tuple(inbound),
        outbound=tuple(outbound),
        frames=tuple(frames),
        actions=tuple(actions),
        submit_topic=_topic(
            f"{where}.actions.submit_topic", act_doc.get("submit_topic", DEFAULT_SUBMIT_TOPIC)
        ),
        results_topic=_topic(
            f"{where}.actions.results_topic", act_doc.get("results_topic", DEFAULT_RESULTS_TOPIC)
        ),
        fusion=fusion,
        bus=str(doc["bus"]) if doc.get("bus") else None,
        namespace=str(doc["namespace"]) if doc.get("namespace") else None,
    )


def load_robot_config(path: str | Path) -> RobotConfig:
    """Load and validate a robot YAML.

    Raises:
        RobotConfigError: Unreadable, not YAML, or invalid (the message names the key).
    """
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except OSError as err:
        raise RobotConfigError(f"cannot read robot config {str(path)!r}: {err}") from err
    except yaml.YAMLError as err:
        raise RobotConfigError(f"robot config {str(path)!r} is not valid YAML: {err}") from err
    return robot_config_from_dict(doc or {}, where=str(path))
