"""The ROS 2 graph as rmw_zenoh announces it: liveliness tokens read back into entities.

Every rmw_zenoh node declares one token for itself and one per publisher, subscription,
service and client (:func:`~embodied_bus.rosmsg.rmw_zenoh.entity_token` writes them). Reading
them gives what ``ros2 topic list -t`` shows: which topics exist, with which type, type hash and
QoS, from which node. Pure functions, no session.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from embodied_bus.rosmsg.rmw_zenoh import (
    ADMIN_SPACE,
    DEFAULT_QOS,
    Durability,
    EntityKind,
    History,
    QosProfile,
    Reliability,
    RmwZenohError,
    ros_type_of_dds,
)

__all__ = ["GraphEntity", "graph_keyexpr", "parse_token", "qos_of_keyexpr"]

_NODE_CHUNKS = 9
_ENTITY_CHUNKS = 13


@dataclass(frozen=True, slots=True)
class GraphEntity:
    """One node or endpoint of the ROS graph.

    Attributes:
        domain_id: ROS domain.
        zid: Zenoh id of the session that declared it.
        node_id: The node's id within its session.
        entity_id: The entity's id within its session (a node's is its node id).
        kind: Node, publisher, subscription, service or client.
        namespace: The node's namespace (``""`` for the root).
        node_name: The node's name.
        topic: Absolute topic or service name (``""`` for a node).
        ros_type: e.g. ``sensor_msgs/msg/Imu`` (``""`` for a node).
        type_hash: ``RIHS01_…`` (``""`` for a node).
        qos: The endpoint's QoS (rclcpp's default for a node).
    """

    domain_id: int
    zid: str
    node_id: int
    entity_id: int
    kind: EntityKind
    namespace: str
    node_name: str
    topic: str = ""
    ros_type: str = ""
    type_hash: str = ""
    qos: QosProfile = DEFAULT_QOS


def graph_keyexpr(domain_id: int) -> str:
    """Key expression matching every liveliness token of one domain."""
    return f"{ADMIN_SPACE}/{domain_id}/**"


def _unmangle(chunk: str) -> str:
    return "" if chunk == "%" else chunk.replace("%", "/")


def _int(what: str, text: str, key: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise RmwZenohError(f"liveliness token {key!r}: {what} {text!r} is not an integer") from None


def qos_of_keyexpr(text: str) -> QosProfile:
    """The QoS written into a token (``<rel>:<dur>:<hist>,<depth>:…``; empty fields are
    rmw_zenoh's defaults: reliable, volatile, keep-last, depth 42).

    Raises:
        RmwZenohError: Not a QoS field of a token.
    """
    fields = text.split(":")
    hist_depth = fields[2].split(",") if len(fields) > 2 else []
    if len(fields) < 3 or len(hist_depth) != 2:
        raise RmwZenohError(f"{text!r} is not an rmw_zenoh QoS (<rel>:<dur>:<hist>,<depth>:...)")
    rel, dur = fields[0], fields[1]
    hist, depth = hist_depth
    try:
        return QosProfile(
            Reliability(int(rel)) if rel else Reliability.RELIABLE,
            Durability(int(dur)) if dur else Durability.VOLATILE,
            History(int(hist)) if hist else History.KEEP_LAST,
            int(depth) if depth else 42,
        )
    except ValueError as err:
        raise RmwZenohError(f"QoS {text!r}: {err}") from None


def parse_token(key: str) -> GraphEntity:
    """The entity a liveliness token announces.

    Raises:
        RmwZenohError: Not an rmw_zenoh node or entity token.
    """
    chunks = key.split("/")
    if chunks[0] != ADMIN_SPACE or len(chunks) not in (_NODE_CHUNKS, _ENTITY_CHUNKS):
        raise RmwZenohError(f"{key!r} is not an rmw_zenoh liveliness token")
    try:
        kind = EntityKind(chunks[5])
    except ValueError:
        raise RmwZenohError(f"liveliness token {key!r}: unknown entity kind {chunks[5]!r}") from None
    if (kind is EntityKind.NODE) != (len(chunks) == _NODE_CHUNKS):
        raise RmwZenohError(f"liveliness token {key!r}: a {kind.name.lower()} token of {len(chunks)} chunks")
    base = GraphEntity(
        domain_id=_int("domain", chunks[1], key),
        zid=chunks[2],
        node_id=_int("node id", chunks[3], key),
        entity_id=_int("entity id", chunks[4], key),
        kind=kind,
        namespace=_unmangle(chunks[7]),
        node_name=chunks[8],
    )
    if kind is EntityKind.NODE:
        return base
    return replace(
        base,
        topic=_unmangle(chunks[9]),
        ros_type=ros_type_of_dds(chunks[10]),
        type_hash=chunks[11],
        qos=qos_of_keyexpr(chunks[12]),
    )
