"""Bridge between the bus and ROS 2 nodes that use rmw_zenoh, with no rclpy.

The bridge joins the robot's ROS 2 graph as one ROS node over its own Zenoh session in
rmw_zenoh's format (:mod:`embodied_bus.rosmsg.rmw_zenoh`):

* **ROS → bus**: it subscribes to the configured topics and publishes each message, untouched
  CDR, as a bus sample stamped with the message's header stamp (a zero stamp falls back to the
  publisher's source timestamp, flagged; types without a header use the source timestamp).
* **bus → ROS**: it publishes bus streams and the members of fused frames as ROS topics with
  their original types and stamps, plus frame statistics as ``DiagnosticArray``.
* **actions** (when the bridge is given a :class:`~embodied_bus.actions.client.Planner`):
  queue actions of routed kinds run on ROS 2 action servers, offered kinds are ROS 2 action
  servers for ROS 2 action clients (:mod:`embodied_bus.ros.rmw_actions`), and ROS-side planners
  may also publish JSON on a ``std_msgs/String`` topic and read outcomes on another.
* **graph**: it declares rmw_zenoh liveliness tokens for its node, subscriptions and
  publishers, so ``ros2 node list`` / ``ros2 topic list`` / ``ros2 topic echo`` see it.
* **router**: with ``host_router`` set it runs the Zenoh router itself, so rmw_zenoh nodes on
  the robot need no ``rmw_zenohd``.

Samples from ROS without the rmw_zenoh attachment are dropped and counted (rmw_zenoh does the
same); malformed frames and type mismatches are counted and logged once per topic, and the
bridge keeps serving everything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import zenoh

from embodied_bus.actions.client import Planner
from embodied_bus.actions.executor import Executor
from embodied_bus.bus import Bus
from embodied_bus.errors import EncodingError
from embodied_bus.fusion.codec import decode_frame
from embodied_bus.model.qos import PublisherOptions
from embodied_bus.ros.bridge_core import (
    DIAGNOSTICS_TYPE,
    bus_backpressure,
    frame_diagnostics_cdr,
    frame_messages,
    frame_topics,
    has_header,
    header_of,
    outcome_json,
    parse_submission,
    resolve_routes,
    string_cdr,
    string_from_cdr,
)
from embodied_bus.ros.config import FrameRoute, RobotConfig, TopicRoute
from embodied_bus.ros.discovery import TopicSelection
from embodied_bus.ros.rmw_actions import QueueActionServer, RosActionClient, route_handler
from embodied_bus.ros.rmw_node import LoopHandoff, RmwNode, RosPublisher
from embodied_bus.ros.rmw_session import open_rmw_session, rmw_session_config
from embodied_bus.ros.sealing import bridge_credentials
from embodied_bus.rosmsg.interfaces import Interfaces
from embodied_bus.rosmsg.rmw_graph import GraphEntity, graph_keyexpr, parse_token
from embodied_bus.rosmsg.rmw_zenoh import (
    DEFAULT_QOS,
    EntityKind,
    QosProfile,
    RmwZenohError,
    unpack_attachment,
)
from embodied_bus.rosmsg.types import modality_of
from embodied_bus.streams.publisher import Publisher

__all__ = ["BridgeCounters", "RmwZenohBridge", "open_rmw_session", "rmw_session_config"]

_log = logging.getLogger("embodied_bus.ros")
_STRING_TYPE = "std_msgs/msg/String"


@dataclass
class BridgeCounters:
    """What the bridge did, for tests, ``--json`` and logs."""

    from_ros: Counter[str] = field(default_factory=Counter)
    to_ros: Counter[str] = field(default_factory=Counter)
    frames: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    submissions: int = 0

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-compatible dict."""
        return {
            "from_ros": dict(self.from_ros),
            "to_ros": dict(self.to_ros),
            "frames": self.frames,
            "rejected": dict(self.rejected),
            "submissions": self.submissions,
        }


