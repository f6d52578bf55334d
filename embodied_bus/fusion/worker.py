"""A fusion worker: subscribes to a spec's input streams, assembles frames, publishes them.

Frames go to the stream ``frames/<spec.name>`` (encoding ``ebframe``, modality FRAME, stamped
with the reference stamp, bucketed with the spec's clock) and late samples, unchanged, to
``frames/<spec.name>/late``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from embodied_bus.bus import Bus
from embodied_bus.errors import BusClosedError, BusConnectionError
from embodied_bus.fusion.assembler import Assembler, DroppedBucket, Event, LateSample, StampJump
from embodied_bus.fusion.codec import FRAME_ENCODING, encode_frame
from embodied_bus.fusion.frame import MultiModalFrame
from embodied_bus.fusion.ownership import OwnershipRing, rendezvous_owner, slot_ranges
from embodied_bus.fusion.spec import FusionSpec, Pick, Role, SpecError
from embodied_bus.model.header import Modality
from embodied_bus.model.qos import Backpressure, PublisherOptions, SubscriptionOptions
from embodied_bus.model.sample import Sample
from embodied_bus.streams.publisher import Publisher
from embodied_bus.streams.subscriber import Subscription

__all__ = [
    "DEFAULT_IDLE_FLUSH_S",
    "FRAMES_HISTORY_S",
    "SCALE_OUT_MODES",
    "FusionMetrics",
    "FusionWorker",
    "frames_stream",
]

#: With no input for this long, open buckets are flushed (end of a recording, sensors down).
DEFAULT_IDLE_FLUSH_S = 1.0
_WINDOW = 4096
_log = logging.getLogger("embodied_bus.fusion")
#: Scale-out modes of :class:`FusionWorker`.
SCALE_OUT_MODES = (None, "ring", "key-shared")
#: Key-shared mode waits this long for the group's heartbeats before taking slots, seconds.
GROUP_SETTLE_S = 0.6
#: Key-shared mode: a redelivered bucket is assembled once no sample of it came for this long,
#: or for the spec's lateness bound if that is longer (after a re-deal, the samples a former
#: owner held come back topic by topic, as the broker redelivers them).
RECOVERY_QUIET_S = 0.5
#: Key-shared mode: longest wait for the frames stream to catch up before a handed-over bucket
#: is published, seconds (past it the frame is published anyway: at least once).
FRAMES_SYNC_TIMEOUT_S = 5.0
#: Key-shared mode: frames published this long before a worker starts are taken in at its start
#: (a worker that crashed just before may not have acknowledged their samples, which may then be
#: dealt to this one), seconds.
FRAMES_HISTORY_S = 10.0
#: Longest wait for a stopping key-shared worker to hand back or flush its slots, seconds.
CLOSE_TIMEOUT_S = 10.0
#: Longest wait of a worker leaving a running ring for the others to publish the buckets it left
#: open (it publishes them itself if every other worker left meanwhile), seconds.
HANDOVER_CONFIRM_S = 2.0
#: Recent buckets remembered for ring bookkeeping.
_RECENT = 512


def frames_stream(spec: FusionSpec) -> str:
    """Stream carrying the frames of a spec."""
    return f"frames/{spec.name}"


def _pct(values: deque[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    p50, p99 = np.percentile(np.fromiter(list(values), dtype=float), [50, 99])
    return round(float(p50), 3), round(float(p99), 3)


@dataclass
class FusionMetrics:
    """Pipeline metrics: rates, completeness, presence, skew and latency percentiles (ms)."""

    started: float = field(default_factory=time.monotonic)
    frames: int = 0
    complete: int = 0
    late: int = 0
    dropped: int = 0
    jumps: int = 0
    #: Frames forced out by the lateness bound or an idle flush rather than on completion.
    forced: int = 0
    presence: dict[str, int] = field(default_factory=dict)
    #: Whether the spec has a nearest- or latest-picked input besides the reference (the skew
    #: is taken over those; without one it is None, not a misleading 0).
    skew_tracked: bool = True
    skew_ms: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    added_ms: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    #: Added latency of the frames emitted on completion (not forced), ms.
    added_on_completion_ms: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    e2e_ms: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))

    @classmethod
    def for_spec(cls, spec: FusionSpec) -> FusionMetrics:
        """Metrics of a pipeline running ``spec``."""
        return cls(
            skew_tracked=any(
                s.role is not Role.REFERENCE and s.pick in (Pick.NEAREST, Pick.LATEST) for s in spec.streams
            )
        )

    def record(self, frame: MultiModalFrame, emitted_ns: int) -> None:
        self.frames += 1
        self.complete += frame.complete
        for name in frame.members:
            self.presence[name] = self.presence.get(name, 0) + 1
        if self.skew_tracked and frame.skew_measured:  # else 0 by definition, not a measurement
            self.skew_ms.append(frame.max_skew_ns / 1e6)
        if frame.forced:
            self.forced += 1
        if frame.last_arrival_ns:
            added_ms = (emitted_ns - frame.last_arrival_ns) / 1e6
            self.added_ms.append(added_ms)
            if not frame.forced:
                self.added_on_completion_ms.append(added_ms)
        self.e2e_ms.append((emitted_ns - frame.reference_stamp_ns) / 1e6)

    def as_dict(self) -> dict[str, Any]:
        elapsed = max(1e-9, time.monotonic() - self.started)
        skew = _pct(self.skew_ms)
        added = _pct(self.added_ms)
        on_completion = _pct(self.added_on_completion_ms)
        e2e = _pct(self.e2e_ms)
        return {
            "frames": self.frames,
            "frames_per_s": round(self.frames / elapsed, 2),
            "completeness_pct": round(100 * self.complete / self.frames, 2) if self.frames else None,
            "presence_pct": {k: round(100 * v / self.frames, 2) for k, v in sorted(self.presence.items())}
            if self.frames
            else {},
            "skew_p50_ms": skew[0],
            "skew_p99_ms": skew[1],
            "added_latency_p50_ms": added[0],
            "added_latency_p99_ms": added[1],
            "added_latency_on_completion_p50_ms": on_completion[0],
            "added_latency_on_completion_p99_ms": on_completion[1],
            "forced": self.forced,
            "end_to_end_p50_ms": e2e[0],
            "end_to_end_p99_ms": e2e[1],
            "late": self.late,
            "dropped_incomplete": self.dropped,
            "stamp_jumps": self.jumps,
        }


class FusionWorker:
    """Runs one assembler fed from the bus.

    Args:
        bus: An open bus.
        spec: The fusion spec.
        on_frame: Called with each published frame and its emit time (ns), e.g. to write JSON
            lines.
        capacity: Buffer of each input subscription (lossless ``block`` policy).
        idle_flush_s: Flush open buckets after this long without input.
        scale_out: ``None`` (one worker), ``"ring"`` (Zenoh ownership ring: every worker
            receives everything, the owner of a bucket publishes it) or ``"key-shared"`` (Pulsar
            Key_Shared STICKY slots: each worker receives only its buckets, acknowledged after
            their frame). See :mod:`embodied_bus.fusion.ownership`.
        worker_id: Member id in the worker group (default: random).
        join_margin_buckets: A worker joining a running ring owns buckets from its current
            bucket plus this many (default: the lateness bound in buckets + 3).
    """

    def __init__(
        self,
        bus: Bus,
        spec: FusionSpec,
        *,
        on_frame: Callable[[MultiModalFrame, int], None] | None = None,
        capacity: int = 4096,
        idle_flush_s: float = DEFAULT_IDLE_FLUSH_S,
        scale_out: str | None = None,
        worker_id: str | None = None,
        join_margin_buckets: int | None = None,
    ) -> None:
        self.bus = bus
        self.spec = spec
        self.assembler = Assembler(spec)
        self.metrics = FusionMetrics.for_spec(spec)
        self._on_frame = on_frame
        self._capacity = capacity
        self._idle_flush_s = idle_flush_s
        self._subs: list[Subscription] = []
        self._frames_pub: Publisher | None = None
        self._late_pub: Publisher | None = None
        self._last_input = time.monotonic()
        self.ready = asyncio.Event()
        if scale_out not in SCALE_OUT_MODES:
            raise SpecError(f"scale_out must be one of {SCALE_OUT_MODES}, got {scale_out!r}")
        self._mode = scale_out
        #: Samples not yet acknowledged, by bucket (key-shared mode).
        self._unacked: dict[int, list[Sample]] = {}
        self._worker_id = worker_id
        self._margin = (
            join_margin_buckets
            if join_margin_buckets is not None
            else -(-spec.lateness_ns // spec.clock.width_ns) + 3
        )
        self.ring: OwnershipRing | None = None
        self._joining = False
        #: Buckets whose frame some worker of the ring published (recent, bounded).
        self._published: OrderedDict[int, None] = OrderedDict()
        #: Frames this worker assembled but another member owned (for takeover).
        self._held: OrderedDict[int, MultiModalFrame] = OrderedDict()
        #: Frames not published because another worker already had.
        self.skipped = 0
        #: Frames published on behalf of a worker that left.
        self.taken_over = 0
        #: Key-shared mode: the hash ranges consumed now, and how often they were re-dealt.
        self.slots: tuple[tuple[int, int], ...] = ()
        self.reassignments = 0
        #: Key-shared mode: redelivered older buckets being collected, and when they last grew.
        self._recovering: dict[int, list[Sample]] = {}
        self._recovering_at: dict[int, float] = {}
        self._emitted_here: set[int] = set()
        self._settle_until = 0.0
        #: Key-shared mode: until then, frames may be of buckets another worker held before the
        #: slots were re-dealt, and the frames stream is caught up before each is published.
        self._handover_until = 0.0
        self._frames_sub: Subscription | None = None
        #: Key-shared mode: samples of buckets another worker had already published, redelivered
        #: here after it left (acknowledged; neither late nor in a frame of this worker).
        self.already_published = 0
        #: Frames published without the frames stream having caught up (broker too slow).
        self.sync_timeouts = 0
        #: Held while a sample is handled (or buckets are flushed): the slots are re-dealt only
        #: between samples, so a frame published is never left with its samples unacknowledged.
        self._handling = asyncio.Lock()
        #: Buckets assembled from redelivered samples.
        self.recovered = 0
        #: Open buckets handed back whole to the other workers when this one stopped.
        self.handed_back = 0
        #: Of those, published by this worker after all because the others stopped too (ring).
        self.published_on_stop = 0

    def _mark_published(self, bucket: int) -> None:
        self._published[bucket] = None
        self._published.move_to_end(bucket)
        while len(self._published) > _RECENT:
            self._published.popitem(last=False)

    async def _sync_published(self) -> None:
        """Take in every frame stored on the frames stream so far (key-shared mode).

        A worker that let go of its slots (or died) may have published the frame of a bucket
        whose samples it had not yet acknowledged; the samples come back to the new owner, which
        must not publish that bucket again. Reading the frames stream up to its last stored
        message tells for sure, where the tracking subscription alone may lag.
        """
        sub = self._frames_sub
        if sub is None:
            return
        caught_up = await sub.catch_up(FRAMES_SYNC_TIMEOUT_S)
        while (sample := sub.recv_nowait()) is not None:
            self._mark_published(sample.bucket)
        if not caught_up:
            self.sync_timeouts += 1
            _log.warning(
                "frames stream did not catch up within %g s: a handed-over bucket may be published twice",
                FRAMES_SYNC_TIMEOUT_S,
            )

    async def _publish_frame(self, frame: MultiModalFrame) -> None:
        now = time.time_ns()
        _log.debug(
            "publish bucket %d members %s forced %s", frame.bucket, sorted(frame.members), frame.forced
        )
        if frame.pane == 0:
            self.metrics.record(frame, now)
            self._mark_published(frame.bucket)
            if self._mode == "key-shared":
                self._emitted_here.add(frame.bucket)
                if len(self._emitted_here) > _RECENT:
                    self._emitted_here.discard(min(self._emitted_here))
        assert self._frames_pub is not None
        await self._frames_pub.publish(encode_frame(frame), stamp_ns=frame.reference_stamp_ns)
        if self._on_frame is not None:
            self._on_frame(frame, now)

    async def _handle(self, events: list[Event]) -> None:
        ring = self.ring if self._mode == "ring" else None
        keyshared = self._mode == "key-shared"
        for ev in events:
            if isinstance(ev, MultiModalFrame):
                if keyshared and ev.pane == 0:
                    done = ev.bucket
                    if time.monotonic() < self._handover_until:
                        await self._sync_published()
                    if ev.bucket in self._published:
                        self.skipped += 1
                        self._ack_through(done)
                        continue
                if ring is not None:
                    if ev.pane == 0 and ev.bucket in self._published:
                        self.skipped += 1
                        continue
                    if not ring.owns(ev.bucket):
                        if ev.pane == 0:
                            self._held[ev.bucket] = ev
                            while len(self._held) > _RECENT:
                                self._held.popitem(last=False)
                        continue
                await self._publish_frame(ev)
                if keyshared and ev.pane == 0:
                    # persisted before its samples are acknowledged: after a crash in between,
                    # the new owner gets the samples again and finds the frame on the frames
                    # stream (_sync_published), so the bucket is neither lost nor repeated
                    assert self._frames_pub is not None
                    await self._frames_pub.flush()
                    self._ack_through(ev.bucket)
            elif isinstance(ev, LateSample):
                _log.debug("late %s sample for bucket %d", ev.sample.stream, ev.bucket)
                if ring is not None and not ring.owns(ev.bucket):
                    continue
                self.metrics.late += 1
                assert self._late_pub is not None
                payload = ev.sample.payload
                await self._late_pub.publish(
                    payload if isinstance(payload, bytes) else bytes(payload),
                    stamp_ns=ev.sample.stamp_ns,
                    encoding=ev.sample.header.encoding,
                    frame_id=ev.sample.header.frame_id,
                )
                ev.sample.ack()
            elif isinstance(ev, DroppedBucket):
                self.metrics.dropped += 1
                if keyshared:
                    self._ack_through(ev.bucket)
            elif isinstance(ev, StampJump):
                self.metrics.jumps += 1

    async def _recover(self, quiet_s: float | None = None) -> None:
        """Emit redelivered buckets whose samples stopped arriving ``quiet_s`` ago (default:
        :data:`RECOVERY_QUIET_S` or the lateness bound, whichever is longer)."""
        if quiet_s is None:
            quiet_s = max(RECOVERY_QUIET_S, self.spec.lateness_ns / 1e9)
        now = time.monotonic()
        ready = [b for b, t in self._recovering_at.items() if now - t >= quiet_s]
        if ready:
            await self._sync_published()
        for b in ready:
            samples = self._recovering.pop(b)
            del self._recovering_at[b]
            if b not in self._published:
                asm = Assembler(self.spec)
                events = [e for s in sorted(samples, key=lambda x: x.stamp_ns) for e in asm.push(s)]
                events += asm.flush()
                for ev in events:
                    if isinstance(ev, MultiModalFrame) and ev.pane == 0 and ev.bucket == b:
                        self.recovered += 1
                        await self._publish_frame(ev)
                assert self._frames_pub is not None
                await self._frames_pub.flush()  # persisted before the samples are acknowledged
            else:
                self.skipped += 1
            for sample in samples:
                sample.ack()

    def _ack_through(self, bucket: int) -> None:
        """Acknowledge every held sample of buckets up to ``bucket`` (their frames are out)."""
        for b in [b for b in self._unacked if b <= bucket]:
            for sample in self._unacked.pop(b):
                sample.ack()

    async def push(self, sample: Sample) -> None:
        """Feed one sample (the subscriptions call this; tests and replay may too)."""
        self._last_input = time.monotonic()
        if self._mode == "key-shared":
            spec = self.spec.stream(sample.stream)
            stamp = sample.stamp_ns or sample.receive_ns
            b = self.spec.clock.bucket_of(stamp + (spec.clock_offset_ns if spec else 0))
            upto = self.assembler.emitted_upto
            now_ns = self.assembler.event_time_ns
            behind = (upto is not None and b <= upto) or (
                now_ns is not None and self.spec.clock.end_ns(b) + self.spec.lateness_ns <= now_ns
            )
            # Right after the slots were dealt, samples of one bucket arrive from redeliveries
            # and fresh sends in any order: collect them by bucket until they stop coming.
            settling = time.monotonic() < self._settle_until or b in self._recovering
            if (
                (behind or settling)
                and b not in self._emitted_here
                and b not in self.assembler.open_bucket_ids
            ):
                if b in self._published:
                    # Another worker published this bucket before the slots moved here: the
                    # samples it had not yet acknowledged when it left come back (at least once).
                    _log.debug("%s sample for bucket %d published by another worker", sample.stream, b)
                    self.already_published += 1
                    sample.ack()
                    return
                # An older bucket redelivered from a worker that left or gave up its slot:
                # assemble it on its own once its samples stop arriving.
                self._recovering.setdefault(b, []).append(sample)
                self._recovering_at[b] = time.monotonic()
                return
            self._unacked.setdefault(b, []).append(sample)
        events = self.assembler.push(sample)
        ring = self.ring
        if (
            self._mode == "ring"
            and ring is not None
            and not self._joining
            and ring.joined_from is None
            and not ring.joined
        ):
            # Joining a running ring: own buckets from a little ahead of the current event time.
            self._joining = True
            await ring.join(self.spec.clock.bucket_of(sample.stamp_ns) + self._margin)
        await self._handle(events)

    async def _pump(self, sub: Subscription) -> None:
        if self._mode != "key-shared":
            async for sample in sub:
                await self.push(sample)
            return
        handling = self._handling
        async for sample in sub:
            async with handling:
                await self.push(sample)

    async def _track_published(self, sub: Subscription) -> None:
        async for sample in sub:
            self._mark_published(sample.bucket)

    async def _take_over(self) -> None:
        assert self.ring is not None
        while True:
            await self.ring.departures.get()
            for bucket, frame in list(self._held.items()):
                if bucket not in self._published and self.ring.owns(bucket):
                    del self._held[bucket]
                    self.taken_over += 1
                    await self._publish_frame(frame)

    async def _key_shared(self, stop: asyncio.Event, inputs: tuple[str, ...]) -> None:
        """Consume this worker's Key_Shared slots; re-deal them when the group changes."""
        ring = self.ring
        assert ring is not None
        await asyncio.sleep(GROUP_SETTLE_S)  # let the heartbeats of running workers arrive
        while not stop.is_set():
            ring.changed.clear()
            ranges = slot_ranges(ring.worker_id, ring.members())
            sub: Subscription | None = None
            if ranges:
                opts = SubscriptionOptions(
                    capacity=self._capacity,
                    backpressure=Backpressure.BLOCK,
                    auto_ack=False,
                    subscription_name=f"eb-fusion-{self.spec.name.replace('/', '.')}",
                    key_shared_ranges=ranges,
                )
                try:
                    sub = await self.bus.subscribe(inputs, options=opts)
                except BusConnectionError:
                    # Another worker still holds part of these ranges: it lets go once it sees
                    # the same group; try again shortly.
                    await asyncio.sleep(0.2)
                    continue
            self.slots = ranges
            settle_s = max(RECOVERY_QUIET_S, self.spec.lateness_ns / 1e9)
            self._settle_until = time.monotonic() + settle_s
            self._handover_until = self._settle_until + settle_s + 1.0
            pump = asyncio.create_task(self._pump(sub)) if sub is not None else None
            changed = asyncio.create_task(ring.changed.wait())
            stopped = asyncio.create_task(stop.wait())
            waiting = {changed, stopped} | ({pump} if pump is not None else set())
            while True:
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if pump is not None and pump in done:
                    pump.result()  # a failed pump ends the worker with its error
                if stopped in done or slot_ranges(ring.worker_id, ring.members()) != ranges:
                    break
                ring.changed.clear()
                changed = asyncio.create_task(ring.changed.wait())
                waiting = {changed, stopped} | ({pump} if pump is not None else set())
            for t in (changed, stopped):
                t.cancel()
            if pump is not None:  # stop consuming first, between two samples
                async with self._handling:
                    pump.cancel()
                await asyncio.gather(pump, return_exceptions=True)
            if stop.is_set():
                await self._finish_slots()  # before the consumer closes: its acks go out
            if sub is not None:
                await sub.close()  # unacknowledged samples (open buckets) go to their new owner
            if stop.is_set():
                return
            self.reassignments += 1
            _log.info("Key_Shared slots re-dealt (was %s)", ranges)
            # Open buckets come back as redeliveries (to us or their new owner): start them over.
            self._forget_open()

    async def _take_in_recent_frames(self) -> None:
        """Mark the buckets of the frames published in the last :data:`FRAMES_HISTORY_S` before
        this worker started (its tracking subscription sees only later ones)."""
        since_ns = time.time_ns() - int(FRAMES_HISTORY_S * 1e9)
        try:
            headers = await self.bus.engine.stored_headers(
                frames_stream(self.spec), since_ns=since_ns, timeout_s=FRAMES_SYNC_TIMEOUT_S
            )
        except (TimeoutError, BusConnectionError) as err:
            self.sync_timeouts += 1
            _log.warning(
                "could not read the frames published before this worker started (%s): a bucket "
                "handed over from a crashed worker may be published twice",
                err or type(err).__name__,
            )
            return
        for header in headers:
            self._mark_published(header.bucket)

    def _forget_open(self) -> None:
        """Key-shared mode: drop open and recovering buckets without acknowledging their samples
        (the broker hands them whole to whoever owns their slots next)."""
        self.assembler.reset_open()
        self._unacked.clear()
        self._recovering.clear()
        self._recovering_at.clear()

    async def _confirm_handover(self, handed: set[int], former: dict[str, int | None]) -> None:
        """Ring mode, stopping while others ran: wait (at most :data:`HANDOVER_CONFIRM_S`) until
        the frames of the buckets this worker left open are out. If every other worker has left
        meanwhile (they stopped at the same moment), publish those this worker owned in the
        ring it left: of the workers stopping together, the one that bucket hashes highest to
        publishes it, so none is lost, and none is repeated unless they left one by one."""
        ring, sub = self.ring, self._frames_sub
        assert ring is not None and sub is not None  # ring mode tracks the frames stream
        deadline = time.monotonic() + HANDOVER_CONFIRM_S
        pending = sorted(handed)
        while True:
            ring.changed.clear()
            while (sample := sub.recv_nowait()) is not None:
                self._mark_published(sample.bucket)
            pending = [b for b in pending if b not in self._published]
            if not pending or not self._others_alive():
                break
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                _log.info(
                    "%d bucket(s) left to the other workers not yet published after %g s: they own them",
                    len(pending),
                    HANDOVER_CONFIRM_S,
                )
                return
            changed = asyncio.ensure_future(ring.changed.wait())
            got = asyncio.ensure_future(sub.recv())
            await asyncio.wait({changed, got}, timeout=left_s, return_when=asyncio.FIRST_COMPLETED)
            changed.cancel()
            got.cancel()  # no-op if a frame came
            await asyncio.gather(got, return_exceptions=True)
            if not got.cancelled() and got.exception() is None:
                self._mark_published(got.result().bucket)
        for b in pending:
            frame = self._held.pop(b, None)
            if frame is not None and rendezvous_owner(b, former) == ring.worker_id:
                self.published_on_stop += 1
                await self._publish_frame(frame)
        if self.published_on_stop:
            _log.info(
                "the other workers stopped too: published %d bucket(s) left open", self.published_on_stop
            )

    def _others_alive(self) -> bool:
        ring = self.ring
        return ring is not None and any(m != ring.worker_id for m in ring.members())

    async def _finish_slots(self) -> None:
        """Key-shared mode, stopping: with other workers alive, hand the open buckets back whole
        (their samples are not acknowledged, so their new owners get every one of them);
        as the last worker, flush them (the end of the data)."""
        if self._others_alive():
            self.handed_back = len(self.assembler.open_bucket_ids) + len(self._recovering)
            self._forget_open()
            return
        async with self._handling:
            await self._handle(self.assembler.flush())
            if self._recovering:
                await self._recover(quiet_s=0.0)

    async def run(self, stop: asyncio.Event) -> None:
        """Subscribe, fuse until ``stop`` is set, flush and publish what is left."""
        opts = SubscriptionOptions(capacity=self._capacity, backpressure=Backpressure.BLOCK)
        clock = self.spec.clock
        self._frames_pub = await self.bus.publisher(
            frames_stream(self.spec),
            modality=Modality.FRAME,
            encoding=FRAME_ENCODING,
            clock=clock,
            options=PublisherOptions(backpressure=Backpressure.BLOCK),
        )
        self._late_pub = await self.bus.publisher(
            frames_stream(self.spec) + "/late",
            clock=clock,
            options=PublisherOptions(backpressure=Backpressure.BLOCK),
        )
        tasks: list[asyncio.Task[None]] = []
        slots_task: asyncio.Task[None] | None = None
        inputs = tuple(s.name for s in self.spec.streams)
        if self._mode is not None:
            self.ring = OwnershipRing(self.bus, self.spec.name, self._worker_id)
            frames_sub = self._frames_sub = await self.bus.subscribe(frames_stream(self.spec), options=opts)
            self._subs.append(frames_sub)
            tasks.append(asyncio.create_task(self._track_published(frames_sub)))
        if self._mode == "ring":
            assert self.ring is not None
            tasks.append(asyncio.create_task(self._take_over()))
            if not await self.ring.watch():
                await self.ring.join(None)  # first worker: own everything from the start
            self._subs.append(await self.bus.subscribe(inputs, options=opts))
            tasks.append(asyncio.create_task(self._pump(self._subs[-1])))
        elif self._mode == "key-shared":
            assert self.ring is not None
            await self._take_in_recent_frames()
            await self.ring.watch()
            await self.ring.join(None)
            slots_task = asyncio.create_task(self._key_shared(stop, inputs))
            tasks.append(slots_task)
        else:
            self._subs.append(await self.bus.subscribe(inputs, options=opts))
            tasks.append(asyncio.create_task(self._pump(self._subs[-1])))
        self.ready.set()
        try:
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), min(0.1, self._idle_flush_s / 2))
                except TimeoutError:
                    pass
                if self.bus.closed:  # the program closed the bus first: nothing in, nothing out
                    raise BusClosedError(
                        f"fusion worker of {self.spec.name!r}: its bus was closed while it ran; it "
                        f"stopped with {len(self.assembler.open_bucket_ids)} open bucket(s) unpublished"
                    )
                for t in tasks:
                    if t.done() and not t.cancelled() and t.exception() is not None:
                        raise t.exception()  # type: ignore[misc]
                async with self._handling:
                    if self._recovering:
                        await self._recover()
                    if (
                        self.assembler.open_buckets
                        and time.monotonic() - self._last_input > self._idle_flush_s
                    ):
                        await self._handle(self.assembler.flush())
        finally:
            if self.bus.closed:  # nothing can be published or handed over any more
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            else:
                await self._wind_down(stop, tasks, slots_task)

    async def _wind_down(
        self, stop: asyncio.Event, tasks: list[asyncio.Task[None]], slots_task: asyncio.Task[None] | None
    ) -> None:
        """Stopping on an open bus: hand over or publish what is open, then flush."""
        handed: set[int] = set()  # open buckets left to the other ring workers on stopping
        former: dict[str, int | None] = {}  # the ring this worker left
        if slots_task is not None and stop.is_set():
            # it hands its open buckets back (or flushes them) and closes its consumer
            await asyncio.wait([slots_task], timeout=CLOSE_TIMEOUT_S)
        elif self._mode == "ring" and self._others_alive():
            # leaving a running ring: the others own this worker's buckets from now on and
            # publish them whole (every worker has every sample); _confirm_handover below
            # covers the others stopping at the same moment
            assert self.ring is not None
            former = self.ring.members()
            await self.ring.leave(keep_watching=True)
            handed = set(self.assembler.open_bucket_ids)
            self.handed_back = len(handed)
            if self.handed_back:
                _log.info("left the ring with %d open bucket(s) to the other workers", self.handed_back)
        for s in self._subs:
            if s is not self._frames_sub:  # still read by the last frames' handover checks
                await s.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._handle(self.assembler.flush())  # a ring leaver's frames are held
        if handed:
            await self._confirm_handover(handed, former)
        if self._recovering:
            await self._recover(quiet_s=0.0)
        if self._frames_sub is not None:
            await self._frames_sub.close()
        if self.ring is not None:
            await self.ring.close()
        assert self._frames_pub is not None and self._late_pub is not None  # made by run()
        await self._frames_pub.flush()
        await self._late_pub.flush()

    def summary(self) -> dict[str, Any]:
        """Metrics plus assembler counters."""
        s = self.assembler.stats
        out = {
            **self.metrics.as_dict(),
            "samples": s.samples,
            "duplicates": s.duplicates,
            "stamp_fallbacks": s.stamp_fallbacks,
            "unused": s.unused,
            "forced": s.forced,
        }
        if self.ring is not None:
            out.update(
                worker=self.ring.worker_id,
                skipped=self.skipped,
                taken_over=self.taken_over,
                handed_back=self.handed_back,
                published_on_stop=self.published_on_stop,
            )
        if self._mode == "key-shared":
            out.update(
                slots=[list(r) for r in self.slots],
                reassignments=self.reassignments,
                recovered=self.recovered,
                already_published=self.already_published,
                sync_timeouts=self.sync_timeouts,
            )
        return out
