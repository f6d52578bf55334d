"""One ROS 2 node over a Zenoh session, in rmw_zenoh's wire format: its liveliness tokens,
publishers, subscriptions, service servers and service clients.

Used by the bridge for topics and by :mod:`embodied_bus.ros.rmw_actions` for actions; the
format itself is in :mod:`embodied_bus.rosmsg.rmw_zenoh`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import zenoh
import zenoh.ext

from embodied_bus.ros.config import RosLink
from embodied_bus.rosmsg.interfaces import Interfaces
from embodied_bus.rosmsg.rmw_zenoh import (
    DEFAULT_QOS,
    Durability,
    EntityKind,
    QosProfile,
    Reliability,
    RmwZenohError,
    entity_token,
    gid_of,
    node_token,
    pack_attachment,
    topic_key,
    unpack_attachment,
)

#: rmw_zenoh's depth when a profile says 0.
DEFAULT_DEPTH = 42

__all__ = ["LoopHandoff", "RmwNode", "RosClient", "RosPublisher", "ServiceUnavailable", "reply"]


class LoopHandoff:
    """Items from Zenoh's threads to the event loop with one wake-up per burst, not per item
    (waking the loop costs more than handling a small message)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, handle: Callable[[Any], None]) -> None:
        self._loop = loop
        self._handle = handle
        self._items: deque[Any] = deque()
        self._lock = threading.Lock()
        self._scheduled = False

    def put(self, item: Any) -> None:
        """Queue ``item`` (any thread); the loop handles it soon, in order."""
        self._items.append(item)
        with self._lock:
            if self._scheduled:
                return
            self._scheduled = True
        self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            self._scheduled = False
        items = self._items
        while items:
            self._handle(items.popleft())


class ServiceUnavailable(RmwZenohError):
    """No server answered a service request in time."""


class RosPublisher:
    """One rmw_zenoh publisher: key, liveliness token, GID and sequence numbers."""

    def __init__(self, node: RmwNode, topic: str, ros_type: str, qos: QosProfile) -> None:
        hash_ = node.interfaces.hash(ros_type)
        self.topic = topic
        self.ros_type = ros_type
        self.key = topic_key(node.link.domain_id, topic, ros_type, hash_)
        self.token_key = node.entity_token(EntityKind.PUBLISHER, topic, ros_type, hash_, qos)
        self.gid = gid_of(self.token_key)
        self.seq = 0
        reliable = qos.reliable
        reliability = zenoh.Reliability.RELIABLE if reliable else zenoh.Reliability.BEST_EFFORT
        # as rmw_zenoh: drop under congestion, except reliable keep-all, which waits
        congestion = zenoh.CongestionControl.BLOCK if qos.blocking else zenoh.CongestionControl.DROP
        self._pub: Any
        if qos.durability is Durability.TRANSIENT_LOCAL:
            # as rmw_zenoh: the last ``depth`` samples are kept for late subscribers, which
            # find this publisher by its detection token and query them
            self._pub = zenoh.ext.declare_advanced_publisher(
                node.session,
                self.key,
                congestion_control=congestion,
                reliability=reliability,
                cache=zenoh.ext.CacheConfig(qos.depth or DEFAULT_DEPTH),
                publisher_detection=True,
                sample_miss_detection=zenoh.ext.MissDetectionConfig(heartbeat=None, sporadic_heartbeat=0.5)
                if reliable
                else None,
            )
        else:
            self._pub = node.session.declare_publisher(
                self.key, congestion_control=congestion, reliability=reliability
            )
        self._token = node.session.liveliness().declare_token(self.token_key)

    def put(self, cdr: bytes | memoryview) -> None:
        """Publish one serialized message."""
        self.seq += 1
        self._pub.put(bytes(cdr), attachment=pack_attachment(self.seq, time.time_ns(), self.gid))

    def has_subscribers(self) -> bool:
        """Whether a subscription matches (True where the publisher cannot tell)."""
        status = getattr(self._pub, "matching_status", None)
        return True if status is None else bool(getattr(status, "matching", status))

    def undeclare(self) -> None:
        """Withdraw the publisher and its token."""
        with contextlib.suppress(Exception):
            self._token.undeclare()
        with contextlib.suppress(Exception):
            self._pub.undeclare()


