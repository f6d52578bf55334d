"""Read recordings through rosbags: every message as CDR with its log time and header stamp.

Types are normalized (``sensor_msgs/Image`` → ``sensor_msgs/msg/Image``, as written by ROS 2
Dashing). A topic whose type has no definition (neither in the file nor in the typestore) is
reported once as :class:`SkippedTopic` and never raises.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embodied_bus.errors import EmbodiedBusError
from embodied_bus.ros.conversions import typestore
from embodied_bus.ros.ros1_cdr import Ros1ToCdr, compile_ros1_to_cdr

__all__ = [
    "RecordedMessage",
    "RecordingError",
    "RecordingInfo",
    "SkippedTopic",
    "modality_of",
    "normalize_msgtype",
    "read_recording",
    "recording_info",
    "topic_to_stream",
]


#: What rosbags raises on a damaged or truncated file while opening it (beside its own errors).
_OPEN_ERRORS = (OSError, ValueError, KeyError, TypeError, IndexError, EOFError, struct.error)


class RecordingError(EmbodiedBusError):
    """A recording cannot be opened or read."""


@dataclass(frozen=True, slots=True)
class RecordedMessage:
    """One message of a recording.

    Attributes:
        topic: ROS topic.
        msgtype: Normalized ROS 2 type name (``pkg/msg/Type``).
        log_time_ns: When the recorder got it, UTC nanoseconds.
        stamp_ns: ``header.stamp`` in nanoseconds, 0 if the message has no header or a zero stamp.
        frame_id: ``header.frame_id`` (empty without a header).
        cdr: The message as ROS 2 CDR (little endian, with the encapsulation header).
        message: The deserialized rosbags message (None when read with ``decode=False``; see
            :meth:`decoded`).
    """

    topic: str
    msgtype: str
    log_time_ns: int
    stamp_ns: int
    frame_id: str
    cdr: bytes
    message: Any

    def decoded(self) -> Any:
        """The deserialized message (decoded now if it was read with ``decode=False``)."""
        if self.message is not None:
            return self.message
        return typestore().deserialize_cdr(self.cdr, self.msgtype)


@dataclass(frozen=True, slots=True)
class SkippedTopic:
    """A topic that cannot be decoded, reported once per topic with the reason."""

    topic: str
    msgtype: str
    reason: str


def normalize_msgtype(msgtype: str) -> str:
    """``pkg/Type`` → ``pkg/msg/Type``; other forms unchanged."""
    parts = msgtype.split("/")
    return f"{parts[0]}/msg/{parts[1]}" if len(parts) == 2 else msgtype


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


def _has_header_first(store: Any, typename: str) -> bool | None:
    """True if the type starts with ``std_msgs/msg/Header`` (stamp readable from CDR); False if
    it has no ``header`` field at all (no stamp to read); None if its header is elsewhere."""
    fields = store.fielddefs[typename][1]
    if fields and fields[0][0] == "header" and fields[0][1][1] == "std_msgs/msg/Header":
        return True
    if not any(name == "header" for name, _ in fields):
        return False
    return None


def _cdr_header(cdr: bytes) -> tuple[int, str]:
    """``header.stamp`` (ns) and ``header.frame_id`` of a little-endian CDR message whose first
    field is a std_msgs/Header: int32 sec, uint32 nanosec, uint32 length, string."""
    if cdr[1] != 1:  # big-endian CDR: let the full decoder handle it
        sec, nsec, n = struct.unpack_from(">iII", cdr, 4)
    else:
        sec, nsec, n = struct.unpack_from("<iII", cdr, 4)
    frame_id = cdr[16 : 16 + max(0, n - 1)].decode(errors="replace")
    return sec * 1_000_000_000 + nsec, frame_id


def _stamp(message: Any) -> tuple[int, str]:
    header = getattr(message, "header", None)
    stamp = getattr(header, "stamp", None)
    if stamp is None:
        return 0, ""
    return int(stamp.sec) * 1_000_000_000 + int(stamp.nanosec), str(getattr(header, "frame_id", ""))


def read_recording(
    paths: Sequence[str | Path] | str | Path,
    *,
    topics: Sequence[str] | None = None,
    decode: bool = True,
    on_open: Callable[[RecordingInfo], None] | None = None,
) -> Iterator[RecordedMessage | SkippedTopic]:
    """Yield the messages of one or more recordings in log-time order.

    Args:
        paths: rosbag2 directories, bare ``.db3``/``.mcap`` files or ROS 1 ``.bag`` files.
        topics: Only these topics (default: all).
        decode: Deserialize every message (validates it and fills ``message``). With False,
            rosbag2 messages are passed through as CDR and only the first message of each topic
            is fully decoded; the header stamp and frame_id are read from the CDR directly.
        on_open: Called once with the recordings' :class:`RecordingInfo` as soon as they are
            open (saves opening them a second time for :func:`recording_info`).

    Raises:
        RecordingError: A path is missing or is not a recording rosbags can open.
    """
    from rosbags.highlevel import AnyReader, AnyReaderError

    plist = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    for p in plist:
        if not p.exists():
            raise RecordingError(f"recording {str(p)!r} does not exist")
    try:
        reader = AnyReader(plist, default_typestore=typestore())
        reader.open()
    except (AnyReaderError, *_OPEN_ERRORS) as err:
        raise RecordingError(f"cannot open recording {', '.join(map(str, plist))}: {err!r}") from err
    try:
        if on_open is not None:
            on_open(_info_of(reader))
        conns = [c for c in reader.connections if topics is None or c.topic in topics]
        ros1 = reader.is2 is False
        store = reader.typestore  # the default store plus the definitions in the recording
        ros2 = typestore()
        usable = []
        names: dict[int, str] = {}
        for c in conns:
            norm = normalize_msgtype(c.msgtype)
            if c.msgtype in store.fielddefs:
                names[c.id] = c.msgtype
            elif norm in store.fielddefs:
                names[c.id] = norm
            else:
                yield SkippedTopic(
                    c.topic,
                    norm,
                    f"no message definition for {norm} in the recording or the ROS 2 Jazzy typestore",
                )
                continue
            usable.append(c)
        failed: set[str] = set()
        rebuild: set[int] = set()
        norms: dict[int, str] = {}
        direct: dict[int, bool] = {}  # ROS 1 topics converted bytes-to-bytes; value: header first
        compiled: dict[int, Ros1ToCdr] = {}  # of those, the ones with a single-pass converter
        probed: set[int] = set()
        checked: set[int] = set()
        header_first: dict[int, bool | None] = {}
        for conn, log_ns, raw in reader.messages(connections=usable):
            norm = norms.get(conn.id) or norms.setdefault(conn.id, normalize_msgtype(conn.msgtype))
            if conn.topic in failed:
                continue
            try:
                if ros1 and not decode and conn.id in direct:
                    # Checked on the first message of this topic: converting the ROS 1 bytes
                    # straight to ROS 2 CDR gives the same bytes as deserialize + serialize.
                    fast = compiled.get(conn.id)
                    try:
                        cdr = fast(raw) if fast is not None else bytes(ros2.ros1_to_cdr(raw, norm))
                    except (ValueError, struct.error):  # let rosbags name what is wrong
                        cdr = bytes(ros2.ros1_to_cdr(raw, norm))
                    stamp_ns, frame_id = _cdr_header(cdr) if direct[conn.id] else (0, "")
                    yield RecordedMessage(conn.topic, norm, int(log_ns), stamp_ns, frame_id, cdr, None)
                    continue
                if ros1:
                    # ROS 1 definitions differ (e.g. Header.seq): write CDR with the ROS 2 store
                    # when it knows the type, so ROS 2 readers decode it.
                    msg = reader.deserialize(raw, conn.msgtype)
                    if norm in ros2.fielddefs:
                        if conn.id in rebuild:
                            msg = _to_ros2(msg, norm, ros2)
                            cdr = bytes(ros2.serialize_cdr(msg, norm))
                        else:
                            try:
                                cdr = bytes(ros2.serialize_cdr(msg, norm))
                            except AttributeError:  # ROS 1 field names differ (CameraInfo D, K, R, P)
                                rebuild.add(conn.id)  # once per topic, not once per message
                                msg = _to_ros2(msg, norm, ros2)
                                cdr = bytes(ros2.serialize_cdr(msg, norm))
                    else:
                        cdr = bytes(store.serialize_cdr(msg, names[conn.id]))
                    if not decode and conn.id not in probed and norm in ros2.fielddefs:
                        probed.add(conn.id)
                        try:
                            same = bytes(ros2.ros1_to_cdr(raw, norm)) == cdr
                        except Exception:  # rosbags raises assorted errors; keep the slow path
                            same = False
                        if same:
                            direct[conn.id] = bool(_has_header_first(ros2, norm))
                            fast = compile_ros1_to_cdr(ros2, norm)
                            try:  # byte-identical to rosbags, or not used
                                if fast is not None and fast(raw) == cdr:
                                    compiled[conn.id] = fast
                            except (ValueError, struct.error):
                                pass
                elif not decode and conn.id in checked and header_first.get(conn.id) is not None:
                    # checked on the first message of the topic: pass the CDR through
                    cdr = bytes(raw)
                    stamp_ns, frame_id = _cdr_header(cdr) if header_first[conn.id] else (0, "")
                    yield RecordedMessage(conn.topic, norm, int(log_ns), stamp_ns, frame_id, cdr, None)
                    continue
                else:
                    msg = store.deserialize_cdr(raw, names[conn.id])
                    cdr = bytes(raw)
                    if conn.id not in checked:
                        checked.add(conn.id)
                        header_first[conn.id] = _has_header_first(store, names[conn.id])
            except Exception as err:  # rosbags raises assorted errors on bad data
                failed.add(conn.topic)
                yield SkippedTopic(conn.topic, norm, f"cannot decode: {type(err).__name__}: {err}")
                continue
            stamp_ns, frame_id = _stamp(msg)
            yield RecordedMessage(conn.topic, norm, int(log_ns), stamp_ns, frame_id, cdr, msg)
    finally:
        reader.close()


def topic_to_stream(topic: str) -> str:
    """Default stream name of a ROS topic: ``/camera/image_raw`` → ``camera/image_raw``
    (characters a stream name cannot hold become ``_``)."""
    import re

    name = re.sub(r"[^A-Za-z0-9_\-/]", "_", topic.strip("/"))
    name = re.sub(r"/+", "/", name)
    return name or "root"


_MODALITIES = {
    "sensor_msgs/msg/PointCloud2": "lidar",
    "sensor_msgs/msg/Image": "camera",
    "sensor_msgs/msg/CompressedImage": "camera",
    "sensor_msgs/msg/NavSatFix": "gps",
    "sensor_msgs/msg/Imu": "imu",
    "sensor_msgs/msg/LaserScan": "laser_scan",
    "nav_msgs/msg/Odometry": "odometry",
}


def modality_of(msgtype: str) -> str:
    """The modality name a ROS type maps to (``other`` if unknown)."""
    return _MODALITIES.get(msgtype, "other")


@dataclass(frozen=True, slots=True)
class RecordingInfo:
    """Extent of one or more recordings (log time, ns)."""

    start_ns: int
    end_ns: int
    message_count: int
    topics: dict[str, str]
    counts: dict[str, int]

    @property
    def duration_s(self) -> float:
        """Log-time span in seconds."""
        return (self.end_ns - self.start_ns) / 1e9


def _info_of(r: Any) -> RecordingInfo:
    counts: dict[str, int] = {}
    for c in r.connections:
        counts[c.topic] = counts.get(c.topic, 0) + int(c.msgcount)
    return RecordingInfo(
        int(r.start_time),
        int(r.end_time),
        int(r.message_count),
        {c.topic: normalize_msgtype(c.msgtype) for c in r.connections},
        counts,
    )


def recording_info(paths: Sequence[str | Path] | str | Path) -> RecordingInfo:
    """Start, end, message count and topic types of recordings, from their indexes.

    Raises:
        RecordingError: A path is missing or cannot be opened.
    """
    from rosbags.highlevel import AnyReader, AnyReaderError

    plist = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    for p in plist:
        if not p.exists():
            raise RecordingError(f"recording {str(p)!r} does not exist")
    try:
        with AnyReader(plist, default_typestore=typestore()) as r:
            return _info_of(r)
    except (AnyReaderError, *_OPEN_ERRORS) as err:
        raise RecordingError(f"cannot open recording {', '.join(map(str, plist))}: {err!r}") from err
