"""Fused frames as message_filters-style sets: one message per subscribed stream, or a reason why
a frame gives no set. Transport-free; :mod:`embodied_bus.ros.message_filters` feeds it frames
from the bus and hands the sets to rclpy callbacks."""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from embodied_bus.fusion.frame import Member, MultiModalFrame
from embodied_bus.model.sample import Sample

__all__ = ["DropReason", "DroppedSet", "FrameSets", "MemberSet"]

#: Reference stamps remembered to drop a frame seen twice (scale-out workers may both publish a
#: frame handed over while one of them died).
RECENT_FRAMES = 512


class DropReason(enum.Enum):
    """Why a fused frame gave no set."""

    #: A subscribed stream has no member in the frame (the sensor was silent or given up).
    MISSING = "missing"
    #: The members' stamps span more than the slop.
    SLOP = "slop"
    #: The callback fell more than ``queue_size`` sets behind; the oldest set was let go.
    QUEUE_FULL = "queue_full"
    #: Frames lost on the way (a gap in the frame stream's sequence, or a full buffer).
    LOST = "lost"


@dataclass(frozen=True, slots=True)
class DroppedSet:
    """A frame (or, for :attr:`DropReason.LOST`, ``count`` frames) that gave no set.

    Attributes:
        reason: Why.
        reference_stamp_ns: The frame's reference stamp (None where the frames were lost).
        detail: What exactly, for a log line, e.g. ``"camera/front"`` or ``"span 61.2 ms"``.
        count: Frames this stands for.
    """

    reason: DropReason
    reference_stamp_ns: int | None
    detail: str
    count: int = 1


@dataclass(frozen=True, slots=True)
class MemberSet:
    """One message per subscribed stream, in the subscribers' order.

    Attributes:
        reference_stamp_ns: The frame's reference stamp.
        samples: The member chosen for each stream.
        span_ns: Latest minus earliest stamp of the set.
    """

    reference_stamp_ns: int
    samples: tuple[Sample, ...]
    span_ns: int


def _nearest(members: Sequence[Member], stamp_ns: int) -> Member:
    """The member stamped nearest ``stamp_ns`` (the earlier one on a tie)."""
    return min(members, key=lambda m: (abs(m.stamp_ns - stamp_ns), m.stamp_ns))


class FrameSets:
    """Turns fused frames into sets for ``streams``.

    A stream with several members in a frame (an ``all`` pick) gives the one nearest the frame's
    reference stamp. A set whose stamps span more than ``slop_ns`` is dropped, as
    message_filters' ApproximateTime would never form it.

    Args:
        streams: Bus streams of the set, in callback order.
        slop_ns: Largest span of a set's stamps, ns (0: exact match, as TimeSynchronizer).
    """

    def __init__(self, streams: Sequence[str], slop_ns: int) -> None:
        if not streams:
            raise ValueError("a synchronizer needs at least one subscriber")
        if len(set(streams)) != len(streams):
            raise ValueError(f"a stream may be subscribed once per synchronizer, got {list(streams)}")
        if slop_ns < 0:
            raise ValueError(f"slop must be >= 0, got {slop_ns / 1e9} s")
        self.streams = tuple(streams)
        self.slop_ns = slop_ns
        self._seen: OrderedDict[int, None] = OrderedDict()

    def take(self, frame: MultiModalFrame) -> MemberSet | DroppedSet | None:
        """The frame's set, why it has none, or None for a frame already taken."""
        ref = frame.reference_stamp_ns
        if ref in self._seen:
            return None
        self._seen[ref] = None
        if len(self._seen) > RECENT_FRAMES:
            self._seen.popitem(last=False)
        missing = [s for s in self.streams if not frame.members.get(s)]
        if missing:
            return DroppedSet(DropReason.MISSING, ref, ", ".join(missing))
        chosen = [_nearest(frame.members[s], ref) for s in self.streams]
        stamps = [m.stamp_ns for m in chosen]
        span = max(stamps) - min(stamps)
        if span > self.slop_ns:
            return DroppedSet(
                DropReason.SLOP, ref, f"span {span / 1e6:.1f} ms > slop {self.slop_ns / 1e6:g} ms"
            )
        return MemberSet(ref, tuple(m.sample for m in chosen), span)
