"""Deciding a frame: each stream's pick relative to its anchor, and when it can no longer change.

A pick is decided once its stream has delivered a sample stamped past everything the pick could
still take (streams arrive in stamp order), or when the frame is forced out by the lateness
bound. Used by :class:`~embodied_bus.fusion.assembler.Assembler`; the same rules, written
offline, are :func:`~embodied_bus.fusion.offline.offline_frames`.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from embodied_bus.fusion.spec import FusionSpec, Pick, StreamSpec, Window
from embodied_bus.model.sample import Sample

__all__ = ["Anchor", "Decision", "Entry", "Picker", "StreamState", "window_hi"]


@dataclass(slots=True)
class Entry:
    """A buffered sample with its stamp (clock offset applied, receive time if it had none)."""

    stamp_ns: int
    sample: Sample
    fallback: bool


@dataclass(slots=True)
class Anchor:
    """What a frame is made around: a reference sample, or where a lost one was due.

    Attributes:
        stamp_ns: The reference stamp.
        entry: The reference sample (None: the reference lost it).
        period_ns: The reference's cadence here (for windows that reach past a segment).
        first: Starts a segment (nothing before it: the stream started or jumped).
        last: Ends a segment (nothing after it: the stream jumped or ended).
        waited_on: The stream whose pick held this frame back last.
        deadline_ns: Event time past which the frame is forced out.
    """

    stamp_ns: int
    entry: Entry | None
    period_ns: int
    first: bool
    last: bool = False
    waited_on: str | None = None
    #: The event time at which the frame is forced out (set when the anchor is added).
    deadline_ns: int = 0
    #: The progress its blocking stream must reach before its pick can be decided (None:
    #: unknown, re-decide on every sample of that stream).
    need_ns: int | None = None
    #: The picks decided so far (final: a decided pick never changes), the windows used and
    #: the interpolation weights.
    picked: dict[str, list[Entry]] = field(default_factory=dict)
    windows: dict[str, tuple[int, int]] = field(default_factory=dict)
    interpolation: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class Decision:
    """A frame decided: the entries of each stream, the windows used, and why it went out."""

    picked: dict[str, list[Entry]]
    windows: dict[str, tuple[int, int]]
    interpolation: dict[str, float]
    #: Streams picked as one sample (nearest, hold_last, interpolate), for telling late data.
    single: frozenset[str]
    forced: bool
    waited_on: str | None


class SeenSeqs:
    """Which (publisher, seq) pairs of a stream were seen, in O(1) for samples in sequence
    order: per publisher the highest seq and the lower ones not yet seen (gaps, bounded)."""

    __slots__ = ("_gaps", "_top")

    #: Gaps remembered per publisher; beyond, the oldest are forgotten (a sample that fills
    #: one of them later is then taken for a duplicate).
    MAX_GAPS = 4096

    def __init__(self) -> None:
        self._top: dict[int, int] = {}
        self._gaps: dict[int, set[int]] = {}

    def first_time(self, publisher_id: int, seq: int) -> bool:
        """Record the pair; False if it was seen before."""
        top = self._top.get(publisher_id)
        if top is None or seq > top:
            if top is not None and seq > top + 1:
                gaps = self._gaps.setdefault(publisher_id, set())
                gaps.update(range(max(top + 1, seq - self.MAX_GAPS), seq))
                if len(gaps) > self.MAX_GAPS:
                    floor = seq - self.MAX_GAPS
                    gaps.difference_update([g for g in gaps if g < floor])
            self._top[publisher_id] = seq
            return True
        missing = self._gaps.get(publisher_id)
        if missing and seq in missing:
            missing.discard(seq)
            return True
        return False

    def clear(self) -> None:
        self._top.clear()
        self._gaps.clear()


class StreamState:
    """One input stream's buffered samples (in stamp order) and progress."""

    __slots__ = (
        "entries",
        "first_floor_ns",
        "last_arrival_ns",
        "progress_ns",
        "reach_after_ns",
        "reach_before_ns",
        "seen",
        "spec",
        "stamps",
        "window_floor_ns",
    )

    def __init__(self, spec: StreamSpec, reach_before_ns: int = 0, reach_after_ns: int = 0) -> None:
        self.spec = spec
        self.entries: list[Entry] = []
        self.stamps: list[int] = []
        #: The furthest stamp delivered: nothing stamped before it is expected any more.
        self.progress_ns: int | None = None
        #: When its last sample came, on the assembler's flowing clock (how long it is silent).
        self.last_arrival_ns = -(2**62)
        #: Window streams: the end of the last window out (samples before it are late) and the
        #: start of the segment's first window (samples before it are in no frame).
        self.window_floor_ns: int | None = None
        self.first_floor_ns: int | None = None
        self.reach_before_ns = reach_before_ns
        self.reach_after_ns = reach_after_ns
        self.seen = SeenSeqs()

    def add(self, e: Entry) -> None:
        """Buffer an entry and move the stream's progress."""
        stamp = e.stamp_ns
        if self.progress_ns is not None and stamp < self.progress_ns:
            self.insert(e)  # out of order
            return
        self.entries.append(e)
        self.stamps.append(stamp)
        self.progress_ns = stamp

    def insert(self, e: Entry) -> None:
        i = bisect.bisect_right(self.stamps, e.stamp_ns)
        self.stamps.insert(i, e.stamp_ns)
        self.entries.insert(i, e)

    def between(self, lo: int, hi: int) -> list[Entry]:
        """Entries with lo <= stamp < hi."""
        stamps = self.stamps
        return self.entries[bisect.bisect_left(stamps, lo) : bisect.bisect_left(stamps, hi)]

    def prune(self, before_ns: int) -> None:
        i = bisect.bisect_left(self.stamps, before_ns)
        if i:
            del self.stamps[:i]
            del self.entries[:i]

    def reset(self) -> None:
        self.entries.clear()
        self.stamps.clear()
        self.progress_ns = None
        self.window_floor_ns = None
        self.first_floor_ns = None


