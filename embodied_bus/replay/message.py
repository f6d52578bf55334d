"""What reading a recording yields: messages, skipped topics, the recordings' extent."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from embodied_bus.errors import EmbodiedBusError
from embodied_bus.rosmsg.conversions import typestore

__all__ = ["RecordedMessage", "RecordingError", "RecordingInfo", "SkippedTopic"]


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
