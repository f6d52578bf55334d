"""The rmw_zenoh wire format (ROS 2 Jazzy and newer), so embodied_bus talks to ROS 2 nodes that
use ``rmw_zenoh_cpp`` directly over Zenoh, without rclpy.

Pure functions, no session: key expressions, liveliness tokens, QoS strings, type hashes, GIDs
and the 33-byte sample attachment. The bridge (:mod:`embodied_bus.ros.rmw_bridge`) puts them on
the wire.

* Data key: ``<domain>/<topic without leading and trailing "/">/<dds type>/<RIHS01 hash>``,
  e.g. ``0/chatter/std_msgs::msg::dds_::String_/RIHS01_df66…1a18``.
* Liveliness tokens: ``@ros2_lv/<domain>/<zid>/<node id>/<entity id>/<NN|MP|MS|SS|SC>/<enclave>/
  <namespace>/<node>[/<topic>/<dds type>/<hash>/<qos>]`` with every ``/`` inside a name replaced
  by ``%`` and an empty namespace or enclave written as ``%``.
* Attachment: int64 sequence number (from 1), int64 source timestamp (ns since the epoch), the
  length byte 16 and the 16-byte GID, little endian: 33 bytes. rmw_zenoh drops samples without it.
* GID: XXH3-128 of the entity's liveliness key expression, low 64 bits then high 64 bits, each
  little endian.

Humble is not interoperable: it keys topics with ``TypeHashNotSupported`` and rmw_zenoh itself
documents that Humble and newer distributions silently exchange no data.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import xxhash

from embodied_bus.errors import EmbodiedBusError

__all__ = [
    "ADMIN_SPACE",
    "ATTACHMENT_BYTES",
    "DEFAULT_QOS",
    "DEFAULT_ROUTER_ENDPOINT",
    "SENSOR_DATA_QOS",
    "SUPPORTED_DISTROS",
    "Attachment",
    "Durability",
    "EntityKind",
    "History",
    "QosProfile",
    "Reliability",
    "RmwZenohError",
    "dds_type_name",
    "entity_token",
    "gid_of",
    "mangle",
    "node_token",
    "pack_attachment",
    "ros_type_of_dds",
    "topic_key",
    "type_hash",
    "unpack_attachment",
]

#: Admin space of rmw_zenoh's liveliness tokens.
ADMIN_SPACE = "@ros2_lv"
#: Where rmw_zenoh nodes look for their router by default.
DEFAULT_ROUTER_ENDPOINT = "tcp/localhost:7447"
#: Size of the rmw_zenoh sample attachment in bytes.
ATTACHMENT_BYTES = 33
_ATTACHMENT = struct.Struct("<qqB")
#: Distribution name → rosbags typestore holding its message definitions (hashes are RIHS01).
SUPPORTED_DISTROS = {
    "jazzy": "ROS2_JAZZY",
    "kilted": "ROS2_KILTED",
    "rolling": "LATEST",
}
#: rmw_zenoh's depth when a profile says 0.
_DEFAULT_DEPTH = 42


class RmwZenohError(EmbodiedBusError):
    """Invalid input for the rmw_zenoh wire format (a name, type, distro or attachment)."""


class EntityKind(str, enum.Enum):
    """Entity kinds in liveliness tokens."""

    NODE = "NN"
    PUBLISHER = "MP"
    SUBSCRIPTION = "MS"
    SERVICE = "SS"
    CLIENT = "SC"


class Reliability(enum.IntEnum):
    """rmw reliability policy values."""

    RELIABLE = 1
    BEST_EFFORT = 2


class Durability(enum.IntEnum):
    """rmw durability policy values."""

    TRANSIENT_LOCAL = 1
    VOLATILE = 2


class History(enum.IntEnum):
    """rmw history policy values."""

    KEEP_LAST = 1
    KEEP_ALL = 2


@dataclass(frozen=True, slots=True)
class QosProfile:
    """The QoS of a ROS 2 endpoint, as rmw_zenoh writes it into liveliness tokens.

    Deadline, lifespan and liveliness are not implemented by rmw_zenoh and always default.
    """

    reliability: Reliability = Reliability.RELIABLE
    durability: Durability = Durability.VOLATILE
    history: History = History.KEEP_LAST
    depth: int = 10

    @property
    def reliable(self) -> bool:
        """Whether the endpoint asks for reliable delivery."""
        return self.reliability is Reliability.RELIABLE

    @property
    def blocking(self) -> bool:
        """Whether rmw_zenoh publishes with congestion control ``BLOCK`` (reliable, keep-all): a
        congested link makes the publisher wait instead of dropping."""
        return self.reliable and self.history is History.KEEP_ALL

    def keyexpr(self) -> str:
        """``<rel>:<dur>:<hist>,<depth>:<deadline>:<lifespan>:<liveliness>``, each field empty when
        it equals rmw_zenoh's default (reliable, volatile, keep-last, depth 42, infinite, automatic)."""
        depth = self.depth or _DEFAULT_DEPTH
        rel = "" if self.reliability is Reliability.RELIABLE else str(int(self.reliability))
        dur = "" if self.durability is Durability.VOLATILE else str(int(self.durability))
        hist = "" if self.history is History.KEEP_LAST else str(int(self.history))
        dep = "" if depth == _DEFAULT_DEPTH else str(depth)
        return f"{rel}:{dur}:{hist},{dep}:,:,:,,"

    @classmethod
    def parse(cls, value: str | dict[str, Any] | None) -> QosProfile:
        """A profile from config: ``sensor_data``, ``default``, ``reliable``, ``best_effort``, or a
        mapping ``{reliability: best_effort, durability: transient_local, depth: 5}``.

        Raises:
            RmwZenohError: Unknown profile or field value.
        """
        if value is None or value == "default":
            return DEFAULT_QOS
        if value == "sensor_data":
            return SENSOR_DATA_QOS
        if value == "reliable":
            return QosProfile()
        if value == "best_effort":
            return QosProfile(reliability=Reliability.BEST_EFFORT)
        if not isinstance(value, dict):
            raise RmwZenohError(
                f"QoS {value!r}: expected sensor_data, default, reliable, best_effort or a mapping"
            )
        unknown = set(value) - {"reliability", "durability", "history", "depth"}
        if unknown:
            raise RmwZenohError(f"QoS: unknown key(s) {sorted(unknown)}")
        try:
            rel = Reliability[str(value.get("reliability", "reliable")).upper()]
            dur = Durability[str(value.get("durability", "volatile")).upper()]
            hist = History[str(value.get("history", "keep_last")).upper()]
        except KeyError as err:
            raise RmwZenohError(f"QoS: unknown value {err.args[0].lower()!r}") from None
        depth = value.get("depth", 10)
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise RmwZenohError(f"QoS depth: expected an integer >= 0, got {depth!r}")
        return QosProfile(rel, dur, hist, depth)


