"""Key_Shared scale-out on Pulsar: the reference samples, dealt by bucket through Key_Shared
STICKY slots, are the durable list of frames to publish.

Every worker reads every input stream whole and assembles every frame, so the frames are the
same whichever worker publishes them. Each worker also consumes its slots of the reference
stream through one Key_Shared subscription, without acknowledging: a frame whose bucket falls
in its slots is published by it, and the reference sample it was anchored on is acknowledged
once the frame is stored. The frames of other slots are held. When the group changes (a worker
joins, leaves or dies), the slots are re-dealt: the new owner publishes the held frames of its
new slots that no worker published (it reads the frames stream to its end first), and the
broker redelivers the reference samples the former owner had not acknowledged, which the new
owner acknowledges once their frames are out. Nothing is lost when a worker dies, and a frame
a dying worker had published is not published again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from embodied_bus.errors import BusConnectionError
from embodied_bus.fusion.frame import MultiModalFrame
from embodied_bus.fusion.ownership import bucket_slot, in_ranges, slot_ranges
from embodied_bus.fusion.scale_out import Grouped, WorkerPort
from embodied_bus.model.qos import Backpressure, SubscriptionOptions
from embodied_bus.model.sample import Sample
from embodied_bus.streams.subscriber import Subscription

__all__ = [
    "CLOSE_TIMEOUT_S",
    "FRAMES_HISTORY_S",
    "FRAMES_SYNC_TIMEOUT_S",
    "GROUP_SETTLE_S",
    "HANDOVER_S",
    "KeyShared",
]

_log = logging.getLogger("embodied_bus.fusion")

#: Wait for the group's heartbeats before taking slots, seconds.
GROUP_SETTLE_S = 0.6
#: After a re-deal, frames are published only after reading the frames stream to its end for
#: this long (the former owner may have published some of them), seconds.
HANDOVER_S = 2.0
#: Longest wait for the frames stream to catch up before a handed-over frame is published,
#: seconds (past it the frame is published anyway: at least once).
FRAMES_SYNC_TIMEOUT_S = 5.0
#: Frames published this long before a worker starts are taken in at its start (a worker that
#: crashed just before may not have acknowledged their reference samples), seconds.
FRAMES_HISTORY_S = 10.0
#: Longest wait for a stopping worker to hand back its slots, seconds.
CLOSE_TIMEOUT_S = 10.0


class KeyShared(Grouped):
    """Publish the frames of this worker's Key_Shared slots; re-deal them when the group
    changes."""

    def __init__(self, worker: WorkerPort, worker_id: str | None) -> None:
        super().__init__(worker, worker_id)
        #: Reference samples dealt here whose frames are not out yet, by reference stamp.
        self.unacked: dict[int, list[Sample]] = {}
        #: The hash ranges consumed now, and how often they were re-dealt.
        self.slots: tuple[tuple[int, int], ...] = ()
        self.reassignments = 0
        #: Until then (monotonic s), the frames stream is read to its end before a frame is
        #: published (a former owner of the slots may have published it).
        self.handover_until = 0.0
        #: Frames published without the frames stream having caught up (broker too slow).
        self.sync_timeouts = 0
        #: Reference samples dealt here that anchored no frame this worker made: late, a
        #: second sample with an anchor's stamp, or from before this worker started
        #: (acknowledged; their frame, if any, cannot be made here).
        self.not_framed = 0
        #: Shared reference samples received for a bucket outside this worker's slots (0 unless
        #: the broker hashes keys unlike :func:`~embodied_bus.fusion.ownership.bucket_slot`).
        self.outside_slots = 0
        self._slots_task: asyncio.Task[None] | None = None
        self._offset_ns = worker.spec.reference.clock_offset_ns
        self._dropped: set[int] = set()

    async def start(self, inputs: tuple[str, ...], stop: asyncio.Event) -> list[asyncio.Task[None]]:
        tasks = await super().start(inputs, stop)
        assert self.ring is not None
        w = self.worker
        tasks.append(asyncio.create_task(w.pump(await w.open_inputs(inputs))))
        await self._take_in_recent_frames()
        await self.ring.watch()
        await self.ring.join(None)
        self._slots_task = asyncio.create_task(self._consume_slots(stop))
        return [*tasks, self._slots_task]

    def in_slots(self, bucket: int) -> bool:
        """Whether the bucket's reference samples are dealt to this worker now."""
        return in_ranges(bucket_slot(bucket), self.slots)

    def _mine(self) -> Callable[[MultiModalFrame], bool]:
        return lambda f: self.in_slots(f.bucket)

    async def sync_published(self) -> None:
        """Take in every frame stored on the frames stream so far.

        A worker that let go of its slots (or died) may have published a frame whose reference
        sample it had not yet acknowledged; the sample comes back to the new owner, which must
        not publish that frame again. Reading the frames stream up to its last stored message
        tells for sure, where the tracking subscription alone may lag.
        """
        sub = self.frames_sub
        if sub is None:
            return
        caught_up = await sub.catch_up(FRAMES_SYNC_TIMEOUT_S)
        self.drain_published()
        if not caught_up:
            self.sync_timeouts += 1
            _log.warning(
                "frames stream did not catch up within %g s: a handed-over frame may be published twice",
                FRAMES_SYNC_TIMEOUT_S,
            )

    async def _take_in_recent_frames(self) -> None:
        """Mark the frames published in the last :data:`FRAMES_HISTORY_S` before this worker
        started (its tracking subscription sees only later ones)."""
        w = self.worker
        since_ns = time.time_ns() - int(FRAMES_HISTORY_S * 1e9)
        try:
            headers = await w.bus.engine.stored_headers(
                w.frames_stream, since_ns=since_ns, timeout_s=FRAMES_SYNC_TIMEOUT_S
            )
        except (TimeoutError, BusConnectionError) as err:
            self.sync_timeouts += 1
            _log.warning(
                "could not read the frames published before this worker started (%s): a frame "
                "handed over from a crashed worker may be published twice",
                err or type(err).__name__,
            )
            return
        for header in headers:
            self.published_frames.add(header.stamp_ns)

    async def should_publish(self, frame: MultiModalFrame) -> bool:
        if frame.pane != 0:
            return True
        if not self.in_slots(frame.bucket):
            self.hold(frame)
            return False
        if time.monotonic() < self.handover_until:
            await self.sync_published()
        if frame.reference_stamp_ns in self.published_frames:
            self.skipped += 1
            self._ack(frame.reference_stamp_ns)
            return False
        return True

    async def published(self, frame: MultiModalFrame) -> None:
        if frame.pane != 0:
            return
        # stored before its reference sample is acknowledged: after a crash in between, the
        # new owner gets the sample again and finds the frame on the frames stream
        await self.worker.flush_frames()
        self._ack(frame.reference_stamp_ns)

    def dropped(self, key: int) -> None:
        self._dropped.add(key)
        if len(self._dropped) > 4096:
            self._dropped.discard(min(self._dropped))
        self._ack(key)

    def owns(self, bucket: int) -> bool:
        return self.in_slots(bucket)

    def _ack(self, key: int) -> None:
        for sample in self.unacked.pop(key, ()):
            sample.ack()

    async def _take_work(self, sub: Subscription) -> None:
        """The reference samples dealt to this worker: acknowledged once their frames are out."""
        handling = self.worker.handling
        async for sample in sub:
            async with handling:
                await self._work(sample)

    async def _work(self, sample: Sample) -> None:
        key = (sample.stamp_ns or sample.receive_ns) + self._offset_ns
        asm = self.worker.assembler
        if not self.in_slots(self.worker.spec.clock.bucket_of(key)):
            if not self.outside_slots:
                _log.warning("reference sample at %d came outside this worker's slots %s", key, self.slots)
            self.outside_slots += 1
        if key in self.published_frames or key in self._dropped:
            sample.ack()
            return
        if key in self.held:
            await self.publish_held(lambda f: f.reference_stamp_ns == key)
            if key in self.published_frames:
                sample.ack()
                return
        upto = asm.emitted_upto_ns
        if upto is None or key > upto or key in asm.pending_stamps:
            self.unacked.setdefault(key, []).append(sample)  # its frame is still to come here
            return
        self.not_framed += 1
        _log.debug("reference sample at %d anchored no frame here (late or before this worker)", key)
        sample.ack()

    async def publish_held(self, mine: Callable[[MultiModalFrame], bool]) -> None:
        if time.monotonic() < self.handover_until:
            await self.sync_published()
        await super().publish_held(mine)

    async def _consume_slots(self, stop: asyncio.Event) -> None:
        """Consume this worker's slots of the reference stream; re-deal them when the group
        changes."""
        ring = self.ring
        assert ring is not None
        await asyncio.sleep(GROUP_SETTLE_S)  # let the heartbeats of running workers arrive
        reference = self.worker.spec.reference.name
        while not stop.is_set():
            ring.changed.clear()
            ranges = slot_ranges(ring.worker_id, ring.members())
            sub: Subscription | None = None
            if ranges:
                try:
                    sub = await self._subscribe_slots(reference, ranges)
                except BusConnectionError:
                    # Another worker still holds part of these ranges: it lets go once it sees
                    # the same group; try again shortly.
                    await asyncio.sleep(0.2)
                    continue
            async with self.worker.handling:
                self.slots = ranges
                self.handover_until = time.monotonic() + HANDOVER_S
                await self.publish_held(self._mine())
            work = asyncio.create_task(self._take_work(sub)) if sub is not None else None
            await self._until_redealt(stop, ranges, work)
            if work is not None:  # stop consuming first, between two samples
                async with self.worker.handling:
                    work.cancel()
                await asyncio.gather(work, return_exceptions=True)
            # until the next deal no frame is this one's
            self.slots = ()
            if stop.is_set():
                await self._finish_slots()  # before the consumer closes: its acks go out
            if sub is not None:
                await sub.close()  # unacknowledged reference samples go to their new owner
            self.unacked.clear()
            if stop.is_set():
                return
            self.reassignments += 1
            _log.info("Key_Shared slots re-dealt (was %s)", ranges)

    async def _subscribe_slots(self, reference: str, ranges: tuple[tuple[int, int], ...]) -> Subscription:
        w = self.worker
        opts = SubscriptionOptions(
            capacity=w.subscription_options.capacity,
            backpressure=Backpressure.BLOCK,
            auto_ack=False,
            subscription_name=f"eb-fusion-{w.spec.name.replace('/', '.')}",
            key_shared_ranges=ranges,
        )
        return await w.bus.subscribe(reference, options=opts)

    async def _until_redealt(
        self, stop: asyncio.Event, ranges: tuple[tuple[int, int], ...], work: asyncio.Task[None] | None
    ) -> None:
        """Wait until ``stop`` is set or the group's change deals other slots; a failed task
        ends the worker with its error."""
        ring = self.ring
        assert ring is not None
        while True:
            changed = asyncio.create_task(ring.changed.wait())
            stopped = asyncio.create_task(stop.wait())
            waiting = {changed, stopped} | ({work} if work is not None and not work.done() else set())
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for t in (changed, stopped):
                t.cancel()
            if work is not None and work in done:
                work.result()  # its subscription ended: wait for the next deal or the stop
            if stop.is_set() or slot_ranges(ring.worker_id, ring.members()) != ranges:
                return
            ring.changed.clear()

    async def _finish_slots(self) -> None:
        """Stopping: with other workers alive, leave the pending frames to them (their reference
        samples are not acknowledged, so the new owners of the slots get them); as the last
        worker, flush them (the end of the data) and publish what is held."""
        w = self.worker
        if self.others_alive():
            self.handed_back = w.assembler.pending_frames
            return
        async with w.handling:
            await w.handle(w.assembler.flush())
            await super().publish_held(lambda f: True)

    async def leave(self, stop: asyncio.Event) -> set[int]:
        if self._slots_task is not None and stop.is_set():
            # it hands its slots back (or flushes) and closes its consumer
            await asyncio.wait([self._slots_task], timeout=CLOSE_TIMEOUT_S)
        return set()

    def summary(self) -> dict[str, Any]:
        return {
            **super().summary(),
            "slots": [list(r) for r in self.slots],
            "reassignments": self.reassignments,
            "outside_slots": self.outside_slots,
            "not_framed": self.not_framed,
            "sync_timeouts": self.sync_timeouts,
        }
