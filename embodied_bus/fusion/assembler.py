"""The transport-free assembler: samples in, one MultiModalFrame per reference sample out.

Every sample of the reference stream anchors one frame, whatever its phase in its time bucket
(the bucket stays the routing and ownership unit: a frame belongs to the bucket of its
anchor). A sample the reference lost, judged from its own learned cadence
(:mod:`embodied_bus.fusion.cadence`), anchors a frame with the reference missing. The other
streams are picked relative to the anchor's stamp; the windows of ``all`` / ``latest`` streams
tile time, so each of their samples lands in exactly one frame.

A pick is decided by the stream's own samples, never by a guess from its nominal period: once a
sample stamped past what the pick could still use has arrived (streams arrive in stamp order;
an out-of-order sample is placed while its frame is open). A stream is given up for a frame once
the furthest stamp seen on any stream (the event time) is the lateness bound past the frame's
reach *and* the stream has received nothing for the lateness bound while the others kept
delivering (receive times, a stall of every stream at once not counted): a stream still
delivering, only behind the others (another broker topic, a fast replay), is waited for, up to
:data:`MAX_LAG_NS`. A sample that comes after its stream was given up is late. Frames go
out in anchor order. The result is :func:`~embodied_bus.fusion.offline.offline_frames` of the
same samples whenever nothing was given up, for any interleaving of the streams. Memory is
bounded by the reach of the picks (and the lag of a slow stream).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from embodied_bus.fusion.cadence import Cadence, lost_anchors
from embodied_bus.fusion.events import AssemblerStats, DroppedFrame, Event, LateSample, StampJump
from embodied_bus.fusion.frame import Member, MultiModalFrame, new_member
from embodied_bus.fusion.picks import Anchor, Decision, Entry, Picker, StreamState
from embodied_bus.fusion.spec import FusionSpec, Incomplete, Role
from embodied_bus.model.header import HeaderFlags
from embodied_bus.model.sample import Sample

__all__ = [
    "MAX_LAG_NS",
    "STARTUP_NS",
    "Assembler",
    "AssemblerStats",
    "DroppedFrame",
    "Event",
    "LateSample",
    "StampJump",
]

#: Emitted frames remembered to tell a late sample from an unused one.
_RECENT_FRAMES = 64
_STAMP_FALLBACK = int(HeaderFlags.STAMP_FALLBACK)
#: A stream still delivering but this far behind the others (event time past a frame's
#: lateness bound) is given up anyway, to bound memory (ns).
MAX_LAG_NS = 10_000_000_000
#: A stream whose subscription is reconnecting (see :meth:`Assembler.hold`) is waited for until
#: the others are this far ahead (event time past a frame's lateness bound, ns).
MAX_HOLD_NS = 60_000_000_000
#: A stream that has delivered nothing yet is waited for this long after the first sample of
#: any stream (wall clock, ns): subscriptions of separate topics start at their own pace.
STARTUP_NS = 2_000_000_000


@dataclass(slots=True)
class _Emitted:
    """A frame already out: its anchor and the stamp each single-sample pick took."""

    stamp_ns: int
    bucket: int
    taken: dict[str, int | None]


class Assembler:
    """Assembles MultiModalFrames from samples according to a :class:`FusionSpec`.

    Feed samples with :meth:`push`; each call returns the events it caused (frames, late
    samples, stamp jumps, dropped frames). Deterministic: the same input gives the same output,
    and the same frames for any interleaving of the streams that keeps each stream in stamp
    order, as long as no stream is given up. Not thread-safe: one assembler per worker task.
    """

    def __init__(self, spec: FusionSpec) -> None:
        self.spec = spec
        self.clock = spec.clock
        self._ref_spec = spec.reference
        self._picker = Picker(spec)
        self._streams = {s.name: self._picker.stream(s) for s in spec.streams if s is not spec.reference}
        self._ref = StreamState(spec.reference)
        self._cadence = Cadence(spec.reference_period_ns)
        #: Anchors whose frames are not out yet, in stamp order.
        self._pending: deque[Anchor] = deque()
        #: The last anchor added (pending or out) and the last real reference stamp.
        self._last_anchor: Anchor | None = None
        self._last_real_ns: int | None = None
        self._last_out: Anchor | None = None
        self._recent: deque[_Emitted] = deque(maxlen=_RECENT_FRAMES)
        self._event_time_ns: int | None = None
        #: The flowing clock (ns): receive times, each step capped at half the lateness bound,
        #: so a stall of every stream at once (a paused process, a network blip) makes none of
        #: them look silent; how long a stream has been silent is measured on it.
        self._flow_ns = 0
        self._last_receive_ns: int | None = None
        self._flow_cap_ns = max(1, spec.lateness_ns // 2)
        #: Event time at which the silent reference is taken to have lost its next sample.
        self._silence_ns: int | None = None
        #: Event time at which samples are next pruned while no frame is pending.
        self._prune_at_ns = -(2**62)
        self._late_counts: dict[int, int] = {}
        self.stats = AssemblerStats(presence={s.name: 0 for s in spec.streams})
        #: (anchor, stream) whose undecided pick held back the oldest pending frame at the last
        #: decision: until that stream (or the reference) gets a sample, nothing else decides it.
        self._blocker: tuple[Anchor, StreamState] | None = None
        self._jump_ns = spec.jump_ns
        self._lateness_ns = spec.lateness_ns
        self._keep_ns = self._picker.reach_before_ns + spec.lateness_ns + 2 * spec.reference_period_ns
        #: Streams whose subscription is reconnecting: never taken for silent (see :meth:`hold`).
        self._held: frozenset[str] = frozenset()
        #: Streams out of the hold whose backlog is still coming: they lag by up to MAX_HOLD_NS.
        self._catching_up: set[str] = set()

    def hold(self, streams: frozenset[str]) -> None:
        """Wait for ``streams`` rather than give them up: their subscription is reconnecting
        (their broker died and their topic moves to another), so what they carry meanwhile
        comes late, not never. Frames wait for them until the others are :data:`MAX_HOLD_NS`
        ahead; an empty set ends the hold. A stream leaving the hold counts as having just
        delivered, and may lag that far until it has caught up (its backlog is on its way)."""
        for name in self._held - streams:
            st = self._ref if name == self._ref.spec.name else self._streams.get(name)
            if st is not None and st.progress_ns is not None:
                st.last_arrival_ns = self._flow_ns
            self._catching_up.add(name)
        self._held = streams

    def _max_lag_ns(self, st: StreamState) -> int:
        """How far the others may be ahead of ``st`` before its frames go out without it."""
        name = st.spec.name
        if name in self._held:
            return MAX_HOLD_NS
        if name in self._catching_up:
            top = self._event_time_ns
            if st.progress_ns is None or top is None or top - st.progress_ns > self._lateness_ns:
                return MAX_HOLD_NS
            self._catching_up.discard(name)  # caught up
        return MAX_LAG_NS

    # ------------------------------------------------------------------ input
    def push(self, sample: Sample) -> list[Event]:
        """Add one sample; return the events it caused, in order."""
        h = sample.header
        name = h.stream
        st = self._streams.get(name)
        if st is None and name != self._ref_spec.name:
            self.stats.ignored += 1
            return []
        state = st if st is not None else self._ref
        entry = self._entry(state, sample)
        if entry is None:
            return []
        self.stats.samples += 1
        arrival = sample.receive_ns
        last = self._last_receive_ns
        if last is None:
            self._last_receive_ns = arrival
        elif arrival > last:
            self._flow_ns += min(arrival - last, self._flow_cap_ns)
            self._last_receive_ns = arrival
        state.last_arrival_ns = self._flow_ns
        events = self._check_jump(state, entry.stamp_ns)
        self._advance_event_time(st, entry.stamp_ns)
        if self._catching_up and name in self._catching_up:
            self._max_lag_ns(state)  # forgets it once caught up
        if st is None:
            events.extend(self._add_reference(entry))
        else:
            events.extend(self._add_member(st, entry))
        events.extend(self._emit_ready(state))
        return events

    def _advance_event_time(self, member: StreamState | None, stamp: int) -> None:
        """Event time is the newest stamp, but a member stamped far ahead of the reference (a
        wrong clock, a hostile stamp) does not drag it along, and the reference takes it back
        from one that did before the reference's first sample."""
        top = self._event_time_ns
        if member is None:
            if top is None or stamp > top or top - stamp > self._jump_ns:
                self._event_time_ns = stamp
            return
        ref_ns = self._ref.progress_ns
        if (top is None or stamp > top) and (ref_ns is None or stamp - ref_ns <= self._jump_ns):
            self._event_time_ns = stamp

    def _entry(self, st: StreamState, sample: Sample) -> Entry | None:
        """The sample's entry (stamped, clock offset applied), or None if seen before."""
        h = sample.header
        if not st.seen.first_time(h.publisher_id, h.seq):
            self.stats.duplicates += 1
            return None
        stamp = h.stamp_ns
        if stamp == 0:
            stamp = sample.receive_ns
            fallback = True
        else:
            fallback = (int(h.flags) & _STAMP_FALLBACK) != 0
        if fallback:
            self.stats.stamp_fallbacks += 1
        return Entry(stamp + st.spec.clock_offset_ns, sample, fallback)

    def _check_jump(self, st: StreamState, stamp: int) -> list[Event]:
        """Report a clock jump of the stream; a jump backwards restarts it (the reference: the
        whole assembler, after forcing out what is pending)."""
        last = st.progress_ns
        if last is None or (stamp - last <= self._jump_ns and last - stamp <= self._jump_ns):
            return []
        jump = StampJump(st.spec.name, last, stamp)
        self.stats.stamp_jumps += 1
        events: list[Event] = [jump]
        if not jump.backwards:
            if st is self._ref:
                self._end_segment()
            return events
        if st is self._ref:
            events.extend(self.flush())
            for other in self._streams.values():
                other.reset()
            self._ref.reset()
            self._cadence.reset()
            self._last_anchor = self._last_real_ns = self._last_out = None
            self._recent.clear()
            self._event_time_ns = None
        else:
            st.reset()
        self._blocker = None
        return events

    def _end_segment(self) -> None:
        """The reference jumped forward: the last anchor has no next one (no lost samples are
        assumed across the jump) and the next starts a new segment."""
        if self._last_anchor is not None:
            self._last_anchor.last = True
        self._last_real_ns = None
        self._cadence.reset()

    def _add_reference(self, entry: Entry) -> list[Event]:
        st = self._ref
        t = entry.stamp_ns
        if st.progress_ns is None or t > st.progress_ns:
            st.progress_ns = t
        last = self._last_anchor
        if last is not None and t <= last.stamp_ns:
            return self._reference_out_of_order(entry)
        first = last is None or last.last
        if last is not None and not first:
            # lost samples between the last anchor (a real sample, or one due during a
            # silence) and this one, judged from the learned cadence
            period = self._cadence.period_ns
            for lost in lost_anchors(last.stamp_ns, t, period):
                self._append(Anchor(lost, None, period, first=False))
        self._cadence.observe(t)
        self._last_real_ns = t
        self._append(Anchor(t, entry, self._cadence.period_ns, first=first))
        return []

    def _append(self, anchor: Anchor) -> None:
        anchor.deadline_ns = self._picker.deadline_ns(anchor) + self._lateness_ns
        self._pending.append(anchor)
        self._last_anchor = anchor
        self._silence_ns = None

    def _reference_out_of_order(self, entry: Entry) -> list[Event]:
        """A reference sample stamped at or before the last anchor: it replaces the lost-sample
        anchor it belongs to if that frame is still pending; otherwise it is late (or a second
        sample with an anchor's stamp)."""
        t = entry.stamp_ns
        for a in self._pending:
            if a.entry is None and abs(a.stamp_ns - t) * 2 <= a.period_ns:
                a.stamp_ns, a.entry = t, entry
                self._blocker = None
                return []
            if a.stamp_ns == t:
                break
        if any(a.stamp_ns == t for a in self._pending) or (
            self._last_out is not None and self._last_out.stamp_ns == t
        ):
            self.stats.unused += 1
            return []
        return self._late(entry, self.clock.bucket_of(t))

    def _add_member(self, st: StreamState, entry: Entry) -> list[Event]:
        stamp = entry.stamp_ns
        events: list[Event] = []
        if st.window_floor_ns is not None and stamp < st.window_floor_ns:
            # its window is out: late, or before the first frame (never in one)
            if st.first_floor_ns is not None and stamp >= st.first_floor_ns:
                events.extend(self._late(entry, self.clock.bucket_of(stamp)))
            else:
                self.stats.unused += 1
            return events
        if (
            st.window_floor_ns is None
            and self._recent
            and stamp <= self._recent[-1].stamp_ns + st.reach_after_ns
        ):
            hit = self._beats_emitted(st, stamp)
            if hit is not None:
                events.extend(self._late(entry, hit))
                if st.progress_ns is None or stamp > st.progress_ns:
                    st.progress_ns = stamp
                st.insert(entry)  # it may still serve a pending frame
                return events
        st.add(entry)
        return events

    def _beats_emitted(self, st: StreamState, stamp: int) -> int | None:
        """The bucket of an emitted frame that would have taken this sample (None: none)."""
        name = st.spec.name
        for em in reversed(self._recent):  # newest first
            if stamp < em.stamp_ns - st.reach_before_ns:
                continue
            if stamp > em.stamp_ns + st.reach_after_ns:
                break
            if self._picker.would_take(st, em.stamp_ns, em.taken.get(name), stamp):
                return em.bucket
        return None

    def _late(self, entry: Entry, bucket: int) -> list[Event]:
        self.stats.late += 1
        self._late_counts[bucket] = self._late_counts.get(bucket, 0) + 1
        if len(self._late_counts) > 4 * _RECENT_FRAMES:
            for old in sorted(self._late_counts)[: 2 * _RECENT_FRAMES]:
                del self._late_counts[old]
        events: list[Event] = [LateSample(entry.sample, bucket, entry.stamp_ns)]
        if self.spec.late_panes:
            events.append(self._late_pane(bucket, entry))
        return events

    def advance(self, watermark_ns: int) -> list[Event]:
        """Declare that no stream will send stamps before ``watermark_ns`` (e.g. wall clock
        minus the largest expected latency): picks waiting for samples before it are decided,
        and frames whose lateness bound passed are forced out."""
        for st in (*self._streams.values(), self._ref):
            if st.progress_ns is None or st.progress_ns < watermark_ns:
                st.progress_ns = watermark_ns
        if self._event_time_ns is None or watermark_ns > self._event_time_ns:
            self._event_time_ns = watermark_ns
        self._blocker = None
        return self._emit_ready(None)

    def flush(self) -> list[Event]:
        """Emit every pending frame now (end of stream, shutdown)."""
        events: list[Event] = []
        if self._last_anchor is not None:
            self._last_anchor.last = True
        while self._pending:
            events.extend(self._emit(self._pending[0], forced=True))
        return events

    # ------------------------------------------------------------------ state
    @property
    def event_time_ns(self) -> int | None:
        """The furthest stamp seen on any stream (None before the first sample)."""
        return self._event_time_ns

    @property
    def horizon_ns(self) -> int:
        """How far before a reference stamp a pick may reach (ns)."""
        return self._picker.reach_before_ns

    @property
    def emitted_upto_ns(self) -> int | None:
        """The reference stamp of the last frame out (None before the first)."""
        return self._last_out.stamp_ns if self._last_out is not None else None

    @property
    def pending_frames(self) -> int:
        """Frames waiting for data."""
        return len(self._pending)

    @property
    def pending_stamps(self) -> tuple[int, ...]:
        """Reference stamps of the frames waiting for data."""
        return tuple(a.stamp_ns for a in self._pending)

    @property
    def buffered_samples(self) -> int:
        """Samples held for pending frames (bounded by the reach of the picks)."""
        return sum(len(s.entries) for s in self._streams.values()) + len(self._pending)

    # ------------------------------------------------------------------ decisions
    def _emit_ready(self, changed: StreamState | None) -> list[Event]:
        """Emit the oldest frames that are decided or past the lateness bound.

        Args:
            changed: The only stream whose samples changed since the last call (None: any
                may have). A frame held back by another stream's pick is not re-examined.
        """
        events: list[Event] = []
        top = self._event_time_ns
        while True:
            if not self._pending and not self._lost_during_silence():
                break
            a = self._pending[0]
            blk = self._blocker
            if (
                changed is None
                or blk is None
                or blk[0] is not a
                or changed is self._ref
                or blk[1].spec.max_delay_ns is not None  # moved by any stream's stamps
                or (
                    blk[1] is changed
                    and (a.need_ns is None or (changed.progress_ns or a.need_ns) >= a.need_ns)
                )
            ):
                decision = self._decide(a, forced=False)
                if decision is not None:
                    events.extend(self._finish(a, decision))
                    continue
            if top is not None and top >= a.deadline_ns and self._given_up(a, top):
                events.extend(self._emit(a, forced=True))
                continue
            break
        if (
            not self._pending
            and top is not None
            and top >= self._prune_at_ns
            and self._max_lag_ns(self._ref) == MAX_LAG_NS  # (a held reference's frames need them)
        ):
            self._prune_idle(top)  # (a held reference's frames, still to come, need them)
        return events

    def _silent(self, st: StreamState) -> bool:
        """Whether ``st`` has received nothing for the lateness bound while the others kept
        delivering (on the flowing clock). A stream that is still delivering, only behind the
        others (another topic of a broker, a fast replay), is waited for."""
        if st.spec.name in self._held:
            return False
        if st.progress_ns is None:  # never delivered: waited for a while after the start
            return self._flow_ns >= max(self._lateness_ns, STARTUP_NS)
        return self._flow_ns - st.last_arrival_ns >= self._lateness_ns

    def _given_up(self, a: Anchor, top: int) -> bool:
        """Whether the stream holding back the frame of ``a`` (its event-time bound passed) is
        given up: it is silent, or so far behind that memory must be bounded."""
        blk = self._blocker
        if blk is None or blk[0] is not a:
            return True
        if top >= a.deadline_ns + self._max_lag_ns(blk[1]):
            return True
        return self._silent(blk[1])

    def _lost_during_silence(self) -> bool:
        """With every frame out and the reference silent past the lateness bound, anchor a
        frame where its next sample was due (reference missing). True if one was added."""
        last, top = self._last_anchor, self._event_time_ns
        if last is None or last.last or top is None:
            return False
        if self._silence_ns is None:
            due = Anchor(last.stamp_ns + last.period_ns, None, last.period_ns, first=False)
            self._silence_ns = self._picker.deadline_ns(due) + self._lateness_ns
        lag_ns = self._max_lag_ns(self._ref)
        if top < self._silence_ns or not (self._silent(self._ref) or top >= self._silence_ns + lag_ns):
            return False
        due_ns = last.stamp_ns + last.period_ns
        if top - due_ns > self._jump_ns:  # event time leapt ahead: no frames anchored across the leap
            self._end_segment()
            return False
        self._append(Anchor(due_ns, None, last.period_ns, first=False))
        return True

    def _emit(self, a: Anchor, forced: bool) -> list[Event]:
        decision = self._decide(a, forced=forced)
        assert decision is not None
        return self._finish(a, decision)

    def _decide(self, a: Anchor, forced: bool) -> Decision | None:
        decision = self._picker.decide(
            a, self._streams.values(), self._event_time_ns, self._flow_ns, forced, self._held
        )
        if isinstance(decision, StreamState):
            self._blocker = (a, decision)
            return None
        self._blocker = None
        return decision

    def _finish(self, a: Anchor, decision: Decision) -> list[Event]:
        self._pending.popleft()
        self._last_out = a
        for name, lo_hi in decision.windows.items():
            st = self._streams[name]
            if a.first or st.first_floor_ns is None:
                st.first_floor_ns = lo_hi[0]
            st.window_floor_ns = lo_hi[1]
        for st in self._streams.values():
            st.prune(
                st.window_floor_ns if st.window_floor_ns is not None else a.stamp_ns - st.reach_before_ns
            )
        b = self.clock.bucket_of(a.stamp_ns)
        picked = decision.picked
        self._recent.append(
            _Emitted(
                a.stamp_ns,
                b,
                {n: es[0].stamp_ns if es else None for n, es in picked.items() if n in decision.single},
            )
        )
        ref_name = self._ref_spec.name
        missing = tuple(n for n in (ref_name, *picked) if not (a.entry if n == ref_name else picked[n]))
        complete = a.entry is not None and not any(
            not picked[n] for n, st in self._streams.items() if st.spec.role is Role.REQUIRED
        )
        if decision.forced:
            self.stats.forced += 1
        if a.entry is None:
            self.stats.reference_lost += 1
        if not complete and self.spec.incomplete is Incomplete.DROP:
            self.stats.dropped_incomplete += 1
            return [DroppedFrame(b, a.stamp_ns, missing)]
        return [self._frame(a, b, decision, missing, complete)]

    def _frame(
        self, a: Anchor, b: int, decision: Decision, missing: tuple[str, ...], complete: bool
    ) -> MultiModalFrame:
        r = a.stamp_ns
        members: dict[str, tuple[Member, ...]] = {}
        presence = self.stats.presence
        last_arrival = 0
        if a.entry is not None:
            e = a.entry
            members[self._ref_spec.name] = (new_member(e.sample, e.stamp_ns, 0, e.fallback),)
            presence[self._ref_spec.name] += 1
            last_arrival = e.sample.receive_ns
        max_skew: int | None = None
        for name, es in decision.picked.items():
            if not es:
                continue
            presence[name] += 1
            members[name] = tuple([new_member(e.sample, e.stamp_ns, e.stamp_ns - r, e.fallback) for e in es])
            for e in es:
                skew = abs(e.stamp_ns - r)
                if max_skew is None or skew > max_skew:
                    max_skew = skew
                if e.sample.receive_ns > last_arrival:
                    last_arrival = e.sample.receive_ns
        self.stats.frames += 1
        if complete:
            self.stats.complete += 1
        else:
            self.stats.incomplete += 1
        return MultiModalFrame(
            bucket=b,
            start_ns=self.clock.start_ns(b),
            end_ns=self.clock.end_ns(b),
            reference_stamp_ns=r,
            members=members,
            missing=missing,
            complete=complete,
            late_count=self._late_counts.pop(b, 0),
            max_skew_ns=max_skew,
            interpolation=decision.interpolation,
            forced=decision.forced,
            last_arrival_ns=last_arrival,
            waited_on=decision.waited_on,
        )

    def _prune_idle(self, top: int) -> None:
        """No frame pending: drop samples too old for any frame still to come. Frames to come
        are anchored at or after the reference's progress (it may lag the other streams), so
        what reaches back from there is kept, up to :data:`MAX_LAG_NS` behind the event time."""
        self._prune_at_ns = top + self._keep_ns // 4
        ref = self._ref.progress_ns
        floor = top - self._keep_ns - MAX_LAG_NS
        if ref is not None and ref - self._keep_ns > floor:
            floor = ref - self._keep_ns
        for st in self._streams.values():
            if st.window_floor_ns is None:
                st.prune(floor)

    def _late_pane(self, bucket: int, e: Entry) -> MultiModalFrame:
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