#: rclcpp's default: reliable, volatile, keep last 10.
DEFAULT_QOS = QosProfile()
#: rclcpp's sensor-data profile: best effort, volatile, keep last 5.
SENSOR_DATA_QOS = QosProfile(reliability=Reliability.BEST_EFFORT, depth=5)


def _check_type(ros_type: str) -> tuple[str, str, str]:
    parts = ros_type.split("/")
    if len(parts) != 3 or parts[1] not in ("msg", "srv", "action") or not all(parts):
        raise RmwZenohError(f"ROS type {ros_type!r}: expected pkg/msg/Name")
    return parts[0], parts[1], parts[2]


def dds_type_name(ros_type: str) -> str:
    """``std_msgs/msg/String`` → ``std_msgs::msg::dds_::String_``."""
    pkg, sub, name = _check_type(ros_type)
    return f"{pkg}::{sub}::dds_::{name}_"


def ros_type_of_dds(dds_type: str) -> str:
    """``std_msgs::msg::dds_::String_`` → ``std_msgs/msg/String``.

    Raises:
        RmwZenohError: Not a DDS type name.
    """
    parts = dds_type.split("::")
    if len(parts) != 4 or parts[2] != "dds_" or not parts[3].endswith("_"):
        raise RmwZenohError(f"{dds_type!r} is not a DDS type name (pkg::msg::dds_::Name_)")
    return f"{parts[0]}/{parts[1]}/{parts[3][:-1]}"


@lru_cache(maxsize=8)
def _store(distro: str) -> Any:
    from rosbags.typesys import Stores, get_typestore

    key = distro.lower()
    if key == "humble":
        raise RmwZenohError(
            "ROS 2 Humble is not interoperable over rmw_zenoh (it has no type hashes; rmw_zenoh "
            "documents that Humble and newer distributions exchange no data); use jazzy or newer"
        )
    if key not in SUPPORTED_DISTROS:
        raise RmwZenohError(f"ROS distro {distro!r}: expected one of {', '.join(SUPPORTED_DISTROS)}")
    return get_typestore(getattr(Stores, SUPPORTED_DISTROS[key]))


def typestore_for(distro: str) -> Any:
    """The rosbags typestore of a supported distribution (see :data:`SUPPORTED_DISTROS`)."""
    return _store(distro)


