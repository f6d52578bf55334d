"""The robot YAML (``config/robot.yaml``) shared by the rclpy nodes and the rmw_zenoh bridge.

Which ROS topics become which bus streams, which bus streams and fused frames go back to ROS,
the fusion spec, and which action kinds are forwarded to which ROS 2 action servers. Validated
on load; every error names the offending key.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import yaml

from embodied_bus.engines.urls import DEFAULT_URL
from embodied_bus.errors import BusConfigError
from embodied_bus.fusion.spec import FusionSpec, spec_from_dict
from embodied_bus.model.clock import BucketClock
from embodied_bus.model.documents import convert_document
from embodied_bus.ros.discovery import DiscoverDocument, TopicSelection
from embodied_bus.rosmsg.rmw_zenoh import DEFAULT_ROUTER_ENDPOINT, QosProfile, RmwZenohError

__all__ = [
    "ActionRoute",
    "FrameRoute",
    "RobotConfig",
    "RobotConfigError",
    "RosLink",
    "SecurityPaths",
    "TopicRoute",
    "env_domain_id",
    "load_robot_config",
    "resolve_name",
    "robot_config_from_dict",
]

#: Default ROS topic where ROS-side planners submit actions (std_msgs/String, JSON).
DEFAULT_SUBMIT_TOPIC = "/embodied_bus/actions/submit"
#: Default ROS topic where the bridge reports action outcomes (std_msgs/String, JSON).
DEFAULT_RESULTS_TOPIC = "/embodied_bus/actions/results"


class RobotConfigError(BusConfigError):
    """The robot YAML is invalid; the message names the key."""


_D = TypeVar("_D", bound=msgspec.Struct)


@dataclass(frozen=True, slots=True)
class TopicRoute:
    """One ROS topic ↔ one bus stream.

    Attributes:
        topic: ROS topic, e.g. ``/lidar/points`` (or ``lidar/points``, relative to the node's
            namespace).
        ros_type: e.g. ``sensor_msgs/msg/PointCloud2``.
        stream: Bus stream name, e.g. ``lidar/top``.
        qos: QoS of the ROS endpoint the bridge creates.
    """

    topic: str
    ros_type: str
    stream: str
    qos: QosProfile

    def resolved(self, namespace: str) -> TopicRoute:
        """This route with its topic made absolute under ``namespace``."""
        return replace(self, topic=resolve_name(self.topic, namespace))


@dataclass(frozen=True, slots=True)
class FrameRoute:
    """Fused frames → ROS: each member on ``<namespace>/<stream>`` with its original type and
    stamp, frame statistics as ``diagnostic_msgs/DiagnosticArray`` on ``diagnostics``."""

    stream: str
    namespace: str
    diagnostics: str

    def resolved(self, namespace: str) -> FrameRoute:
        """This route with its names made absolute under ``namespace``."""
        return replace(
            self,
            namespace=resolve_name(self.namespace, namespace),
            diagnostics=resolve_name(self.diagnostics, namespace),
        )


@dataclass(frozen=True, slots=True)
class ActionRoute:
    """Queue actions of ``kind`` → the ROS 2 action server ``action`` of type ``action_type``."""

    kind: str
    action: str
    action_type: str
    timeout_s: float

    def resolved(self, namespace: str) -> ActionRoute:
        """This route with its action name made absolute under ``namespace``."""
        return replace(self, action=resolve_name(self.action, namespace))


def env_domain_id() -> int:
    """``$ROS_DOMAIN_ID`` as ROS 2 reads it (0 where unset or empty).

    Raises:
        RobotConfigError: It is set to something other than an integer in 0..232.
    """
    raw = os.environ.get("ROS_DOMAIN_ID", "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= 232:
        raise RobotConfigError(f"ROS_DOMAIN_ID: expected an integer in 0..232, got {raw!r}")
    return value


@dataclass(frozen=True, slots=True)
class RosLink:
    """How the bridge joins the ROS 2 graph over rmw_zenoh.

    Attributes:
        domain_id: ROS domain (default ``$ROS_DOMAIN_ID``, else 0).
        distro: Distribution whose type hashes are used (jazzy or newer).
        node_name: Name of the bridge's ROS node.
        namespace: ROS namespace of the bridge node.
        connect: Zenoh endpoints of the robot's router (rmw_zenoh's default: tcp/localhost:7447).
        host_router: Host the router in the bridge process on this endpoint (e.g.
            ``tcp/[::]:7447``) so rmw_zenoh nodes need no ``rmw_zenohd``; None to connect instead.
        interfaces: Directories of ``<pkg>/<msg|srv|action>/<Name>.<ext>`` definitions for
            types the distribution lacks (searched before ``$AMENT_PREFIX_PATH``).
    """

    domain_id: int = field(default_factory=env_domain_id)
    distro: str = "jazzy"
    node_name: str = "embodied_bus_bridge"
    namespace: str = ""
    connect: tuple[str, ...] = (DEFAULT_ROUTER_ENDPOINT,)
    host_router: str | None = None
    interfaces: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SecurityPaths:
    """``security:`` of the robot YAML (made by ``embodied-bus keys init``): the allow-list and
    the keys the robot's processes seal and sign with.

    Attributes:
        allow_list: Who may do what (watched: a revocation takes effect within a second).
        queue_key: The queue service's key (seals its replies, pushes and results).
        planner_key: The bridges' planner (ROS submissions, offered kinds): signs actions and
            seals requests.
        executor_key: The bridges' executor of routed kinds: seals its requests and feedback.
    """

    allow_list: str
    queue_key: str | None = None
    planner_key: str | None = None
    executor_key: str | None = None


@dataclass(frozen=True, slots=True)
class RobotConfig:
    """Everything in the robot YAML."""

    ros: RosLink = field(default_factory=RosLink)
    inbound: tuple[TopicRoute, ...] = ()
    outbound: tuple[TopicRoute, ...] = ()
    frames: tuple[FrameRoute, ...] = ()
    actions: tuple[ActionRoute, ...] = ()
    #: Queue kinds offered to ROS 2 action clients as action servers.
    offers: tuple[ActionRoute, ...] = ()
    submit_topic: str = DEFAULT_SUBMIT_TOPIC
    results_topic: str = DEFAULT_RESULTS_TOPIC
    fusion: FusionSpec | None = None
    bus: str | None = None
    namespace: str | None = None
    #: The bucket clock every publisher of this robot stamps with: ``clock:``, else the fusion
    #: spec's, else the default (a fusion worker refuses samples of another clock).
    clock: BucketClock = field(default_factory=BucketClock)
    #: Keys and allow-list that seal the robot's action queue; None: unsealed.
    security: SecurityPaths | None = None
    #: Topics taken from ROS as the graph shows them (besides ``inbound``); None: only those.
    discover: TopicSelection | None = None

    def resolved(self) -> RobotConfig:
        """Every ROS name made absolute under the bridge node's namespace (``ros.namespace``), as
        an rclpy node resolves relative names under its own."""
        ns = self.ros.namespace
        return replace(
            self,
            inbound=tuple(r.resolved(ns) for r in self.inbound),
            outbound=tuple(r.resolved(ns) for r in self.outbound),
            frames=tuple(r.resolved(ns) for r in self.frames),
            actions=tuple(r.resolved(ns) for r in self.actions),
            offers=tuple(r.resolved(ns) for r in self.offers),
            submit_topic=resolve_name(self.submit_topic, ns),
            results_topic=resolve_name(self.results_topic, ns),
        )

    def resolved_under(self, namespace: str) -> RobotConfig:
        """:meth:`resolved` for a node in ``namespace`` (an rclpy node's own, e.g. from ``__ns``)."""
        return replace(self, ros=replace(self.ros, namespace=namespace)).resolved()

    def publishes(self, topic: str) -> bool:
        """Whether the bridge publishes ``topic`` into ROS (``publish:`` streams and frames, the
        action results): discovery never takes such a topic back onto the bus."""
        if topic == self.results_topic or any(r.topic == topic for r in self.outbound):
            return True
        return any(topic == r.diagnostics or topic.startswith(r.namespace + "/") for r in self.frames)

    def bus_url(self, override: str | None = None) -> str:
        """The bus to use: ``override``, else ``bus:``, else ``$EMBODIED_BUS_URL``, else the
        embedded default."""
        return override or self.bus or os.environ.get("EMBODIED_BUS_URL", DEFAULT_URL)


_NAME_TOKEN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _topic(where: str, value: str) -> str:
    """A ROS topic or action name: absolute (``/a/b``) or relative to the node's namespace
    (``a/b``), as ROS 2 resolves it."""
    tokens = value[1:].split("/") if value.startswith("/") else value.split("/")
    if not value or not all(_NAME_TOKEN.match(t) for t in tokens):
        raise RobotConfigError(
            f"{where}: {value!r} is not a ROS topic name (/a/b, or a/b relative to the node's namespace)"
        )
    return value


def resolve_name(name: str, namespace: str) -> str:
    """``name`` made absolute under ``namespace`` (an absolute name stays as it is)."""
    if name.startswith("/"):
        return name
    ns = namespace.strip("/")
    return f"/{ns}/{name}" if ns else f"/{name}"


def _type(where: str, value: str) -> str:
    parts = value.split("/")
    if len(parts) != 3 or not all(parts):
        raise RobotConfigError(f"{where}: {value!r} is not a ROS type (pkg/msg/Name)")
    return value


def _qos(where: str, value: Any, default: str) -> QosProfile:
    try:
        return QosProfile.parse(value if value is not None else default)
    except RmwZenohError as err:
        raise RobotConfigError(f"{where}: {err}") from None


def _doc(doc: Any, cls: type[_D], where: str) -> _D:
    return convert_document({} if doc is None else doc, cls, where, RobotConfigError)


class RosDocument(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``ros:`` of the robot YAML: how the bridge joins the ROS 2 graph.

    Attributes:
        domain_id: ROS domain, 0..232 (none: ``$ROS_DOMAIN_ID``, else 0).
        distro: Type hashes of this distribution: ``jazzy`` or newer (``humble`` is refused: it
            cannot interoperate over rmw_zenoh).
        node_name: The bridge's ROS node name.
        namespace: The bridge node's ROS namespace; relative topic names resolve under it.
        connect: Zenoh endpoints of the robot's router (rmw_zenoh's default).
        host_router: Host the Zenoh router in the bridge on this endpoint instead (rmw_zenoh
            nodes then need no ``rmw_zenohd``).
        interfaces: Directories of ``<pkg>/<msg|srv|action>/<Name>.<ext>`` for types the
            distribution lacks, relative to the YAML (searched before ``$AMENT_PREFIX_PATH``).
    """

    domain_id: int | None = None
    distro: str = "jazzy"
    node_name: str = "embodied_bus_bridge"
    namespace: str | None = ""
    connect: list[str] | str = msgspec.field(default_factory=lambda: [DEFAULT_ROUTER_ENDPOINT])
    host_router: str | None = None
    interfaces: list[str] = msgspec.field(default_factory=list)

    def link(self, where: str, base: Path | None = None) -> RosLink:
        domain_id = env_domain_id() if self.domain_id is None else self.domain_id
        if not 0 <= domain_id <= 232:
            raise RobotConfigError(f"{where}.domain_id: expected 0..232, got {domain_id!r}")
        distro = self.distro.lower()
        if distro == "humble":
            raise RobotConfigError(
                f"{where}.distro: humble is not interoperable over rmw_zenoh (no type hashes); "
                "use jazzy or newer"
            )
        if not self.node_name:
            raise RobotConfigError(f"{where}.node_name: must not be empty")
        connect = [self.connect] if isinstance(self.connect, str) else self.connect
        return RosLink(
            domain_id,
            distro,
            self.node_name,
            self.namespace or "",
            tuple(connect),
            self.host_router or None,
            tuple(str(base / p) if base is not None else p for p in self.interfaces),
        )


class TopicDocument(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A ROS topic of a stream: ``streams.<stream>`` (inbound), or an entry of
    ``publish.streams`` (outbound, which names its ``stream``).

    Attributes:
        topic: ROS topic: ``/a/b``, or ``a/b`` under the bridge node's namespace.
        type: ROS type, ``pkg/msg/Name``.
        qos: ``sensor_data``, ``default``, ``reliable``, ``best_effort`` or a mapping
            ``{reliability, durability, history, depth}`` (none: ``sensor_data`` from ROS,
            ``default`` to ROS).
        stream: The bus stream to publish.
    """

    topic: str
    type: str
    qos: str | dict[str, Any] | None = None
    stream: str | None = None

    def route(self, stream: str, where: str, default_qos: str) -> TopicRoute:
        return TopicRoute(
            _topic(f"{where}.topic", self.topic),
            _type(f"{where}.type", self.type),
            stream,
            _qos(f"{where}.qos", self.qos, default_qos),
        )


class FramesDocument(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """An entry of ``publish.frames``: fused frames → ROS.

    Attributes:
        stream: Bus stream of the fused frames.
        namespace: Each member goes out on ``<namespace>/<stream>`` with its original type and stamp.
        diagnostics: Frame statistics as ``diagnostic_msgs/DiagnosticArray`` (none:
            ``<namespace>/diagnostics``).
    """

    stream: str = "frames/fused"
    namespace: str = "/fused"
    diagnostics: str | None = None

    def route(self, where: str) -> FrameRoute:
        ns = _topic(f"{where}.namespace", self.namespace)
        diagnostics = _topic(f"{where}.diagnostics", self.diagnostics or ns + "/diagnostics")
        return FrameRoute(self.stream, ns, diagnostics)


class PublishDocument(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``publish:`` of the robot YAML: bus → ROS.

    Attributes:
        streams: Bus streams → ROS topics (entries: ``stream``, ``topic``, ``type``, ``qos``).
        frames: Fused frames → ROS topics.
    """

    streams: list[Any] | None = None
    frames: list[Any] | None = None


class RouteDocument(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``actions.routes.<kind>`` and ``actions.offer.<kind>``.

    Attributes:
        action: ROS 2 action name.
        type: ROS 2 action type, ``pkg/action/Name``.
        timeout_s: Longest a goal may run, in seconds.
    """

    action: str
    type: str
    timeout_s: float = 600.0

    def route(self, kind: str, where: str) -> ActionRoute:
        if self.timeout_s <= 0:
            raise RobotConfigError(f"{where}.timeout_s: expected seconds > 0, got {self.timeout_s!r}")
        action_type = _type(f"{where}.type", self.type)
        if action_type.split("/")[1] != "action":
            raise RobotConfigError(f"{where}.type: {action_type!r} is not an action type (pkg/action/Name)")
        return ActionRoute(kind, _topic(f"{where}.action", self.action), action_type, self.timeout_s)


class ActionsDocument(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``actions:`` of the robot YAML: the queue ↔ ROS 2.

    Attributes:
        submit_topic: ROS topic (``std_msgs/msg/String``, JSON) where ROS-side planners submit actions.
        results_topic: ROS topic where the bridge reports action outcomes (JSON).
        routes: Queue actions of a kind → a ROS 2 action server, by kind.
        offer: Queue kinds served as ROS 2 action servers to ROS 2 action clients, by kind.
    """

    submit_topic: str = DEFAULT_SUBMIT_TOPIC
    results_topic: str = DEFAULT_RESULTS_TOPIC
    routes: dict[str, Any] | None = None
    offer: dict[str, Any] | None = None


class ClockDocument(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``clock:`` of the robot YAML: the bucket clock of its publishers; must agree with the
    fusion spec's.

    Attributes:
        bucket_width_ms: Bucket width, in milliseconds.
        bucket_offset_ms: Where bucket boundaries fall, in milliseconds past a multiple of the width.
    """

    bucket_width_ms: float
    bucket_offset_ms: float = 0.0

    def clock(self, where: str) -> BucketClock:
        width_ns, offset_ns = round(self.bucket_width_ms * 1e6), round(self.bucket_offset_ms * 1e6)
        try:
            return BucketClock(width_ns=width_ns, offset_ns=offset_ns)
        except BusConfigError as err:
            raise RobotConfigError(f"{where}: {err}") from None


def _clock(d: RobotDocument, fusion: FusionSpec | None, where: str) -> BucketClock:
    """The robot's one bucket clock; an explicit ``clock:`` must agree with the fusion spec's."""
    if d.clock is None:
        return fusion.clock if fusion is not None else BucketClock()
    clock = _doc(d.clock, ClockDocument, f"{where}.clock").clock(f"{where}.clock")
    if fusion is not None and fusion.clock != clock:
        raise RobotConfigError(
            f"{where}.clock: {clock.width_ns / 1e6:g} ms offset {clock.offset_ns / 1e6:g} ms differs from "
            f"the fusion spec's {fusion.clock.width_ns / 1e6:g} ms offset {fusion.clock.offset_ns / 1e6:g} "
            "ms; the fusion worker would refuse every sample (give one clock, or leave clock: out)"
        )
    return clock


class RobotDocument(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The robot YAML; each section is checked as its own document (errors name the entry).

    Attributes:
        bus: Bus URL of the robot's processes (none: ``$EMBODIED_BUS_URL``, else ``zenoh:``).
        clock: The bucket clock of the robot's publishers (none: the fusion spec's, else 100 ms).
        namespace: Bus namespace of this robot (none: ``default``).
        ros: How the bridge joins the ROS 2 graph.
        streams: ROS topics → bus streams, keyed by stream name.
        publish: Bus streams and fused frames → ROS.
        fusion: A fusion spec (its own table).
        actions: Actions between the queue and ROS 2.
        security: Seal the robot's action queue (none: unsealed).
        discover: ROS topics chosen by pattern, with types from the graph (besides ``streams``).
        uplink: The robot's link to its fleet (``embodied-bus uplink --config``; its own table).
    """

    bus: str | None = None
    clock: Any = None
    namespace: str | None = None
    ros: Any = None
    streams: dict[str, Any] | None = None
    publish: Any = None
    fusion: Any = None
    actions: Any = None
    security: Any = None
    discover: Any = None
    uplink: Any = None


class SecurityDocument(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``security:`` of the robot YAML (``embodied-bus keys init`` writes it); paths relative to
    the YAML.

    Attributes:
        allow_list: Who may do what.
        queue_key: The queue service's key.
        planner_key: The bridges' planner key (ROS submissions, offered kinds).
        executor_key: The bridges' executor key (routed kinds).
    """

    allow_list: str
    queue_key: str | None = None
    planner_key: str | None = None
    executor_key: str | None = None

    def paths(self, where: str, base: Path | None) -> SecurityPaths:
        def found(key: str, value: str | None) -> str | None:
            if value is None:
                return None
            path = Path(value) if base is None or Path(value).is_absolute() else base / value
            if not path.is_file():
                raise RobotConfigError(f"{where}.{key}: no file {str(path)!r} (see 'embodied-bus keys init')")
            return str(path)

        allow = found("allow_list", self.allow_list)
        assert allow is not None
        return SecurityPaths(
            allow,
            found("queue_key", self.queue_key),
            found("planner_key", self.planner_key),
            found("executor_key", self.executor_key),
        )


def robot_config_from_dict(
    doc: Mapping[str, Any], *, where: str = "robot", base: Path | None = None
) -> RobotConfig:
    """Validate a parsed robot YAML (relative ``ros.interfaces`` directories are taken from
    ``base``).

    Raises:
        RobotConfigError: The message names the offending key.
    """
    d = _doc(doc, RobotDocument, where)
    link = _doc(d.ros, RosDocument, f"{where}.ros").link(f"{where}.ros", base)
    streams = (d.streams or {}).items()
    inbound = [_inbound(str(stream), opts, f"{where}.streams.{stream}") for stream, opts in streams]
    pub = _doc(d.publish, PublishDocument, f"{where}.publish")
    outbound = []
    for i, item in enumerate(pub.streams or []):
        w = f"{where}.publish.streams[{i}]"
        t = _doc(item, TopicDocument, w)
        if not t.stream:
            raise RobotConfigError(f"{w}.stream: missing")
        outbound.append(t.route(t.stream, w, "default"))
    frames = [
        _doc(item, FramesDocument, w).route(w)
        for i, item in enumerate(pub.frames or [])
        for w in [f"{where}.publish.frames[{i}]"]
    ]
    acts = _doc(d.actions, ActionsDocument, f"{where}.actions")
    fusion = spec_from_dict(d.fusion, where=f"{where}.fusion") if d.fusion else None
    routes = [
        _doc(opts, RouteDocument, w).route(str(kind), w)
        for kind, opts in (acts.routes or {}).items()
        for w in [f"{where}.actions.routes.{kind}"]
    ]
    offers = [
        _doc(opts, RouteDocument, w).route(str(kind), w)
        for kind, opts in (acts.offer or {}).items()
        for w in [f"{where}.actions.offer.{kind}"]
    ]
    return RobotConfig(
        ros=link,
        inbound=tuple(inbound),
        outbound=tuple(outbound),
        frames=tuple(frames),
        actions=tuple(routes),
        offers=tuple(offers),
        submit_topic=_topic(f"{where}.actions.submit_topic", acts.submit_topic),
        results_topic=_topic(f"{where}.actions.results_topic", acts.results_topic),
        fusion=fusion,
        bus=d.bus or None,
        namespace=d.namespace or None,
        clock=_clock(d, fusion, where),
        security=(
            _doc(d.security, SecurityDocument, f"{where}.security").paths(f"{where}.security", base)
            if d.security is not None
            else None
        ),
        discover=_discover(d.discover, f"{where}.discover"),
    )


def _inbound(stream: str, doc: Any, where: str) -> TopicRoute:
    t = _doc(doc, TopicDocument, where)
    if t.stream is not None and t.stream != stream:
        raise RobotConfigError(f"{where}.stream: the key names the stream ({stream!r}); delete stream:")
    return t.route(stream, where, "sensor_data")


def _discover(doc: Any, where: str) -> TopicSelection | None:
    if doc is None:
        return None
    try:
        return _doc(doc, DiscoverDocument, where).selection(where)
    except BusConfigError as err:
        if isinstance(err, RobotConfigError):
            raise
        raise RobotConfigError(str(err)) from None


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
    return robot_config_from_dict(doc or {}, where=str(path), base=Path(path).parent)