class RosClient:
    """A service client: each call is one Zenoh query carrying the rmw_zenoh attachment.

    ``any_hash`` matches servers of this service name and type whatever hash they key it by
    (for fixed types whose hash some implementations compute differently, such as
    ``action_msgs/srv/CancelGoal``).
    """

    def __init__(
        self, node: RmwNode, service: str, srv_type: str, hash_: str, *, any_hash: bool = False
    ) -> None:
        self.node = node
        self.service = service
        key = topic_key(node.link.domain_id, service, srv_type, hash_)
        self.key = key.rsplit("/", 1)[0] + "/*" if any_hash else key
        # a server keyed by one hash is not complete for the wildcard: ask every match
        self.target = zenoh.QueryTarget.ALL if any_hash else zenoh.QueryTarget.ALL_COMPLETE
        self.token_key = node.entity_token(EntityKind.CLIENT, service, srv_type, hash_, DEFAULT_QOS)
        self.gid = gid_of(self.token_key)
        self.seq = 0
        node.keep(node.session.liveliness().declare_token(self.token_key))

    async def call(self, request_cdr: bytes, timeout_s: float) -> bytes:
        """Send a request; the first reply's payload.

        Raises:
            ServiceUnavailable: No server replied within ``timeout_s``.
        """
        self.seq += 1
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[bytes] = loop.create_future()

        def settle(value: bytes | None) -> None:
            if reply.done():
                return
            if value is None:
                reply.set_exception(
                    ServiceUnavailable(f"no server of {self.service} answered within {timeout_s:g} s")
                )
            else:
                reply.set_result(value)

        def on_reply(r: zenoh.Reply) -> None:
            if r.ok is not None:
                loop.call_soon_threadsafe(settle, r.ok.payload.to_bytes())

        def on_done() -> None:
            loop.call_soon_threadsafe(settle, None)

        self.node.session.get(
            self.key,
            zenoh.handlers.Callback(on_reply, on_done),
            target=self.target,
            consolidation=zenoh.ConsolidationMode.NONE,
            payload=request_cdr,
            attachment=pack_attachment(self.seq, time.time_ns(), self.gid),
            timeout=timeout_s,
        )
        return await reply


