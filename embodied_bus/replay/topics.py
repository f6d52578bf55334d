"""Per-topic decoders of a recording, chosen on each topic's first message.

The first message of a topic is always fully decoded (it validates the type). With
``decode=False`` the rest then take the fastest path proven equal on that message: ROS 2 CDR
passed through with the header read from the bytes, or ROS 1 bytes converted straight to ROS 2
CDR (compiled when the compiled converter gives the same bytes as rosbags).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from embodied_bus.replay.message import RecordedMessage
from embodied_bus.rosmsg.ros1_cdr import Ros1ToCdr, compile_ros1_to_cdr

__all__ = ["Source", "Topic", "TopicDecoder", "first_message"]


@dataclass(frozen=True, slots=True)
class Source:
    """What every topic of one open recording shares.

    Attributes:
        reader: The open rosbags ``AnyReader``.
        store: Its typestore (the default store plus the recording's own definitions).
        ros2: The ROS 2 typestore messages are written for.
        ros1: Whether the recording is a ROS 1 bag.
        decode: Deserialize every message (else only each topic's first).
    """

    reader: Any
    store: Any
    ros2: Any
    ros1: bool
    decode: bool


@dataclass(frozen=True, slots=True)
class Topic:
    """One connection of a recording.

    Attributes:
        topic: ROS topic.
        msgtype: Normalized ROS 2 type name.
        store_name: The type's name in the recording's typestore.
        connection: The rosbags connection.
    """

    topic: str
    msgtype: str
    store_name: str
    connection: Any = None


class TopicDecoder(Protocol):
    """Turns one topic's raw messages into :class:`RecordedMessage`."""

    def __call__(self, raw: bytes, log_ns: int) -> RecordedMessage: ...


def header_first(store: Any, typename: str) -> bool | None:
    """True if the type starts with ``std_msgs/msg/Header`` (stamp readable from CDR); False if
    it has no ``header`` field at all (no stamp to read); None if its header is elsewhere."""
    fields = store.fielddefs[typename][1]
    if fields and fields[0][0] == "header" and fields[0][1][1] == "std_msgs/msg/Header":
        return True
    if not any(name == "header" for name, _ in fields):
        return False
    return None


def cdr_header(cdr: bytes) -> tuple[int, str]:
    """``header.stamp`` (ns) and ``header.frame_id`` of a CDR message whose first field is a
    std_msgs/Header: int32 sec, uint32 nanosec, uint32 length, string."""
    fmt = "<iII" if cdr[1] == 1 else ">iII"
    sec, nsec, n = struct.unpack_from(fmt, cdr, 4)
    frame_id = cdr[16 : 16 + max(0, n - 1)].decode(errors="replace")
    return sec * 1_000_000_000 + nsec, frame_id


def message_header(message: Any) -> tuple[int, str]:
    """``header.stamp`` (ns) and ``header.frame_id`` of a decoded message ((0, "") without)."""
    header = getattr(message, "header", None)
    stamp = getattr(header, "stamp", None)
    if stamp is None:
        return 0, ""
    return int(stamp.sec) * 1_000_000_000 + int(stamp.nanosec), str(getattr(header, "frame_id", ""))


def _to_ros2(msg: Any, typename: str, store: Any) -> Any:
    """Rebuild a ROS 1 message as the ROS 2 type of the same name (``D`` → ``d``, no
    ``Header.seq``), recursively."""
    _, fields = store.fielddefs[typename]
    values = {}
    for name, (kind, spec) in fields:
        value = getattr(msg, name) if hasattr(msg, name) else getattr(msg, name.upper())
        kind_name = getattr(kind, "name", "")
        if kind_name == "NAME":
            value = _to_ros2(value, spec, store)
        elif kind_name in ("ARRAY", "SEQUENCE") and getattr(spec[0][0], "name", "") == "NAME":
            value = [_to_ros2(v, spec[0][1], store) for v in value]
        values[name] = value
    return store.types[typename](**values)


class Decoded:
    """ROS 2 messages, each deserialized (validated) and passed on as recorded."""

    def __init__(self, src: Source, t: Topic) -> None:
        self.src, self.t = src, t

    def __call__(self, raw: bytes, log_ns: int) -> RecordedMessage:
        msg = self.src.store.deserialize_cdr(raw, self.t.store_name)
        stamp_ns, frame_id = message_header(msg)
        return RecordedMessage(self.t.topic, self.t.msgtype, log_ns, stamp_ns, frame_id, bytes(raw), msg)


class PassedThrough:
    """ROS 2 CDR passed through; the header read from the bytes (if the type starts with one)."""

    def __init__(self, t: Topic, with_header: bool) -> None:
        self.t, self.with_header = t, with_header

    def __call__(self, raw: bytes, log_ns: int) -> RecordedMessage:
        cdr = bytes(raw)
        stamp_ns, frame_id = cdr_header(cdr) if self.with_header else (0, "")
        return RecordedMessage(self.t.topic, self.t.msgtype, log_ns, stamp_ns, frame_id, cdr, None)


class Ros1Converted:
    """ROS 1 messages deserialized and written as ROS 2 CDR: with the ROS 2 store when it knows
    the type (so ROS 2 readers decode it; field names that differ are rebuilt), else with the
    recording's own definition."""

    def __init__(self, src: Source, t: Topic) -> None:
        self.src, self.t = src, t
        self.known = t.msgtype in src.ros2.fielddefs
        self.rebuild = False  # ROS 1 field names differ (CameraInfo D, K, R, P): found once per topic

    def __call__(self, raw: bytes, log_ns: int) -> RecordedMessage:
        src, t = self.src, self.t
        msg = src.reader.deserialize(raw, t.store_name)
        if not self.known:
            cdr = bytes(src.store.serialize_cdr(msg, t.store_name))
        elif self.rebuild:
            msg = _to_ros2(msg, t.msgtype, src.ros2)
            cdr = bytes(src.ros2.serialize_cdr(msg, t.msgtype))
        else:
            try:
                cdr = bytes(src.ros2.serialize_cdr(msg, t.msgtype))
            except AttributeError:
                self.rebuild = True
                msg = _to_ros2(msg, t.msgtype, src.ros2)
                cdr = bytes(src.ros2.serialize_cdr(msg, t.msgtype))
        stamp_ns, frame_id = message_header(msg)
        return RecordedMessage(t.topic, t.msgtype, log_ns, stamp_ns, frame_id, cdr, msg)


class Ros1Direct:
    """ROS 1 bytes converted straight to ROS 2 CDR (proven byte-identical on the first message)."""

    def __init__(self, src: Source, t: Topic, fast: Ros1ToCdr | None, with_header: bool) -> None:
        self.src, self.t, self.fast, self.with_header = src, t, fast, with_header

    def __call__(self, raw: bytes, log_ns: int) -> RecordedMessage:
        convert: Callable[[bytes, str], Any] = self.src.ros2.ros1_to_cdr
        try:
            cdr = self.fast(raw) if self.fast is not None else bytes(convert(raw, self.t.msgtype))
        except (ValueError, struct.error):  # let rosbags name what is wrong
            cdr = bytes(convert(raw, self.t.msgtype))
        stamp_ns, frame_id = cdr_header(cdr) if self.with_header else (0, "")
        return RecordedMessage(self.t.topic, self.t.msgtype, log_ns, stamp_ns, frame_id, cdr, None)


def _ros1_shortcut(src: Source, t: Topic, raw: bytes, cdr: bytes) -> Ros1Direct | None:
    """A direct converter for a ROS 1 topic if it gives ``cdr`` from ``raw``, else None."""
    try:
        same = bytes(src.ros2.ros1_to_cdr(raw, t.msgtype)) == cdr
    except Exception:  # rosbags raises assorted errors; keep the slow path
        return None
    if not same:
        return None
    fast = compile_ros1_to_cdr(src.ros2, t.msgtype)
    try:  # byte-identical to rosbags, or not used
        if fast is not None and fast(raw) != cdr:
            fast = None
    except (ValueError, struct.error):
        fast = None
    return Ros1Direct(src, t, fast, bool(header_first(src.ros2, t.msgtype)))


def first_message(src: Source, t: Topic, raw: bytes, log_ns: int) -> tuple[RecordedMessage, TopicDecoder]:
    """The first message of a topic, fully decoded, and the decoder for the rest of it.

    Raises:
        Exception: Whatever rosbags raises on bad data (the caller skips the topic).
    """
    if src.ros1:
        converted = Ros1Converted(src, t)
        first = converted(raw, log_ns)
        if not src.decode and converted.known:
            direct = _ros1_shortcut(src, t, raw, first.cdr)
            if direct is not None:
                return first, direct
        return first, converted
    decoded = Decoded(src, t)
    first = decoded(raw, log_ns)
    if not src.decode:
        with_header = header_first(src.store, t.store_name)
        if with_header is not None:
            return first, PassedThrough(t, with_header)
    return first, decoded
