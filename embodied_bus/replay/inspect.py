"""What is in a recording, as ``ros2 bag info`` prints it, plus what a replay needs to know:
where each topic's stamps come from, how far they lag the log time, gaps and stamps that go
backwards. One pass over the messages (CDR passed through, headers read from the bytes)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from embodied_bus.replay.message import RecordedMessage, RecordingInfo
from embodied_bus.replay.reader import read_recording
from embodied_bus.replay.topics import header_first
from embodied_bus.rosmsg.conversions import typestore

__all__ = ["GAP_FACTOR", "RecordingReport", "TopicReport", "inspect_recording", "storage_of"]

#: An interval between two messages of a topic (log time) longer than this many times its mean
#: interval is a gap.
GAP_FACTOR = 3.0


@dataclass(frozen=True, slots=True)
class TopicReport:
    """One topic of a recording.

    Attributes:
        topic: ROS topic.
        msgtype: ``pkg/msg/Type``.
        count: Messages.
        rate_hz: Mean rate over the topic's own span (None with fewer than two messages).
        serialization: ``cdr`` (rosbag2) or ``ros1`` (converted to CDR on replay).
        stamps: ``header`` (every message has a header stamp), ``log time`` (the type has no
            header: replay stamps with the log time), ``zero (log time)`` (every header stamp is
            zero: the log time, flagged), ``mixed`` (some are zero: those fall back, flagged).
        zero_stamps: Messages with a header but a zero stamp.
        stamp_lag_p50_ms: Median of log time minus header stamp (None without header stamps).
        out_of_order: Header stamps earlier than the topic's previous one.
        gaps: Intervals (log time) longer than :data:`GAP_FACTOR` times the mean interval.
        largest_gap_s: The longest interval between two messages (None with fewer than two).
        skipped: Why the topic cannot be replayed (its type has no definition), else None.
    """

    topic: str
    msgtype: str
    count: int
    rate_hz: float | None = None
    serialization: str = "cdr"
    stamps: str = "log time"
    zero_stamps: int = 0
    stamp_lag_p50_ms: float | None = None
    out_of_order: int = 0
    gaps: int = 0
    largest_gap_s: float | None = None
    skipped: str | None = None


@dataclass(frozen=True, slots=True)
class RecordingReport:
    """A recording (one or more files read as one)."""

    paths: list[str]
    storage: str
    start_ns: int
    end_ns: int
    message_count: int
    topics: list[TopicReport] = field(default_factory=list)

    @property
    def duration_s(self) -> float:
        """Log-time span, seconds."""
        return (self.end_ns - self.start_ns) / 1e9

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data."""
        out = asdict(self)
        out["duration_s"] = round(self.duration_s, 6)
        return out


def storage_of(path: str | Path) -> str:
    """``ROS 1 bag``, ``rosbag2 (mcap)`` or ``rosbag2 (sqlite3)``, from the file or folder."""
    p = Path(path)
    names = [p.name] if p.is_file() else [c.name for c in p.iterdir()] if p.is_dir() else [p.name]
    if any(n.endswith(".bag") for n in names):
        return "ROS 1 bag"
    if any(n.endswith(".mcap") for n in names):
        return "rosbag2 (mcap)"
    return "rosbag2 (sqlite3)"


class _Topic:
    """What one pass learns of a topic."""

    def __init__(self, msgtype: str) -> None:
        store = typestore()
        self.has_header = msgtype in store.fielddefs and header_first(store, msgtype) is not False
        self.log_ns: list[int] = []
        self.lags_ns: list[int] = []
        self.with_header = 0
        self.zero = 0
        self.backwards = 0
        self.last_stamp = 0

    def add(self, m: RecordedMessage) -> None:
        self.log_ns.append(m.log_time_ns)
        if m.stamp_ns:
            self.with_header += 1
            self.lags_ns.append(m.log_time_ns - m.stamp_ns)
            if m.stamp_ns < self.last_stamp:
                self.backwards += 1
            self.last_stamp = m.stamp_ns
        elif self.has_header:
            self.zero += 1

    def report(self, topic: str, msgtype: str, serialization: str) -> TopicReport:
        n = len(self.log_ns)
        steps = [b - a for a, b in zip(self.log_ns, self.log_ns[1:], strict=False)]
        mean = sum(steps) / len(steps) if steps else 0
        span_s = (self.log_ns[-1] - self.log_ns[0]) / 1e9 if n > 1 else 0.0
        if self.with_header == n:
            stamps = "header"
        elif self.with_header:
            stamps = "mixed"
        else:
            stamps = "zero (log time)" if self.zero else "log time"
        return TopicReport(
            topic,
            msgtype,
            n,
            rate_hz=round((n - 1) / span_s, 3) if span_s > 0 else None,
            serialization=serialization,
            stamps=stamps,
            zero_stamps=self.zero,
            stamp_lag_p50_ms=round(statistics.median(self.lags_ns) / 1e6, 3) if self.lags_ns else None,
            out_of_order=self.backwards,
            gaps=sum(1 for s in steps if mean > 0 and s > GAP_FACTOR * mean),
            largest_gap_s=round(max(steps) / 1e9, 6) if steps else None,
        )


def inspect_recording(
    paths: Sequence[str | Path] | str | Path, *, progress: Callable[[int], None] | None = None
) -> RecordingReport:
    """Read every message of the recordings once and report on each topic.

    Args:
        progress: Called with the messages read so far, every 10 000.

    Raises:
        RecordingError: A path is missing or is not a recording.
    """
    plist = [Path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    storage = ", ".join(sorted({storage_of(p) for p in plist}))
    serialization = "ros1" if storage == "ROS 1 bag" else "cdr"
    opened: list[RecordingInfo] = []
    seen: dict[str, _Topic] = {}
    types: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for i, m in enumerate(read_recording(plist, decode=False, on_open=opened.append)):
        if isinstance(m, RecordedMessage):
            if m.topic not in seen:
                seen[m.topic] = _Topic(m.msgtype)
            seen[m.topic].add(m)
            types[m.topic] = m.msgtype
        else:
            skipped[m.topic] = m.reason
        if progress is not None and i and i % 10_000 == 0:
            progress(i)
    info = opened[0]
    topics = []
    for topic in sorted(info.topics):
        if topic in seen:
            topics.append(seen[topic].report(topic, types[topic], serialization))
        else:
            reason = skipped.get(topic, "no messages")
            topics.append(TopicReport(topic, info.topics[topic], info.counts.get(topic, 0), skipped=reason))
    return RecordingReport(
        [str(p) for p in plist], storage, info.start_ns, info.end_ns, info.message_count, topics
    )