class RmwNode:
    """A ROS 2 node on ``session`` (see the module docstring).

    Args:
        session: An open Zenoh session reaching the robot's router.
        link: Domain, namespace and node name.
        interfaces: Where types and their hashes come from.
        node_id: The node's id inside the session (several nodes may share one session).
    """

    def __init__(self, session: Any, link: RosLink, interfaces: Interfaces, *, node_id: int = 0) -> None:
        self.session = session
        self.link = link
        self.interfaces = interfaces
        self.zid = str(session.zid())
        self.node_id = node_id
        self.tokens: list[str] = []
        self._entity = 0
        self._decls: list[Any] = []
        self._publishers: dict[tuple[str, str], RosPublisher] = {}
        tok = node_token(link.domain_id, self.zid, node_id, link.namespace, link.node_name)
        self.keep(session.liveliness().declare_token(tok))
        self.tokens.append(tok)

    def keep(self, declaration: Any) -> Any:
        """Hold a Zenoh declaration until :meth:`close`."""
        self._decls.append(declaration)
        return declaration

    def entity_token(self, kind: EntityKind, name: str, ros_type: str, hash_: str, qos: QosProfile) -> str:
        """The liveliness key of a new entity of this node (and remember it)."""
        self._entity += 1
        link = self.link
        tok = entity_token(
            link.domain_id,
            self.zid,
            self.node_id,
            self._entity,
            kind,
            link.namespace,
            link.node_name,
            name,
            ros_type,
            hash_,
            qos,
        )
        self.tokens.append(tok)
        return tok

    def publisher(self, topic: str, ros_type: str, qos: QosProfile = DEFAULT_QOS) -> RosPublisher:
        """The node's publisher of ``topic`` (declared on first use)."""
        key = (topic, ros_type)
        pub = self._publishers.get(key)
        if pub is None:
            pub = self._publishers[key] = RosPublisher(self, topic, ros_type, qos)
        return pub

    def subscribe(
        self,
        topic: str,
        ros_type: str,
        qos: QosProfile,
        on_sample: Callable[[zenoh.Sample], None],
        *,
        type_hash: str | None = None,
    ) -> None:
        """A subscriber on a ROS topic (``on_sample`` runs on a Zenoh thread); ``type_hash`` as a
        publisher announced it, for types this distribution does not define (else looked up)."""
        hash_ = type_hash or self.interfaces.hash(ros_type)
        key = topic_key(self.link.domain_id, topic, ros_type, hash_)
        if qos.durability is Durability.TRANSIENT_LOCAL:
            # as rmw_zenoh: ask late-detected publishers for their cached samples
            recovery = (
                zenoh.ext.RecoveryConfig(periodic_queries=None, heartbeat=True)
                if qos.reliability is Reliability.RELIABLE
                else None
            )
            history = zenoh.ext.HistoryConfig(
                detect_late_publishers=True, max_samples=qos.depth or DEFAULT_DEPTH
            )
            self.keep(
                zenoh.ext.declare_advanced_subscriber(
                    self.session,
                    key,
                    on_sample,
                    history=history,
                    recovery=recovery,
                    subscriber_detection=True,
                )
            )
        else:
            self.keep(self.session.declare_subscriber(key, on_sample))
        self.keep(
            self.session.liveliness().declare_token(
                self.entity_token(EntityKind.SUBSCRIPTION, topic, ros_type, hash_, qos)
            )
        )

    def serve(
        self,
        service: str,
        srv_type: str,
        hash_: str,
        on_query: Callable[[zenoh.Query], None],
        *,
        any_hash: bool = False,
    ) -> None:
        """A service server: ``on_query`` gets each request (on a Zenoh thread) and answers it
        with :func:`reply`, now or later."""
        key = topic_key(self.link.domain_id, service, srv_type, hash_)
        if any_hash:
            key = key.rsplit("/", 1)[0] + "/*"
        self.keep(self.session.declare_queryable(key, on_query, complete=True))
        self.keep(
            self.session.liveliness().declare_token(
                self.entity_token(EntityKind.SERVICE, service, srv_type, hash_, DEFAULT_QOS)
            )
        )

    def client(self, service: str, srv_type: str, hash_: str, *, any_hash: bool = False) -> RosClient:
        """A service client of this node."""
        return RosClient(self, service, srv_type, hash_, any_hash=any_hash)

    def close(self) -> None:
        """Undeclare every entity (the session stays open). Idempotent."""
        for pub in self._publishers.values():
            pub.undeclare()
        self._publishers.clear()
        for d in reversed(self._decls):
            with contextlib.suppress(Exception):
                d.undeclare()
        self._decls.clear()


def reply(query: zenoh.Query, response_cdr: bytes) -> None:
    """Answer a service request as rmw_zenoh does: the request's sequence number and client GID
    with a new timestamp. A request without the attachment is answered with an error."""
    with query:
        try:
            att = unpack_attachment(query.attachment.to_bytes() if query.attachment is not None else None)
        except RmwZenohError as err:
            query.reply_err(str(err))
            return
        query.reply(
            query.key_expr,
            response_cdr,
            attachment=pack_attachment(att.sequence_number, time.time_ns(), att.gid),
        )
