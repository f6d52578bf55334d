"""The transport-free assembler: samples in, one MultiModalFrame per time bucket out.

Event-time semantics with a watermark per stream: after a stream delivered stamp ``t`` it is
assumed to send nothing older than ``t + lookahead * expected_period`` (its watermark), unless a
sample arrives out of order (then it is placed, or counted late if its bucket is gone). A
bucket is emitted the moment every stream's pick is decided; it is never held back to prove
optimality. A bucket is forced out when the furthest stamp seen on any stream passes its end plus
the lateness bound (a blacked-out stream cannot stall the pipeline). Memory is bounded by the time
horizon: samples older than the open buckets can still use are discarded.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from embodied_bus.fusion.events import AssemblerStats, DroppedBucket, Event, LateSample, StampJump
from embodied_bus.fusion.frame import Member, MultiModalFrame, new_member
from embodied_bus.fusion.spec import FusionSpec, Incomplete, Pick, Role, StreamSpec
from embodied_bus.model.header import HeaderFlags
from embodied_bus.model.sample import Sample

__all__ = [
    "Assembler",
    "AssemblerStats",
    "DroppedBucket",
    "Event",
    "LateSample",
    "StampJump",
]

#: Remembered (publisher, seq) pairs per stream for duplicate detection.
_SEEN_WINDOW = 4096
_STAMP_FALLBACK = int(HeaderFlags.STAMP_FALLBACK)


@dataclass(slots=True)
class _Entry:
    stamp_ns: int
    sample: Sample
    fallback: bool


@dataclass(slots=True)
class _Arrival:
    """A sample accepted by :meth:`Assembler._arrive`: its stream, entry and bucket, and the
    events its arrival caused (a clock jump)."""

    stream: _Stream
    entry: _Entry
    bucket: int
    events: list[Event]


class _Stream:
    __slots__ = (
        "clock_offset_ns",
        "entries",
        "last_stamp",
        "lookahead_ns",
        "seen",
        "seen_order",
        "spec",
        "stamps",
        "watermark",
    )

    def __init__(self, spec: StreamSpec) -> None:
        self.spec = spec
        self.clock_offset_ns = spec.clock_offset_ns
        self.entries: list[_Entry] = []
        self.stamps: list[int] = []
        self.last_stamp: int | None = None
        self.watermark: int | None = None
        self.lookahead_ns = int(spec.lookahead * spec.expected_period_ns)
        self.seen: set[tuple[int, int]] = set()
        self.seen_order: deque[tuple[int, int]] = deque()

    def insert(self, e: _Entry) -> None:
        i = bisect.bisect_right(self.stamps, e.stamp_ns)
        self.stamps.insert(i, e.stamp_ns)
        self.entries.insert(i, e)

    def between(self, lo: int, hi: int) -> list[_Entry]:
        """Entries with lo <= stamp < hi."""
        i = bisect.bisect_left(self.stamps, lo)
        j = bisect.bisect_left(self.stamps, hi)
        return self.entries[i:j]

    def prune(self, before_ns: int) -> None:
        i = bisect.bisect_left(self.stamps, before_ns)
        if i:
            del self.stamps[:i]
            del self.entries[:i]

    def reset(self) -> None:
        self.entries.clear()
        self.stamps.clear()
        self.last_stamp = None
        self.watermark = None


class Assembler:
    """Assembles MultiModalFrames from samples according to a :class:`FusionSpec`.

    Feed samples with :meth:`push`; each call returns the events it caused (frames, late
    samples, stamp jumps, dropped buckets). Deterministic: the same input sequence gives the
    same output. Not thread-safe: one assembler per worker task.
    """

    def __init__(self, spec: FusionSpec) -> None:
        self.spec = spec
        self.clock = spec.clock
        self._streams = {s.name: _Stream(s) for s in spec.streams}
        self._ref = self._streams[spec.reference.name]
        self._open: list[int] = []  # sorted open bucket ids
        self._open_set: set[int] = set()
        self._emitted_upto: int | None = None
        self._late_counts: dict[int, int] = {}
        self._event_time_ns: int | None = None
        #: Streams whose pick was decided (not forced) per recently emitted bucket.
        self._decided: dict[int, frozenset[str]] = {}
        self._all_names = frozenset(self._streams)
        self._horizon_ns = max(
            [spec.skew_ns(s) for s in spec.streams]
            + [spec.age_ns(s) for s in spec.streams if s.pick is Pick.HOLD_LAST]
        )
        self.stats = AssemblerStats(presence={s.name: 0 for s in spec.streams})
        #: (bucket, stream) whose undecided pick held back the oldest open bucket at the last
        #: decision: until that stream (or the reference) gets a sample, nothing else can decide it.
        self._blocker: tuple[int, _Stream] | None = None
        self._jump_ns = spec.jump_ns
        self._width_ns = self.clock.width_ns
        self._offset_ns = self.clock.offset_ns
        self._lateness_ns = spec.lateness_ns

    # ------------------------------------------------------------------ input
    def push(self, sample: Sample) -> list[Event]:
        """Add one sample; return the events it caused, in order."""
        arrival = self._arrive(sample)
        if arrival is None:
            return []
        self.stats.samples += 1
        st, entry, bucket, events = arrival.stream, arrival.entry, arrival.bucket, arrival.events
        stamp = entry.stamp_ns
        if self._emitted_upto is not None and bucket <= self._emitted_upto:
            decided = self._decided.get(bucket)
            if decided is None or st.spec.name not in decided or st.spec.pick in (Pick.ALL, Pick.LATEST):
                # Its bucket went out without a decision for this stream, or without this
                # sample that `all` / `latest` would have taken: late data.
                self.stats.late += 1
                self._late_counts[bucket] = self._late_counts.get(bucket, 0) + 1
                events.append(LateSample(sample, bucket, stamp))
                if self.spec.late_panes:
                    events.append(self._late_pane(bucket, entry))
            else:
                # On time, but its bucket was already decided without it (a nearer sample won).
                self.stats.unused += 1
            if stamp >= self._prune_floor():
                st.insert(entry)  # may still serve an open bucket (nearest / hold_last)
            if st.last_stamp is None or stamp > st.last_stamp:
                st.last_stamp = stamp
                st.watermark = max(st.watermark or stamp, stamp + st.lookahead_ns)
            return events
        self._keep(st, entry)
        if bucket not in self._open_set:
            self._open_set.add(bucket)
            bisect.insort(self._open, bucket)
        events.extend(self._emit_ready(st))
        return events

    def push_context(self, sample: Sample) -> list[Event]:
        """Add a sample of a bucket another worker assembles (Key_Shared scale-out).

        It serves only the picks of this assembler's buckets that reach past their edges
        (``nearest``, ``hold_last``, ``interpolate``), and moves its stream's watermark and the
        event time as any sample does; it never opens its own bucket and is never late here.
        """
        arrival = self._arrive(sample)
        if arrival is None:
            return []
        self.stats.context += 1
        st, entry, events = arrival.stream, arrival.entry, arrival.events
        if entry.stamp_ns >= self._prune_floor():
            self._keep(st, entry)
        events.extend(self._emit_ready(st))
        return events

    def _arrive(self, sample: Sample) -> _Arrival | None:
        """Stamp, de-duplicate and check a sample for clock jumps (None: not for this spec, or
        seen before)."""
        h = sample.header
        st = self._streams.get(h.stream)
        if st is None:
            self.stats.ignored += 1
            return None
        stats = self.stats
        events: list[Event] = []
        stamp = h.stamp_ns
        if stamp == 0:
            stamp = sample.receive_ns
            fallback = True
        else:
            fallback = (int(h.flags) & _STAMP_FALLBACK) != 0
        stamp += st.clock_offset_ns
        if fallback:
            stats.stamp_fallbacks += 1
        key = (h.publisher_id, h.seq)
        seen = st.seen
        if key in seen:
            stats.duplicates += 1
            return None
        seen.add(key)
        order = st.seen_order
        order.append(key)
        if len(order) > _SEEN_WINDOW:
            seen.discard(order.popleft())
        last = st.last_stamp
        if last is not None and (stamp - last > self._jump_ns or last - stamp > self._jump_ns):
            jump = StampJump(st.spec.name, last, stamp)
            self.stats.stamp_jumps += 1
            events.append(jump)
            if jump.backwards:
                # A clock reset (looping recording, rebooted sensor): close what is open and
                # restart from the new time base.
                if st is self._ref:
                    events.extend(self.flush())
                    for other in self._streams.values():
                        other.reset()
                    self._emitted_upto = None
                    self._event_time_ns = None
                else:
                    st.reset()
                self._blocker = None
        bucket = (stamp - self._offset_ns) // self._width_ns
        return _Arrival(st, _Entry(stamp, sample, fallback), bucket, events)

    def _keep(self, st: _Stream, entry: _Entry) -> None:
        """Buffer an on-time entry; move its stream's watermark and the event time."""
        stamp = entry.stamp_ns
        if st.last_stamp is not None and stamp < st.last_stamp:
            st.insert(entry)  # out of order within the window
        else:
            st.entries.append(entry)
            st.stamps.append(stamp)
            st.last_stamp = stamp
        if self._event_time_ns is None or stamp > self._event_time_ns:
            self._event_time_ns = stamp
        wm = stamp + st.lookahead_ns
        if st.watermark is None or wm > st.watermark:
            st.watermark = wm

    def advance(self, watermark_ns: int) -> list[Event]:
        """Declare that no stream will send stamps before ``watermark_ns`` (e.g. wall clock
        minus the largest expected latency), forcing out buckets whose lateness passed."""
        for st in self._streams.values():
            if st.watermark is None or st.watermark < watermark_ns:
                st.watermark = watermark_ns
        if self._event_time_ns is None or watermark_ns > self._event_time_ns:
            self._event_time_ns = watermark_ns
        return self._emit_ready()

    def flush(self) -> list[Event]:
        """Emit every open bucket now (end of stream, shutdown)."""
        events: list[Event] = []
        while self._open:
            events.extend(self._emit(self._open[0], forced=True))
        return events

    @property
    def event_time_ns(self) -> int | None:
        """The furthest stamp seen on any stream (None before the first sample)."""
        return self._event_time_ns

    @property
    def horizon_ns(self) -> int:
        """How far before or after a reference stamp a pick may reach (ns)."""
        return self._horizon_ns

    @property
    def emitted_upto(self) -> int | None:
        """The highest bucket emitted so far (None before the first)."""
        return self._emitted_upto

    def reset_open(self) -> None:
        """Forget open buckets and buffered samples, keeping what was emitted (used when a
        Key_Shared worker's slots change: unacknowledged samples are redelivered)."""
        for st in self._streams.values():
            st.reset()
            st.seen.clear()
            st.seen_order.clear()
        self._open.clear()
        self._open_set.clear()
        self._blocker = None

    @property
    def open_bucket_ids(self) -> frozenset[int]:
        """Ids of the open buckets."""
        return frozenset(self._open_set)

    @property
    def open_buckets(self) -> int:
        """Buckets waiting for data."""
        return len(self._open)

    @property
    def buffered_samples(self) -> int:
        """Samples held for open buckets (bounded by the time horizon)."""
        return sum(len(s.entries) for s in self._streams.values())

    # ------------------------------------------------------------------ decisions
    def _event_time(self) -> int | None:
        """The furthest stamp observed (or declared with :meth:`advance`); look-ahead excluded."""
        return self._event_time_ns

    def _emit_ready(self, changed: _Stream | None = None) -> list[Event]:
        """Emit the oldest buckets that are decided (or past the lateness bound).

        Args:
            changed: The only stream whose samples or watermark changed since the last call
                (None: any may have). A bucket held back by another stream's pick is not
                re-examined: its decision cannot have changed.
        """
        events: list[Event] = []
        while self._open:
            b = self._open[0]
            blk = self._blocker
            if (
                changed is None
                or blk is None
                or blk[0] != b
                or blk[1] is changed
                or changed is self._ref
                or blk[1].spec.max_delay_ns is not None  # moved by any stream's stamps
            ):
                decided = self._decide(b, forced=False)
                if decided is not None:
                    events.extend(self._finish(b, decided, forced=False))
                    continue
            top = self._event_time_ns
            if top is not None and top >= (b + 1) * self._width_ns + self._offset_ns + self._lateness_ns:
                events.extend(self._emit(b, forced=True))
                continue
            break
        return events

    def _emit(self, b: int, forced: bool) -> list[Event]:
        decided = self._decide(b, forced=forced)
        assert decided is not None
        return self._finish(b, decided, forced)

    def _watermark(self, st: _Stream, default: int) -> int:
        """The stream's watermark, moved up by the event time for a stream with ``max_delay``."""
        wm = st.watermark if st.watermark is not None else default
        delay = st.spec.max_delay_ns
        if delay is not None and self._event_time_ns is not None and self._event_time_ns - delay > wm:
            return self._event_time_ns - delay
        return wm

    def _reference(self, b: int, forced: bool) -> tuple[int, _Entry | None] | None:
        start, end = self.clock.start_ns(b), self.clock.end_ns(b)
        st = self._ref
        cands = st.between(start, end)
        wm = self._watermark(st, start - 1)
        if st.spec.pick is Pick.LATEST:
            if wm >= end or forced:
                return (cands[-1].stamp_ns, cands[-1]) if cands else ((start + end) // 2, None)
            return None
        centre = (start + end) // 2
        if cands:
            best = min(cands, key=lambda e: (abs(e.stamp_ns - centre), e.stamp_ns))
            if forced or wm >= centre + abs(best.stamp_ns - centre):
                return best.stamp_ns, best
            return None
        if forced or wm >= end:
            return centre, None
        return None

    def _pick(self, st: _Stream, b: int, r: int, forced: bool) -> tuple[list[_Entry], float | None] | None:
        """Entries of ``st`` for bucket ``b`` with reference ``r``; None if undecided."""
        spec = st.spec
        start, end = self.clock.start_ns(b), self.clock.end_ns(b)
        wm = self._watermark(st, -(2**62))
        pick = spec.pick
        if pick is Pick.NEAREST:
            skew = self.spec.skew_ns(spec)
            cands = st.between(r - skew, r + skew + 1)
            if cands:
                best = min(cands, key=lambda e: (abs(e.stamp_ns - r), e.stamp_ns))
                if forced or wm >= r + abs(best.stamp_ns - r):
                    return [best], None
                return None
            return ([], None) if forced or wm >= r + skew else None
        if pick in (Pick.LATEST, Pick.ALL):
            if not (forced or wm >= end or self._full(st, start, end)):
                return None
            cands = st.between(start, end)
            if pick is Pick.LATEST:
                return (cands[-1:], None)
            return list(cands), None
        if pick is Pick.HOLD_LAST:
            if not (forced or wm >= r):
                return None
            cands = st.between(r - self.spec.age_ns(spec), r + 1)
            return (cands[-1:], None)
        # INTERPOLATE
        skew = self.spec.skew_ns(spec)
        before = st.between(r - skew, r + 1)
        after = st.between(r + 1, r + skew + 1)
        if not after and not (forced or wm >= r + skew):
            return None
        b0 = before[-1] if before else None
        a0 = after[0] if after else None
        if b0 is not None and a0 is not None:
            span = a0.stamp_ns - b0.stamp_ns
            alpha = (r - b0.stamp_ns) / span if span else 0.0
            return [b0, a0], alpha
        one = b0 or a0
        return ([one], None) if one is not None else ([], None)

    @staticmethod
    def _full(st: _Stream, start_ns: int, end_ns: int) -> bool:
        """A periodic stream that already delivered as many samples as fit in the bucket
        (``ceil(width / expected period)``) has nothing more for it: decide now instead of
        waiting for its next sample (a sample that still comes is counted late, never lost).
        Off with ``complete_by_count: false`` or ``lookahead: 0``."""
        period = st.spec.expected_period_ns
        if not period or st.spec.lookahead <= 0 or not st.spec.complete_by_count:
            return False
        n = bisect.bisect_left(st.stamps, end_ns) - bisect.bisect_left(st.stamps, start_ns)
        return n >= -(-(end_ns - start_ns) // period)

    def _decide(self, b: int, forced: bool) -> tuple[int, dict[str, list[_Entry]], dict[str, float]] | None:
        ref = self._reference(b, forced)
        if ref is None:
            self._blocker = (b, self._ref)
            return None
        r, ref_entry = ref
        picked: dict[str, list[_Entry]] = {self._ref.spec.name: [ref_entry] if ref_entry else []}
        interp: dict[str, float] = {}
        for name, st in self._streams.items():
            if st is self._ref:
                continue
            got = self._pick(st, b, r, forced)
            if got is None:
                self._blocker = (b, st)
                return None
            picked[name] = got[0]
            if got[1] is not None:
                interp[name] = got[1]
        self._blocker = None
        return r, picked, interp

    def _finish(
        self, b: int, decided: tuple[int, dict[str, list[_Entry]], dict[str, float]], forced: bool
    ) -> list[Event]:
        r, picked, interp = decided
        if forced:
            names = set()
            ref = self._reference(b, False)
            if ref is not None:
                names.add(self._ref.spec.name)
                names.update(
                    n
                    for n, st in self._streams.items()
                    if st is not self._ref and self._pick(st, b, ref[0], False) is not None
                )
            self._decided[b] = frozenset(names)
        else:
            # a stream the frame went out without (given up by max_delay, or none in reach) is
            # not decided: a sample of it arriving now is late data, not "a nearer one won"
            self._decided[b] = (
                self._all_names
                if all(picked.values())
                else frozenset(n for n, got in picked.items() if got or n in interp)
            )
        if len(self._decided) > 256:
            for old in sorted(self._decided)[:128]:
                del self._decided[old]
        self._open.remove(b)
        self._open_set.discard(b)
        self._emitted_upto = b if self._emitted_upto is None else max(self._emitted_upto, b)
        # Buckets before b that never opened are gone too; prune history.
        floor = self._prune_floor()
        for st in self._streams.values():
            st.prune(floor)
        missing = tuple(n for n, es in picked.items() if not es)
        required_missing = [
            n for n in missing if self._streams[n].spec.role in (Role.REFERENCE, Role.REQUIRED)
        ]
        complete = not required_missing
        if forced:
            self.stats.forced += 1
        if not complete and self.spec.incomplete is Incomplete.DROP:
            self.stats.dropped_incomplete += 1
            return [DroppedBucket(b, missing)]
        members: dict[str, tuple[Member, ...]] = {}
        max_skew = 0
        skew_measured = False
        last_arrival = 0
        for name, es in picked.items():
            if not es:
                continue
            self.stats.presence[name] += 1
            ms = tuple([new_member(e.sample, e.stamp_ns, e.stamp_ns - r, e.fallback) for e in es])
            members[name] = ms
            spec = self._streams[name].spec
            if spec.pick in (Pick.NEAREST, Pick.LATEST):
                max_skew = max(max_skew, abs(ms[0].skew_ns))
                skew_measured = skew_measured or spec.role is not Role.REFERENCE
            for e in es:
                if e.sample.receive_ns > last_arrival:
                    last_arrival = e.sample.receive_ns
        self.stats.frames += 1
        if complete:
            self.stats.complete += 1
        else:
            self.stats.incomplete += 1
        return [
            MultiModalFrame(
                bucket=b,
                start_ns=self.clock.start_ns(b),
                end_ns=self.clock.end_ns(b),
                reference_stamp_ns=r,
                members=members,
                missing=missing,
                complete=complete,
                late_count=self._late_counts.pop(b, 0),
                max_skew_ns=max_skew,
                interpolation=interp,
                forced=forced,
                last_arrival_ns=last_arrival,
                skew_measured=skew_measured,
            )
        ]

    def _prune_floor(self) -> int:
        if self._emitted_upto is None:
            return -(2**62)
        return self.clock.start_ns(self._emitted_upto + 1) - self._horizon_ns - self.clock.width_ns

    def _late_pane(self, bucket: int, e: _Entry) -> MultiModalFrame:
        centre = (self.clock.start_ns(bucket) + self.clock.end_ns(bucket)) // 2
        name = e.sample.header.stream
        return MultiModalFrame(
            bucket=bucket,
            start_ns=self.clock.start_ns(bucket),
            end_ns=self.clock.end_ns(bucket),
            reference_stamp_ns=centre,
            members={name: (Member(e.sample, e.stamp_ns, e.stamp_ns - centre, e.fallback),)},
            missing=(),
            complete=False,
            late_count=self._late_counts.get(bucket, 0),
            pane=self._late_counts.get(bucket, 0),
            last_arrival_ns=e.sample.receive_ns,
        )
