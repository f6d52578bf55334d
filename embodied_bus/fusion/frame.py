"""MultiModalFrame: what a fusion worker emits per reference sample."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from embodied_bus.model.sample import Sample

__all__ = ["Member", "MultiModalFrame"]


@dataclass(frozen=True, slots=True)
class Member:
    """One sample taken into a frame.

    Attributes:
        sample: The sample as received (payload untouched, zero-copy).
        stamp_ns: Its stamp after clock-offset correction (and receive-time fallback).
        skew_ns: ``stamp_ns`` minus the frame's reference stamp (its offset from the anchor).
        stamp_fallback: Its header stamp was 0; ``stamp_ns`` is a receive/publish time.
    """

    sample: Sample
    stamp_ns: int
    skew_ns: int
    stamp_fallback: bool = False


_new = object.__new__
_slots: dict[str, Any] = dict(vars(Member))  # the slot descriptors
_set_sample, _set_stamp, _set_skew, _set_fallback = (
    _slots[name].__set__ for name in ("sample", "stamp_ns", "skew_ns", "stamp_fallback")
)


def new_member(sample: Sample, stamp_ns: int, skew_ns: int, stamp_fallback: bool) -> Member:
    """``Member(sample, stamp_ns, skew_ns, stamp_fallback)``, about 3x faster: a frozen
    dataclass sets each field through ``object.__setattr__``; this sets the slots directly
    (the assembler builds one per sample it puts in a frame)."""
    m: Member = _new(Member)
    _set_sample(m, sample)
    _set_stamp(m, stamp_ns)
    _set_skew(m, skew_ns)
    _set_fallback(m, stamp_fallback)
    return m


@dataclass(frozen=True, slots=True)
class MultiModalFrame:
    """All modalities around one reference sample.

    Attributes:
        bucket: Bucket of the reference stamp (the routing key; a bucket holding two reference
            samples has two frames, one holding none has none).
        start_ns: First nanosecond of the bucket.
        end_ns: First nanosecond after the bucket.
        reference_stamp_ns: Stamp of the reference sample (a lost one: where it was due); the
            frame's identity within its pipeline.
        members: Samples per stream, in stamp order (INTERPOLATE: the two bracketing samples).
        missing: Streams with nothing acceptable for this frame (the reference if it was lost).
        complete: Reference and every required stream present.
        late_count: Samples of this bucket that arrived after its frame (known so far).
        max_skew_ns: Largest |member stamp - reference stamp| over the members besides the
            reference (None: there are none).
        interpolation: Per INTERPOLATE stream, the weight of the later sample at the reference
            stamp (``value = (1 - a) * before + a * after``).
        forced: Emitted by the lateness bound (a stream given up) rather than on completion.
        pane: 0 for the frame, 1.. for late panes carrying samples that arrived after it.
        last_arrival_ns: Latest receive time over members (for added-latency metrics).
        waited_on: The stream whose sample the frame waited for last (the reference: its own
            arrival, or the next reference sample where a window ends there).
    """

    bucket: int
    start_ns: int
    end_ns: int
    reference_stamp_ns: int
    members: dict[str, tuple[Member, ...]]
    missing: tuple[str, ...]
    complete: bool
    late_count: int = 0
    max_skew_ns: int | None = None
    interpolation: dict[str, float] = field(default_factory=dict)
    forced: bool = False
    pane: int = 0
    last_arrival_ns: int = 0
    waited_on: str | None = None

    def member(self, stream: str) -> Member | None:
        """The (first) member of a stream, or None if missing."""
        ms = self.members.get(stream)
        return ms[0] if ms else None
