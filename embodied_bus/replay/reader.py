"""Read recordings through rosbags: every message as CDR with its log time and header stamp.

Types are normalized (``sensor_msgs/Image`` → ``sensor_msgs/msg/Image``, as written by ROS 2
Dashing). A topic whose type has no definition (neither in the file nor in the typestore) is
reported once as :class:`SkippedTopic` and never raises; nor does a topic whose messages cannot
be decoded (reported once, with the reason, and skipped from then on).
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from embodied_bus.replay.message import RecordedMessage, RecordingError, RecordingInfo, SkippedTopic
from embodied_bus.replay.topics import Source, Topic, TopicDecoder, first_message
from embodied_bus.rosmsg.conversions import typestore
from embodied_bus.rosmsg.types import modality_of, normalize_msgtype

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


def _open(paths: Sequence[str | Path] | str | Path) -> Any:
    """An open rosbags ``AnyReader`` of the recordings.

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
    return reader


def _topics(reader: Any, topics: Sequence[str] | None) -> Iterator[Topic | SkippedTopic]:
    """The connections to read, by id, with the type name the recording's store knows them by;
    a :class:`SkippedTopic` for each whose type has no definition."""
    store = reader.typestore
    for c in reader.connections:
        if topics is not None and c.topic not in topics:
            continue
        norm = normalize_msgtype(c.msgtype)
        if c.msgtype in store.fielddefs:
            yield Topic(c.topic, norm, c.msgtype, c)
        elif norm in store.fielddefs:
            yield Topic(c.topic, norm, norm, c)
        else:
            reason = f"no message definition for {norm} in the recording or the ROS 2 Jazzy typestore"
            yield SkippedTopic(c.topic, norm, reason)


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
            only the first message of each topic is fully decoded; the rest are passed through
            as CDR (ROS 1: converted straight to CDR) with the header read from the bytes.
        on_open: Called once with the recordings' :class:`RecordingInfo` as soon as they are
            open (saves opening them a second time for :func:`recording_info`).

    Raises:
        RecordingError: A path is missing or is not a recording rosbags can open.
    """
    reader = _open(paths)
    try:
        if on_open is not None:
            on_open(_info_of(reader))
        by_id: dict[int, Topic] = {}
        for t in _topics(reader, topics):
            if isinstance(t, SkippedTopic):
                yield t
            else:
                by_id[t.connection.id] = t
        src = Source(reader, reader.typestore, typestore(), reader.is2 is False, decode)
        decoders: dict[int, TopicDecoder] = {}
        failed: set[str] = set()
        conns = [t.connection for t in by_id.values()]
        for conn, log_ns, raw in reader.messages(connections=conns):
            t = by_id[conn.id]
            if t.topic in failed:
                continue
            try:
                decoder = decoders.get(conn.id)
                if decoder is None:
                    message, decoders[conn.id] = first_message(src, t, raw, int(log_ns))
                else:
                    message = decoder(raw, int(log_ns))
            except Exception as err:  # rosbags raises assorted errors on bad data
                failed.add(t.topic)
                yield SkippedTopic(t.topic, t.msgtype, f"cannot decode: {type(err).__name__}: {err}")
                continue
            yield message
    finally:
        reader.close()


def topic_to_stream(topic: str) -> str:
    """Default stream name of a ROS topic: ``/camera/image_raw`` → ``camera/image_raw``
    (characters a stream name cannot hold become ``_``)."""
    name = re.sub(r"[^A-Za-z0-9_\-/]", "_", topic.strip("/"))
    name = re.sub(r"/+", "/", name)
    return name or "root"


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
    reader = _open(paths)
    try:
        return _info_of(reader)
    finally:
        reader.close()