class RmwZenohBridge:
    """ROS 2 (rmw_zenoh) ↔ bus bridge; see the module docstring.

    Args:
        bus: The bus to publish into and subscribe from.
        config: Topic routes, frame routes and how to join the ROS graph.
        planner: Accept action submissions from ROS (None: no action topics).
        session: A session from :func:`open_rmw_session` to use (and close); None: open one.
            Hosting the router before opening a bus that connects to it needs this order.

    Use ``async with RmwZenohBridge(...)`` or :meth:`start` / :meth:`close`.
    """

    def __init__(
        self, bus: Bus, config: RobotConfig, *, planner: Planner | None = None, session: Any = None
    ) -> None:
        self.bus = bus
        self.config = config
        self.planner = planner
        self.counters = BridgeCounters()
        self.session: Any = session
        self.node: RmwNode | None = None
        self.interfaces = Interfaces(config.ros.distro, config.ros.interfaces)
        #: Action routes and offers left out, one message each (type not found).
        self.problems: list[str] = []
        #: Topics bridged from the graph by ``discover:``, in the order they appeared.
        self.discovered: list[TopicRoute] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._servers: list[QueueActionServer] = []
        self._stop_executor = asyncio.Event()
        self._warned: set[str] = set()
        self._closed = False

    @property
    def zid(self) -> str:
        """Zenoh id of the ROS-side session."""
        return self.node.zid if self.node is not None else ""

    @property
    def tokens(self) -> list[str]:
        """Liveliness keys of the bridge's node and entities."""
        return self.node.tokens if self.node is not None else []

    async def __aenter__(self) -> RmwZenohBridge:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Open the ROS-side Zenoh session and declare every route.

        Raises:
            BusConnectionError: The Zenoh session could not be opened (e.g. the router endpoint
                is taken).
            RmwZenohError: A route names a type the configured distribution does not define.
        """
        self._loop = asyncio.get_running_loop()
        link = self.config.ros
        for route in (*self.config.inbound, *self.config.outbound):
            self.interfaces.hash(route.ros_type)  # fail early, naming the type
        if self.session is None:
            self.session = await open_rmw_session(link)
        self.node = RmwNode(self.session, link, self.interfaces)
        for route in self.config.inbound:
            self._subscribe_ros(route, await self._bus_publisher(route))
        if self.config.discover is not None:
            self._watch_graph(self.config.discover)
        self._declare_known_publishers()
        for route in self.config.outbound:
            self._tasks.append(asyncio.create_task(self._forward_stream(route)))
        for frame_route in self.config.frames:
            self._tasks.append(asyncio.create_task(self._forward_frames(frame_route)))
        if self.planner is not None:
            self._subscribe_submissions()
            self._start_actions(self.planner)

    def _start_actions(self, planner: Planner) -> None:
        """Offered kinds as action servers; routed kinds executed on ROS 2 action servers."""
        node = self.node
        assert node is not None
        offers, problems = resolve_routes(self.config.offers, lambda o: QueueActionServer(node, o, planner))
        self._servers = [server for _, server in offers]
        routes, more = resolve_routes(
            self.config.actions,
            lambda r: route_handler(
                RosActionClient(node, r.action, self.interfaces.action(r.action_type)), r
            ),
        )
        self.problems = [*problems, *more]
        for problem in self.problems:
            _log.error("%s", problem)
        if routes:
            creds = bridge_credentials(self.config.security)
            executor = Executor(
                self.bus,
                f"ros-{self.config.ros.node_name}",
                concurrency=len(routes),
                backend=creds.executor_options(),
            )
            for route, handler in routes:
                executor.handler(route.kind)(handler)
                _log.info(
                    "queue actions '%s' -> ROS 2 action %s (%s)", route.kind, route.action, route.action_type
                )
            self._tasks.append(asyncio.create_task(executor.run(self._stop_executor)))

    def _declare_known_publishers(self) -> None:
        """Every ROS publisher known from the config, declared now: the graph (``ros2 topic
        list``, ``count_publishers``) shows them before the first message flows. Members of
        fused frames are the fusion spec's streams that come from ROS."""
        for route in self.config.outbound:
            self._ros_publisher(route.topic, route.ros_type, route.qos)
        for frame_route in self.config.frames:
            for known in frame_topics(self.config, frame_route):
                self._ros_publisher(known.topic, known.ros_type)
        if self.planner is not None:
            self._ros_publisher(self.config.results_topic, _STRING_TYPE)

    async def _bus_publisher(self, route: TopicRoute) -> Publisher:
        return await self.bus.publisher(
            route.stream,
            modality=modality_of(route.ros_type),
            encoding=f"cdr:{route.ros_type}",
            clock=self.config.clock,
            options=PublisherOptions(backpressure=bus_backpressure(route.qos)),
        )

    def _watch_graph(self, selection: TopicSelection) -> None:
        """Bridge each topic another node publishes that ``selection`` admits, as the graph
        announces it (publishers there before the bridge included)."""
        loop, node = self._loop, self.node
        assert loop is not None and node is not None
        routed = {r.topic: r.ros_type for r in self.config.inbound}
        handoff = LoopHandoff(loop, lambda entity: self._discovered(selection, routed, entity))

        def on_token(sample: zenoh.Sample) -> None:
            if sample.kind != zenoh.SampleKind.PUT:
                return
            try:
                entity = parse_token(str(sample.key_expr))
            except RmwZenohError:
                return  # not an rmw_zenoh entity token
            if entity.kind is EntityKind.PUBLISHER and entity.zid != node.zid:
                handoff.put(entity)

        key = graph_keyexpr(self.config.ros.domain_id)
        node.keep(self.session.liveliness().declare_subscriber(key, on_token, history=True))

    def _discovered(self, selection: TopicSelection, routed: dict[str, str], entity: GraphEntity) -> None:
        if self.config.publishes(entity.topic):
            return  # the bridge's own output (another process may publish it, e.g. frame_bridge)
        known = routed.get(entity.topic)
        if known is not None:
            if known != entity.ros_type:
                self._warn_once(
                    f"type:{entity.topic}",
                    f"{entity.topic} is published as {entity.ros_type} by /{entity.node_name} too; "
                    f"the bridge takes it as {known} only",
                )
            return
        if not selection.admits(entity.topic):
            return
        stream = selection.stream_of(entity.topic)
        if stream is None:
            self._warn_once(entity.topic, f"{entity.topic} makes no bus stream name; not bridged")
            return
        routed[entity.topic] = entity.ros_type
        route = TopicRoute(entity.topic, entity.ros_type, stream, selection.qos_for(entity.qos))
        self._tasks.append(asyncio.create_task(self._bridge_discovered(route, entity.type_hash)))

    async def _bridge_discovered(self, route: TopicRoute, type_hash: str) -> None:
        try:
            pub = await self._bus_publisher(route)
        except Exception as err:  # keep serving the other topics; say what failed
            self._warn_once(route.stream, f"cannot bridge discovered {route.topic}: {err}")
            return
        self._subscribe_ros(route, pub, type_hash)
        self.discovered.append(route)
        _log.info("discovered %s (%s) -> stream %s", route.topic, route.ros_type, route.stream)

    def _subscribe_ros(self, route: TopicRoute, pub: Publisher, type_hash: str | None = None) -> None:
        loop = self._loop
        assert loop is not None and self.node is not None
        distro = self.config.ros.distro
        has_header(route.ros_type, distro)  # the type store loads now, not on the first message
        handoff = LoopHandoff(loop, lambda item: self._publish_in(route, pub, *item))

        def on_sample(sample: zenoh.Sample) -> None:
            att = sample.attachment
            try:
                a = unpack_attachment(att.to_bytes() if att is not None else None)
            except RmwZenohError as err:
                self.counters.rejected["no_attachment"] += 1
                self._warn_once(route.topic, f"dropping samples on {route.topic}: {err}")
                return
            payload = sample.payload.to_bytes()
            hdr = header_of(payload, route.ros_type, distro)
            fallback = False
            frame_id = ""
            if hdr is None:
                stamp = a.source_timestamp_ns
            else:
                stamp, frame_id = hdr
                if stamp == 0:
                    stamp, fallback = a.source_timestamp_ns or time.time_ns(), True
            handoff.put((payload, stamp, frame_id, fallback))

        self.node.subscribe(route.topic, route.ros_type, route.qos, on_sample, type_hash=type_hash)

    def _publish_in(
        self, route: TopicRoute, pub: Publisher, payload: bytes, stamp_ns: int, frame_id: str, fallback: bool
    ) -> None:
        if self._closed:
            return
        try:
            pub.publish_nowait(payload, stamp_ns=stamp_ns, frame_id=frame_id, stamp_fallback=fallback)
        except Exception as err:  # keep serving the other topics; say what failed
            self.counters.rejected["publish_error"] += 1
            self._warn_once(route.stream, f"cannot publish {route.topic} to stream {route.stream}: {err}")
            return
        self.counters.from_ros[route.topic] += 1

    def _ros_publisher(self, topic: str, ros_type: str, qos: QosProfile = DEFAULT_QOS) -> RosPublisher:
        assert self.node is not None
        return self.node.publisher(topic, ros_type, qos)

    async def _forward_stream(self, route: TopicRoute) -> None:
        sub = await self.bus.subscribe(route.stream)
        try:
            async for sample in sub:
                enc = sample.header.encoding
                if enc != f"cdr:{route.ros_type}":
                    self.counters.rejected["type_mismatch"] += 1
                    self._warn_once(
                        route.stream,
                        f"stream {route.stream} carries {enc!r}, not cdr:{route.ros_type}; not "
                        f"republished on {route.topic}",
                    )
                    continue
                self._ros_publisher(route.topic, route.ros_type, route.qos).put(sample.payload)
                self.counters.to_ros[route.topic] += 1
        finally:
            await sub.close()

    async def _forward_frames(self, route: FrameRoute) -> None:
        sub = await self.bus.subscribe(route.stream)
        distro = self.config.ros.distro
        try:
            async for sample in sub:
                try:
                    frame = decode_frame(sample.payload)
                except EncodingError as err:
                    self.counters.rejected["bad_frame"] += 1
                    self._warn_once(route.stream, f"undecodable frame on {route.stream}: {err}")
                    continue
                for msg in frame_messages(frame, route):
                    try:
                        self._ros_publisher(msg.topic, msg.ros_type).put(msg.cdr)
                    except RmwZenohError as err:
                        self.counters.rejected["unknown_type"] += 1
                        self._warn_once(msg.topic, f"cannot republish {msg.topic}: {err}")
                        continue
                    self.counters.to_ros[msg.topic] += 1
                self._ros_publisher(route.diagnostics, DIAGNOSTICS_TYPE).put(
                    frame_diagnostics_cdr(frame, route, distro=distro)
                )
                self.counters.to_ros[route.diagnostics] += 1
                self.counters.frames += 1
        finally:
            await sub.close()

    def _subscribe_submissions(self) -> None:
        results = self._ros_publisher(self.config.results_topic, _STRING_TYPE)
        loop = self._loop
        assert loop is not None

        def on_sample(sample: zenoh.Sample) -> None:
            if sample.attachment is None:
                self.counters.rejected["no_attachment"] += 1
                return
            payload = sample.payload.to_bytes()
            loop.call_soon_threadsafe(self._spawn_submit, payload, results)

        assert self.node is not None
        self.node.subscribe(self.config.submit_topic, _STRING_TYPE, DEFAULT_QOS, on_sample)

    def _spawn_submit(self, payload: bytes, results: RosPublisher) -> None:
        if not self._closed:
            self._tasks.append(asyncio.create_task(self._submit(payload, results)))

    async def _submit(self, payload: bytes, results: RosPublisher) -> None:
        assert self.planner is not None
        self.counters.submissions += 1
        request_id = None
        try:
            req = parse_submission(string_from_cdr(payload))
            request_id = req.request_id
            handle = await self.planner.submit(
                req.kind,
                req.payload,
                priority=req.priority,
                deadline_s=req.deadline_s,
                idempotency_key=req.idempotency_key,
            )
        except Exception as err:  # a bad submission is answered, never fatal
            self.counters.rejected["bad_submission"] += 1
            results.put(string_cdr(outcome_json(request_id=request_id, error=str(err))))
            return
        queued = await self.planner.get(handle.id)
        results.put(string_cdr(outcome_json(request_id=request_id, action=queued, status="queued")))
        try:
            final = await handle.result()
        except Exception as err:
            results.put(string_cdr(outcome_json(request_id=request_id, error=str(err), status="unknown")))
            return
        results.put(string_cdr(outcome_json(request_id=request_id, action=final)))

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            _log.warning("%s", message)

    async def run(self, stop: asyncio.Event) -> None:
        """Start, serve until ``stop`` is set, then close."""
        await self.start()
        try:
            await stop.wait()
        finally:
            await self.close()

    async def close(self) -> None:
        """Undeclare everything and close the ROS-side session. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_executor.set()  # a running action goes back to the queue
        for server in self._servers:
            await server.close()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.node is not None:
            self.node.close()
        if self.session is not None:
            await asyncio.to_thread(self.session.close)