@lru_cache(maxsize=1024)
def type_hash(ros_type: str, distro: str = "jazzy") -> str:
    """The RIHS01 type hash rmw_zenoh puts into keys, from the distribution's definitions.

    Raises:
        RmwZenohError: Humble, an unknown distribution, or a type the distribution lacks.
    """
    _check_type(ros_type)
    store = _store(distro)
    if ros_type not in store.fielddefs:
        raise RmwZenohError(f"type {ros_type!r} is not defined in ROS 2 {distro}")
    return str(store.hash_rihs01(ros_type))


def mangle(name: str) -> str:
    """A ROS name as a single key chunk: every ``/`` becomes ``%``; empty becomes ``%``."""
    return name.replace("/", "%") if name else "%"


def _check_topic(topic: str) -> str:
    stripped = topic.strip("/")
    if not stripped or "//" in stripped or any(c in stripped for c in "*$?#% "):
        raise RmwZenohError(f"ROS topic name {topic!r} is not valid")
    return stripped


def topic_key(domain_id: int, topic: str, ros_type: str, hash_: str) -> str:
    """Data key expression of a topic: ``<domain>/<topic>/<dds type>/<hash>``."""
    if domain_id < 0 or domain_id > 232:
        raise RmwZenohError(f"ROS domain id {domain_id} is outside 0..232")
    return f"{domain_id}/{_check_topic(topic)}/{dds_type_name(ros_type)}/{hash_}"


def _fq_namespace(namespace: str) -> str:
    ns = namespace.strip("/")
    return "/" + ns if ns else ""


def node_token(
    domain_id: int, zid: str, node_id: int, namespace: str, node_name: str, *, enclave: str = ""
) -> str:
    """Liveliness token of a node (its entity id is its node id)."""
    if not node_name or "/" in node_name:
        raise RmwZenohError(f"ROS node name {node_name!r} is not valid")
    return (
        f"{ADMIN_SPACE}/{domain_id}/{zid}/{node_id}/{node_id}/{EntityKind.NODE.value}/"
        f"{mangle(enclave)}/{mangle(_fq_namespace(namespace))}/{node_name}"
    )


def entity_token(
    domain_id: int,
    zid: str,
    node_id: int,
    entity_id: int,
    kind: EntityKind,
    namespace: str,
    node_name: str,
    topic: str,
    ros_type: str,
    hash_: str,
    qos: QosProfile,
    *,
    enclave: str = "",
) -> str:
    """Liveliness token of a publisher, subscription, service or client."""
    if kind is EntityKind.NODE:
        raise RmwZenohError("use node_token() for nodes")
    base = node_token(domain_id, zid, node_id, namespace, node_name, enclave=enclave)
    base = base.replace(f"/{node_id}/{node_id}/NN/", f"/{node_id}/{entity_id}/{kind.value}/", 1)
    fq_topic = "/" + _check_topic(topic)
    return f"{base}/{mangle(fq_topic)}/{dds_type_name(ros_type)}/{hash_}/{qos.keyexpr()}"


def gid_of(token: str) -> bytes:
    """The 16-byte GID rmw_zenoh derives from an entity's liveliness key expression."""
    h = xxhash.xxh3_128_intdigest(token.encode())
    return struct.pack("<QQ", h & 0xFFFF_FFFF_FFFF_FFFF, h >> 64)


@dataclass(frozen=True, slots=True)
class Attachment:
    """What rmw_zenoh attaches to every sample."""

    sequence_number: int
    source_timestamp_ns: int
    gid: bytes


def pack_attachment(sequence_number: int, source_timestamp_ns: int, gid: bytes) -> bytes:
    """The 33-byte attachment (``struct.pack('<qqB', seq, ts, 16) + gid``)."""
    if len(gid) != 16:
        raise RmwZenohError(f"GID must be 16 bytes, got {len(gid)}")
    return _ATTACHMENT.pack(sequence_number, source_timestamp_ns, 16) + gid


def unpack_attachment(buf: bytes | bytearray | memoryview | None) -> Attachment:
    """Parse an attachment.

    Raises:
        RmwZenohError: Missing, wrong size or wrong GID length (rmw_zenoh drops such samples).
    """
    if buf is None:
        raise RmwZenohError("sample has no rmw_zenoh attachment")
    if len(buf) != ATTACHMENT_BYTES:
        raise RmwZenohError(f"rmw_zenoh attachment must be {ATTACHMENT_BYTES} bytes, got {len(buf)}")
    seq, ts, n = _ATTACHMENT.unpack_from(buf, 0)
    if n != 16:
        raise RmwZenohError(f"rmw_zenoh attachment GID length must be 16, got {n}")
    return Attachment(seq, ts, bytes(buf[17:33]))