def window_hi(a: Anchor, window: Window) -> int:
    """The end (exclusive) of the window an anchor gives a stream: just past the anchor
    (before), or a learned period (after) or half of one (around) past it, so a frame never
    waits for the next reference sample."""
    t = a.stamp_ns
    if window is Window.BEFORE:
        return t + 1
    return t + (a.period_ns if window is Window.AFTER else a.period_ns // 2)


def _nearest_key(t: int) -> Callable[[Entry], tuple[int, int]]:
    """Sort key of the sample nearest to ``t`` (the earlier of two equally near)."""
    return lambda e: (abs(e.stamp_ns - t), e.stamp_ns)


class Picker:
    """The picks of a spec: what each stream gives a frame, and whether that is final."""

    def __init__(self, spec: FusionSpec) -> None:
        self.spec = spec
        self._ref_name = spec.reference.name
        reach = [0]
        for s in spec.streams:
            if s.pick in (Pick.NEAREST, Pick.INTERPOLATE):
                reach.append(spec.skew_ns(s))
            elif s.pick is Pick.HOLD_LAST:
                reach.append(spec.age_ns(s))
        #: How far before an anchor a single-sample pick may reach (ns).
        self.reach_before_ns = max(reach)
        self._static_after_ns = max(
            [1] + [spec.skew_ns(s) for s in spec.streams if s.pick in (Pick.NEAREST, Pick.INTERPOLATE)]
        )
        self._windows = [s.window for s in spec.streams if s.window is not None]
        self._single_names = frozenset(
            s.name for s in spec.streams if s.pick in (Pick.NEAREST, Pick.HOLD_LAST, Pick.INTERPOLATE)
        )

    def stream(self, spec: StreamSpec) -> StreamState:
        """A fresh state for one of the spec's streams, with its reach."""
        if spec.pick in (Pick.NEAREST, Pick.INTERPOLATE):
            skew = self.spec.skew_ns(spec)
            return StreamState(spec, skew, skew)
        if spec.pick is Pick.HOLD_LAST:
            return StreamState(spec, self.spec.age_ns(spec), 0)
        return StreamState(spec)

    def deadline_ns(self, a: Anchor) -> int:
        """The furthest stamp any pick of the frame may need (its lateness bound starts here)."""
        reach = self._static_after_ns
        for w in self._windows:
            hi = window_hi(a, w)
            if hi - a.stamp_ns > reach:
                reach = hi - a.stamp_ns
        return a.stamp_ns + reach

    @staticmethod
    def _window_lo(st: StreamState, a: Anchor, window: Window) -> int:
        if st.window_floor_ns is not None and not a.first:
            return st.window_floor_ns
        t = a.stamp_ns
        if window is Window.BEFORE:
            return t - a.period_ns + 1
        return t if window is Window.AFTER else t - a.period_ns // 2

    def decide(
        self,
        a: Anchor,
        streams: Iterable[StreamState],
        top_ns: int | None,
        now_ns: int,
        forced: bool,
        held: frozenset[str] = frozenset(),
    ) -> Decision | StreamState:
        """The frame of anchor ``a`` (``top_ns``: the event time; ``now_ns``: the assembler's
        flowing clock of receive times), or the stream it waits for. A stream in ``held`` (its
        subscription reconnects) is waited for past its ``max_delay``."""
        picked, windows, interp = a.picked, a.windows, a.interpolation
        t = a.stamp_ns
        for st in streams:
            spec = st.spec
            if spec.name in picked:
                continue
            progress = st.progress_ns if st.progress_ns is not None else -(2**62)
            delay = spec.max_delay_ns
            if (
                delay is not None
                and top_ns is not None
                and spec.name not in held
                and st.progress_ns is not None  # one that never delivered: the lateness bound
                and top_ns - delay > progress
                and now_ns - st.last_arrival_ns >= delay  # silent, not only behind
            ):
                progress = top_ns - delay
            window = spec.window
            if window is not None:
                hi = window_hi(a, window)
                if not (forced or progress >= hi):
                    a.waited_on = spec.name
                    a.need_ns = hi
                    return st
                lo = self._window_lo(st, a, window)
                windows[spec.name] = (lo, hi)
                got = st.between(lo, hi)
                picked[spec.name] = got[-1:] if spec.pick is Pick.LATEST else got
                continue
            entries = self._single(st, t, progress, forced, interp)
            if entries is None:
                a.waited_on = spec.name
                a.need_ns = t + 1 if spec.pick is Pick.HOLD_LAST else None
                return st
            picked[spec.name] = entries
        return Decision(picked, windows, interp, self._single_names, forced, a.waited_on or self._ref_name)

    def _single(
        self, st: StreamState, t: int, progress: int, forced: bool, interp: dict[str, float]
    ) -> list[Entry] | None:
        """A nearest / hold_last / interpolate pick (None: undecided)."""
        spec = st.spec
        pick = spec.pick
        if pick is Pick.NEAREST:
            skew = st.reach_after_ns
            cands = st.between(t - skew, t + skew + 1)
            if cands:
                best = cands[0] if len(cands) == 1 else min(cands, key=_nearest_key(t))
                if forced or progress >= t + abs(best.stamp_ns - t):
                    return [best]
                return None
            return [] if forced or progress >= t + skew else None
        if pick is Pick.HOLD_LAST:
            if not (forced or progress > t):
                return None
            return st.between(t - st.reach_before_ns, t + 1)[-1:]
        skew = st.reach_after_ns  # INTERPOLATE
        after = st.between(t + 1, t + skew + 1)
        if not after and not (forced or progress >= t + skew):
            return None
        before = st.between(t - skew, t + 1)
        b0 = before[-1] if before else None
        a0 = after[0] if after else None
        if b0 is not None and a0 is not None:
            span = a0.stamp_ns - b0.stamp_ns
            interp[spec.name] = (t - b0.stamp_ns) / span if span else 0.0
            return [b0, a0]
        return [e for e in (b0, a0) if e is not None]

    @staticmethod
    def would_take(st: StreamState, t: int, taken_ns: int | None, stamp: int) -> bool:
        """Whether a frame anchored at ``t`` that took ``taken_ns`` (None: nothing) of this
        single-pick stream would have taken a sample stamped ``stamp`` instead."""
        pick = st.spec.pick
        if pick is Pick.HOLD_LAST:
            return t - st.reach_before_ns <= stamp <= t and (taken_ns is None or stamp > taken_ns)
        if abs(stamp - t) > st.reach_after_ns:
            return False
        if taken_ns is None:
            return True
        if pick is Pick.NEAREST:
            return (abs(stamp - t), stamp) < (abs(taken_ns - t), taken_ns)
        return False
