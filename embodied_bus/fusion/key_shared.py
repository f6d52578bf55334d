"""Key_Shared scale-out: each worker receives only its buckets (Pulsar Key_Shared STICKY
slots, dealt from the group's membership) and acknowledges their samples once their frame is
out, so a worker that dies or leaves loses no bucket: what it held unacknowledged goes to the
new owner of its slots.

Streams whose picks reach past a bucket's edges (``nearest``, ``hold_last`` and
``interpolate`` members, and any stream with a clock offset) are not shared: every worker
receives all of them, assembles those of its own buckets and keeps the others as context for
its neighbouring buckets, so a frame takes the same members as under the ring or one worker.
The last :data:`CONTEXT_HISTORY_S` of them are kept to assemble buckets handed over by a
worker that died.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from embodied_bus.errors import BusConnectionError
from embodied_bus.fusion.assembler import Assembler, Event
from embodied_bus.fusion.frame import MultiModalFrame
from embodied_bus.fusion.ownership import bucket_slot, in_ranges, slot_ranges
from embodied_bus.fusion.scale_out import RECENT_BUCKETS, Admission, Grouped
from embodied_bus.fusion.spec import FusionSpec, Pick, Role
from embodied_bus.model.qos import Backpressure, SubscriptionOptions
from embodied_bus.model.sample import Sample
from embodied_bus.streams.subscriber import Subscription

if TYPE_CHECKING:
    from embodied_bus.fusion.worker import FusionWorker

__all__ = [
    "CLOSE_TIMEOUT_S",
    "CONTEXT_HISTORY_S",
    "FRAMES_HISTORY_S",
    "FRAMES_SYNC_TIMEOUT_S",
    "GROUP_SETTLE_S",
    "RECOVERY_QUIET_S",
    "KeyShared",
    "context_streams",
]

_log = logging.getLogger("embodied_bus.fusion")

#: Wait for the group's heartbeats before taking slots, seconds.
GROUP_SETTLE_S = 0.6
#: A redelivered bucket is assembled once no sample of it came for this long, or for the spec's
#: lateness bound if that is longer (after a re-deal, the samples a former owner held come back
#: topic by topic, as the broker redelivers them).
RECOVERY_QUIET_S = 0.5
#: Longest wait for the frames stream to catch up before a handed-over bucket is published,
#: seconds (past it the frame is published anyway: at least once).
FRAMES_SYNC_TIMEOUT_S = 5.0
#: Frames published this long before a worker starts are taken in at its start (a worker that
#: crashed just before may not have acknowledged their samples, which may then be dealt to this
#: one), seconds.
FRAMES_HISTORY_S = 10.0
#: Longest wait for a stopping worker to hand back or flush its slots, seconds.
CLOSE_TIMEOUT_S = 10.0
#: Samples of the streams every worker receives are kept this long (event time) beyond the
#: spec's reach, to assemble buckets handed over by a worker that died, seconds.
CONTEXT_HISTORY_S = 10.0


def context_streams(spec: FusionSpec) -> frozenset[str]:
    """The streams a Key_Shared worker needs beyond its own buckets: members picked
    ``nearest``, ``hold_last`` or ``interpolate`` (their window reaches into the neighbouring
    buckets) and streams with a clock offset (bucketed by the publisher without it)."""
    reaching = (Pick.NEAREST, Pick.HOLD_LAST, Pick.INTERPOLATE)
    return frozenset(
        s.name
        for s in spec.streams
        if s.clock_offset_ns or (s.role is not Role.REFERENCE and s.pick in reaching)
    )


class KeyShared(Grouped):
    """Consume this worker's Key_Shared slots, re-dealt whenever the group changes."""

    def __init__(self, worker: FusionWorker, worker_id: str | None) -> None:
        super().__init__(worker, worker_id)
        #: Samples not yet acknowledged, by bucket.
        self.unacked: dict[int, list[Sample]] = {}
        #: The hash ranges consumed now, and how often they were re-dealt.
        self.slots: tuple[tuple[int, int], ...] = ()
        self.reassignments = 0
        #: Redelivered older buckets being collected, and when they last grew (monotonic s).
        self.recovering: dict[int, list[Sample]] = {}
        self.recovering_at: dict[int, float] = {}
        self.emitted_here: set[int] = set()
        #: Until then (monotonic s), samples of one bucket arrive from redeliveries and fresh
        #: sends in any order: they are collected by bucket until they stop coming.
        self.settle_until = 0.0
        #: Until then, frames may be of buckets another worker held before the slots were
        #: re-dealt, and the frames stream is caught up before each is published.
        self.handover_until = 0.0
        #: Samples of buckets another worker had already published, redelivered here after it
        #: left (acknowledged; neither late nor in a frame of this worker).
        self.already_published = 0
        #: Frames published without the frames stream having caught up (broker too slow).
        self.sync_timeouts = 0
        #: Buckets assembled from redelivered samples.
        self.recovered = 0
        #: Shared samples received for a bucket outside this worker's slots (0 unless the
        #: broker hashes keys unlike :func:`~embodied_bus.fusion.ownership.bucket_slot`).
        self.outside_slots = 0
        self._slots_task: asyncio.Task[None] | None = None
        spec = worker.spec
        #: Streams every worker receives whole (see :func:`context_streams`).
        self.context_streams = context_streams(spec)
        #: Their recent samples, oldest first.
        self.context_history: deque[Sample] = deque()
        self._history_ns = worker.assembler.horizon_ns + spec.lateness_ns + int(CONTEXT_HISTORY_S * 1e9)
        self._offsets = {s.name: s.clock_offset_ns for s in spec.streams}

    async def start(self, inputs: tuple[str, ...], stop: asyncio.Event) -> list[asyncio.Task[None]]:
        tasks = await super().start(inputs, stop)
        assert self.ring is not None
        shared = tuple(s for s in inputs if s not in self.context_streams)
        whole = tuple(s for s in inputs if s in self.context_streams)
        if whole:
            tasks.append(asyncio.create_task(self.worker.pump(await self.worker.subscribe(whole))))
        await self._take_in_recent_frames()
        await self.ring.watch()
        await self.ring.join(None)
        self._slots_task = asyncio.create_task(self._consume_slots(stop, shared))
        return [*tasks, self._slots_task]

    def stamp_of(self, sample: Sample) -> int:
        """The sample's stamp as the assembler sees it (clock offset applied), ns."""
        return (sample.stamp_ns or sample.receive_ns) + self._offsets.get(sample.stream, 0)

    def in_slots(self, bucket: int) -> bool:
        """Whether the bucket's samples are dealt to this worker now."""
        return in_ranges(bucket_slot(bucket), self.slots)

    def _admit_context(self, sample: Sample) -> Admission:
        """A sample of a stream every worker receives: assembled if its bucket is this worker's
        (and not being recovered or handed over), else context for the neighbouring buckets."""
        history = self.context_history
        history.append(sample)
        floor = self.stamp_of(sample) - self._history_ns
        while history and self.stamp_of(history[0]) < floor:
            history.popleft()
        b = self.worker.spec.clock.bucket_of(self.stamp_of(sample))
        if b in self.recovering or not self.in_slots(b):
            return Admission.CONTEXT
        if time.monotonic() < self.handover_until and b not in self.worker.assembler.open_bucket_ids:
            # the shared samples of a bucket just dealt here may still be on their way (the
            # broker redelivers them in any order): the bucket opens with its first one
            return Admission.CONTEXT
        return Admission.ASSEMBLE

    async def sync_published(self) -> None:
        """Take in every frame stored on the frames stream so far.

        A worker that let go of its slots (or died) may have published the frame of a bucket
        whose samples it had not yet acknowledged; the samples come back to the new owner, which
        must not publish that bucket again. Reading the frames stream up to its last stored
        message tells for sure, where the tracking subscription alone may lag.
        """
        sub = self.frames_sub
        if sub is None:
            return
        caught_up = await sub.catch_up(FRAMES_SYNC_TIMEOUT_S)
        while (sample := sub.recv_nowait()) is not None:
            self.published_buckets.add(sample.bucket)
        if not caught_up:
            self.sync_timeouts += 1
            _log.warning(
                "frames stream did not catch up within %g s: a handed-over bucket may be published twice",
                FRAMES_SYNC_TIMEOUT_S,
            )

    async def _take_in_recent_frames(self) -> None:
        """Mark the buckets of the frames published in the last :data:`FRAMES_HISTORY_S` before
        this worker started (its tracking subscription sees only later ones)."""
        w = self.worker
        since_ns = time.time_ns() - int(FRAMES_HISTORY_S * 1e9)
        try:
            headers = await w.bus.engine.stored_headers(
                w.frames_stream, since_ns=since_ns, timeout_s=FRAMES_SYNC_TIMEOUT_S
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
            self.published_buckets.add(header.bucket)

    async def admit(self, sample: Sample) -> Admission:
        if sample.stream in self.context_streams:
            return self._admit_context(sample)
        spec = self.worker.spec
        asm = self.worker.assembler
        b = spec.clock.bucket_of(self.stamp_of(sample))
        if not self.in_slots(b):
            if not self.outside_slots:
                _log.warning(
                    "%s sample of bucket %d came outside this worker's slots %s", sample.stream, b, self.slots
                )
            self.outside_slots += 1
        upto, now_ns = asm.emitted_upto, asm.event_time_ns
        behind = (upto is not None and b <= upto) or (
            now_ns is not None and spec.clock.end_ns(b) + spec.lateness_ns <= now_ns
        )
        settling = time.monotonic() < self.settle_until or b in self.recovering
        if (behind or settling) and b not in self.emitted_here and b not in asm.open_bucket_ids:
            if b in self.published_buckets:
                # Another worker published this bucket before the slots moved here: the
                # samples it had not yet acknowledged when it left come back (at least once).
                _log.debug("%s sample for bucket %d published by another worker", sample.stream, b)
                self.already_published += 1
                sample.ack()
                return Admission.HELD
            # An older bucket redelivered from a worker that left or gave up its slot:
            # assemble it on its own once its samples stop arriving.
            self.recovering.setdefault(b, []).append(sample)
            self.recovering_at[b] = time.monotonic()
            return Admission.HELD
        self.unacked.setdefault(b, []).append(sample)
        return Admission.ASSEMBLE

    async def should_publish(self, frame: MultiModalFrame) -> bool:
        if frame.pane != 0:
            return True
        if time.monotonic() < self.handover_until:
            await self.sync_published()
        if frame.bucket in self.published_buckets:
            self.skipped += 1
            self.ack_through(frame.bucket)
            return False
        return True

    def mark_published(self, bucket: int) -> None:
        super().mark_published(bucket)
        self.emitted_here.add(bucket)
        if len(self.emitted_here) > RECENT_BUCKETS:
            self.emitted_here.discard(min(self.emitted_here))

    async def published(self, frame: MultiModalFrame) -> None:
        if frame.pane != 0:
            return
        # persisted before its samples are acknowledged: after a crash in between, the new
        # owner gets the samples again and finds the frame on the frames stream, so the bucket
        # is neither lost nor repeated
        await self.worker.flush_frames()
        self.ack_through(frame.bucket)

    def dropped(self, bucket: int) -> None:
        self.ack_through(bucket)

    def ack_through(self, bucket: int) -> None:
        """Acknowledge every held sample of buckets up to ``bucket`` (their frames are out)."""
        for b in [b for b in self.unacked if b <= bucket]:
            for sample in self.unacked.pop(b):
                sample.ack()

    async def tick(self) -> None:
        if self.recovering:
            await self.recover()

    async def recover(self, quiet_s: float | None = None) -> None:
        """Emit redelivered buckets whose samples stopped arriving ``quiet_s`` ago (default:
        :data:`RECOVERY_QUIET_S` or the lateness bound, whichever is longer)."""
        w = self.worker
        if quiet_s is None:
            quiet_s = max(RECOVERY_QUIET_S, w.spec.lateness_ns / 1e9)
        now = time.monotonic()
        ready = [b for b, t in self.recovering_at.items() if now - t >= quiet_s]
        if ready:
            await self.sync_published()
        for b in ready:
            samples = self.recovering.pop(b)
            del self.recovering_at[b]
            if b not in self.published_buckets:
                events = self._assemble_alone(b, samples)
                for ev in events:
                    if isinstance(ev, MultiModalFrame) and ev.pane == 0 and ev.bucket == b:
                        self.recovered += 1
                        await w.publish_frame(ev)
                await w.flush_frames()  # persisted before the samples are acknowledged
            else:
                self.skipped += 1
            for sample in samples:
                sample.ack()

    def _assemble_alone(self, bucket: int, samples: list[Sample]) -> list[Event]:
        """Assemble one handed-over bucket from its redelivered samples and the context around
        it, in stamp order."""
        clock = self.worker.spec.clock
        asm = Assembler(self.worker.spec)
        reach_ns = asm.horizon_ns + clock.width_ns
        lo, hi = clock.start_ns(bucket) - reach_ns, clock.end_ns(bucket) + reach_ns
        around = [s for s in self.context_history if lo <= self.stamp_of(s) < hi]
        own = {id(s) for s in samples}
        events: list[Event] = []
        for s in sorted([*samples, *around], key=self.stamp_of):
            if id(s) in own or clock.bucket_of(self.stamp_of(s)) == bucket:
                events += asm.push(s)
            else:
                events += asm.push_context(s)
        return events + asm.flush()

    async def _consume_slots(self, stop: asyncio.Event, inputs: tuple[str, ...]) -> None:
        """Consume this worker's slots; re-deal them when the group changes."""
        ring = self.ring
        assert ring is not None
        await asyncio.sleep(GROUP_SETTLE_S)  # let the heartbeats of running workers arrive
        while not stop.is_set():
            ring.changed.clear()
            ranges = slot_ranges(ring.worker_id, ring.members())
            sub: Subscription | None = None
            if ranges and inputs:
                try:
                    sub = await self._subscribe_slots(inputs, ranges)
                except BusConnectionError:
                    # Another worker still holds part of these ranges: it lets go once it sees
                    # the same group; try again shortly.
                    await asyncio.sleep(0.2)
                    continue
            self.slots = ranges
            settle_s = max(RECOVERY_QUIET_S, self.worker.spec.lateness_ns / 1e9)
            self.settle_until = time.monotonic() + settle_s
            self.handover_until = self.settle_until + settle_s + 1.0
            pump = asyncio.create_task(self.worker.pump(sub)) if sub is not None else None
            await self._until_redealt(stop, ranges, pump)
            if pump is not None:  # stop consuming first, between two samples
                async with self.worker.handling:
                    pump.cancel()
                await asyncio.gather(pump, return_exceptions=True)
            # until the next deal no bucket is this one's: whole streams are context only (a
            # bucket opened from them now would go out without its shared samples)
            self.slots = ()
            if stop.is_set():
                await self._finish_slots()  # before the consumer closes: its acks go out
            if sub is not None:
                await sub.close()  # unacknowledged samples (open buckets) go to their new owner
            if stop.is_set():
                return
            self.reassignments += 1
            _log.info("Key_Shared slots re-dealt (was %s)", ranges)
            # Open buckets come back as redeliveries (to us or their new owner): start them over.
            self.forget_open()

    async def _subscribe_slots(
        self, inputs: tuple[str, ...], ranges: tuple[tuple[int, int], ...]
    ) -> Subscription:
        w = self.worker
        opts = SubscriptionOptions(
            capacity=w.subscription_options.capacity,
            backpressure=Backpressure.BLOCK,
            auto_ack=False,
            subscription_name=f"eb-fusion-{w.spec.name.replace('/', '.')}",
            key_shared_ranges=ranges,
        )
        return await w.bus.subscribe(inputs, options=opts)

    async def _until_redealt(
        self, stop: asyncio.Event, ranges: tuple[tuple[int, int], ...], pump: asyncio.Task[None] | None
    ) -> None:
        """Wait until ``stop`` is set or the group's change deals other slots; a failed pump
        ends the worker with its error."""
        ring = self.ring
        assert ring is not None
        while True:
            changed = asyncio.create_task(ring.changed.wait())
            stopped = asyncio.create_task(stop.wait())
            waiting = {changed, stopped} | ({pump} if pump is not None and not pump.done() else set())
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for t in (changed, stopped):
                t.cancel()
            if pump is not None and pump in done:
                pump.result()  # its subscription ended: wait for the next deal or the stop
            if stop.is_set() or slot_ranges(ring.worker_id, ring.members()) != ranges:
                return
            ring.changed.clear()

    def forget_open(self) -> None:
        """Drop open and recovering buckets without acknowledging their samples (the broker
        hands them whole to whoever owns their slots next)."""
        asm = self.worker.assembler
        asm.reset_open()
        for sample in self.context_history:  # what the next buckets reach back to
            asm.push_context(sample)
        self.unacked.clear()
        self.recovering.clear()
        self.recovering_at.clear()

    async def _finish_slots(self) -> None:
        """Stopping: with other workers alive, hand the open buckets back whole (their samples
        are not acknowledged, so their new owners get every one of them); as the last worker,
        flush them (the end of the data)."""
        w = self.worker
        if self.others_alive():
            self.handed_back = len(w.assembler.open_bucket_ids) + len(self.recovering)
            self.forget_open()
            return
        async with w.handling:
            await w.handle(w.assembler.flush())
            if self.recovering:
                await self.recover(quiet_s=0.0)

    async def leave(self, stop: asyncio.Event) -> set[int]:
        if self._slots_task is not None and stop.is_set():
            # it hands its open buckets back (or flushes them) and closes its consumer
            await asyncio.wait([self._slots_task], timeout=CLOSE_TIMEOUT_S)
        return set()

    async def after_flush(self, handed: set[int]) -> None:
        if self.recovering:
            await self.recover(quiet_s=0.0)

    def summary(self) -> dict[str, Any]:
        return {
            **super().summary(),
            "slots": [list(r) for r in self.slots],
            "reassignments": self.reassignments,
            "recovered": self.recovered,
            "outside_slots": self.outside_slots,
            "context": self.worker.assembler.stats.context,
            "already_published": self.already_published,
            "sync_timeouts": self.sync_timeouts,
        }
