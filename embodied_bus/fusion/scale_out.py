"""How fusion workers share the work: one worker alone, or a group (see
:mod:`embodied_bus.fusion.ownership`).

A :class:`ScaleOut` is the part of a :class:`~embodied_bus.fusion.worker.FusionWorker` that
differs between modes: what it subscribes to, which samples reach its assembler, which frames
it publishes, and how it leaves. :class:`Ring` (every worker receives everything, the owner of
a bucket publishes it: Zenoh) lives here; :class:`~embodied_bus.fusion.key_shared.KeyShared`
(each worker receives only its buckets: Pulsar Key_Shared) in its own module.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from embodied_bus.fusion.frame import MultiModalFrame
from embodied_bus.fusion.ownership import OwnershipRing, rendezvous_owner
from embodied_bus.fusion.spec import SpecError
from embodied_bus.model.sample import Sample
from embodied_bus.streams.subscriber import Subscription

if TYPE_CHECKING:
    from embodied_bus.fusion.worker import FusionWorker

__all__ = [
    "HANDOVER_CONFIRM_S",
    "Admission",
    "Grouped",
    "RecentBuckets",
    "Ring",
    "ScaleOut",
    "ScaleOutMode",
    "Single",
]

_log = logging.getLogger("embodied_bus.fusion")

#: Longest wait of a worker leaving a running ring for the others to publish the buckets it left
#: open (it publishes them itself if every other worker left meanwhile), seconds.
HANDOVER_CONFIRM_S = 2.0
#: Recent buckets remembered for ring bookkeeping.
RECENT_BUCKETS = 512


class ScaleOutMode(str, enum.Enum):
    """How several fusion workers of one spec share the buckets."""

    #: Every worker receives everything; the owner of a bucket publishes it (Zenoh).
    RING = "ring"
    #: Each worker receives only its buckets through Pulsar Key_Shared STICKY slots and
    #: acknowledges them after their frame.
    KEY_SHARED = "key-shared"

    @classmethod
    def of(cls, value: ScaleOutMode | str | None) -> ScaleOutMode | None:
        """The mode named by ``value`` (None: one worker alone).

        Raises:
            SpecError: An unknown name.
        """
        if value is None or isinstance(value, ScaleOutMode):
            return value
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(repr(m.value) for m in cls)
            raise SpecError(f"scale_out must be None, {names}; got {value!r}") from None


class Admission(enum.Enum):
    """What a worker does with a sample that arrived."""

    #: Into the assembler: the sample's bucket is this worker's to assemble.
    ASSEMBLE = enum.auto()
    #: Into the assembler as context only: another worker's bucket, kept for the picks of this
    #: worker's buckets that reach past their edges.
    CONTEXT = enum.auto()
    #: Kept aside or dropped by the scale-out mode.
    HELD = enum.auto()


class RecentBuckets:
    """The most recent buckets seen (bounded, oldest forgotten first)."""

    def __init__(self, limit: int = RECENT_BUCKETS) -> None:
        self._buckets: OrderedDict[int, None] = OrderedDict()
        self._limit = limit

    def add(self, bucket: int) -> None:
        self._buckets[bucket] = None
        self._buckets.move_to_end(bucket)
        while len(self._buckets) > self._limit:
            self._buckets.popitem(last=False)

    def __contains__(self, bucket: object) -> bool:
        return bucket in self._buckets

    def __iter__(self) -> Any:
        return iter(list(self._buckets))

    def __len__(self) -> int:
        return len(self._buckets)


class ScaleOut:
    """One worker alone: it receives every input sample and publishes every frame.

    Subclasses change the hooks the worker calls; each default is the single worker's.
    """

    #: The worker group (None for a single worker).
    ring: OwnershipRing | None = None

    def __init__(self, worker: FusionWorker) -> None:
        self.worker = worker

    async def start(self, inputs: tuple[str, ...], stop: asyncio.Event) -> list[asyncio.Task[None]]:
        """Subscribe and start the background tasks (ended when the worker stops)."""
        w = self.worker
        return [asyncio.create_task(w.pump(await w.subscribe(inputs)))]

    async def admit(self, sample: Sample) -> Admission:
        """Where the sample goes: to the assembler, as context, or kept aside by this mode."""
        return Admission.ASSEMBLE

    async def after_push(self, sample: Sample) -> None:
        """Called after a sample went to the assembler, before its events are handled."""

    async def should_publish(self, frame: MultiModalFrame) -> bool:
        """Whether this worker publishes the frame (a mode may hold or skip it)."""
        return True

    def mark_published(self, bucket: int) -> None:
        """Called as this worker publishes the frame of a bucket."""

    async def published(self, frame: MultiModalFrame) -> None:
        """Called after a frame of the assembler was published."""

    def owns(self, bucket: int) -> bool:
        """Whether late samples of the bucket are this worker's to publish."""
        return True

    def dropped(self, bucket: int) -> None:
        """Called when the assembler dropped an incomplete bucket."""

    async def tick(self) -> None:
        """Called about every 0.1 s (with the worker's handling lock held)."""

    async def leave(self, stop: asyncio.Event) -> set[int]:
        """Stopping on an open bus, before the subscriptions close: hand work over. Returns the
        open buckets left to other workers."""
        return set()

    async def after_flush(self, handed: set[int]) -> None:
        """After the last flush: make sure the buckets handed over are out."""

    async def close(self) -> None:
        """Release what :meth:`start` opened besides the worker's subscriptions."""

    def summary(self) -> dict[str, Any]:
        """Counters of this mode, for :meth:`FusionWorker.summary`."""
        return {}


class Single(ScaleOut):
    """One worker alone."""


class Grouped(ScaleOut):
    """A worker in a group: a membership ring, and the frames stream tracked so that no
    bucket is published twice."""

    def __init__(self, worker: FusionWorker, worker_id: str | None) -> None:
        super().__init__(worker)
        self.worker_id = worker_id
        #: Buckets whose frame some worker of the group published (recent, bounded).
        self.published_buckets = RecentBuckets()
        self.frames_sub: Subscription | None = None
        #: Frames not published because another worker already had.
        self.skipped = 0
        #: Open buckets handed back whole to the other workers when this one stopped.
        self.handed_back = 0

    async def start(self, inputs: tuple[str, ...], stop: asyncio.Event) -> list[asyncio.Task[None]]:
        w = self.worker
        self.ring = OwnershipRing(w.bus, w.spec.name, self.worker_id)
        self.frames_sub = await w.bus.subscribe(w.frames_stream, options=w.subscription_options)
        return [asyncio.create_task(self._track_published(self.frames_sub))]

    def mark_published(self, bucket: int) -> None:
        self.published_buckets.add(bucket)

    async def _track_published(self, sub: Subscription) -> None:
        async for sample in sub:
            self.published_buckets.add(sample.bucket)

    def others_alive(self) -> bool:
        ring = self.ring
        return ring is not None and any(m != ring.worker_id for m in ring.members())

    async def close(self) -> None:
        if self.frames_sub is not None:
            await self.frames_sub.close()
        if self.ring is not None:
            await self.ring.close()

    def summary(self) -> dict[str, Any]:
        assert self.ring is not None
        return {"worker": self.ring.worker_id, "skipped": self.skipped, "handed_back": self.handed_back}


class Ring(Grouped):
    """Every worker receives every sample; the owner of a bucket publishes its frame, the
    others hold it to publish if the owner leaves."""

    def __init__(self, worker: FusionWorker, worker_id: str | None, join_margin_buckets: int) -> None:
        super().__init__(worker, worker_id)
        self.margin = join_margin_buckets
        self._joining = False
        #: Frames this worker assembled but another member owned (for takeover).
        self.held: OrderedDict[int, MultiModalFrame] = OrderedDict()
        #: Frames published on behalf of a worker that left.
        self.taken_over = 0
        #: Of the buckets handed back on stopping, those this worker published after all
        #: because the others stopped too.
        self.published_on_stop = 0
        self._former: dict[str, int | None] = {}

    async def start(self, inputs: tuple[str, ...], stop: asyncio.Event) -> list[asyncio.Task[None]]:
        tasks = await super().start(inputs, stop)
        assert self.ring is not None
        tasks.append(asyncio.create_task(self._take_over()))
        if not await self.ring.watch():
            await self.ring.join(None)  # first worker: own everything from the start
        w = self.worker
        tasks.append(asyncio.create_task(w.pump(await w.subscribe(inputs))))
        return tasks

    async def after_push(self, sample: Sample) -> None:
        ring = self.ring
        if ring is not None and not self._joining and ring.joined_from is None and not ring.joined:
            # Joining a running ring: own buckets from a little ahead of the current event time.
            self._joining = True
            await ring.join(self.worker.spec.clock.bucket_of(sample.stamp_ns) + self.margin)

    async def should_publish(self, frame: MultiModalFrame) -> bool:
        assert self.ring is not None
        if frame.pane == 0 and frame.bucket in self.published_buckets:
            self.skipped += 1
            return False
        if not self.ring.owns(frame.bucket):
            if frame.pane == 0:
                self.held[frame.bucket] = frame
                while len(self.held) > RECENT_BUCKETS:
                    self.held.popitem(last=False)
            return False
        return True

    def owns(self, bucket: int) -> bool:
        return self.ring is not None and self.ring.owns(bucket)

    async def _take_over(self) -> None:
        assert self.ring is not None
        while True:
            await self.ring.departures.get()
            for bucket, frame in list(self.held.items()):
                if bucket not in self.published_buckets and self.ring.owns(bucket):
                    del self.held[bucket]
                    self.taken_over += 1
                    await self.worker.publish_frame(frame)

    async def leave(self, stop: asyncio.Event) -> set[int]:
        """Leaving a running ring: the others own this worker's buckets from now on and publish
        them whole (every worker has every sample); :meth:`after_flush` covers the others
        stopping at the same moment."""
        if not self.others_alive():
            return set()
        assert self.ring is not None
        self._former = self.ring.members()
        await self.ring.leave(keep_watching=True)
        handed = set(self.worker.assembler.open_bucket_ids)
        self.handed_back = len(handed)
        if handed:
            _log.info("left the ring with %d open bucket(s) to the other workers", len(handed))
        return handed

    async def after_flush(self, handed: set[int]) -> None:
        """Wait (at most :data:`HANDOVER_CONFIRM_S`) until the frames of the buckets this
        worker left open are out. If every other worker has left meanwhile (they stopped at
        the same moment), publish those this worker owned in the ring it left: of the workers
        stopping together, the one that bucket hashes highest to publishes it, so none is lost,
        and none is repeated unless they left one by one."""
        if not handed:
            return
        pending = await self._await_published(sorted(handed))
        if pending is None:
            return
        assert self.ring is not None
        for b in pending:
            frame = self.held.pop(b, None)
            if frame is not None and rendezvous_owner(b, self._former) == self.ring.worker_id:
                self.published_on_stop += 1
                await self.worker.publish_frame(frame)
        if self.published_on_stop:
            _log.info(
                "the other workers stopped too: published %d bucket(s) left open", self.published_on_stop
            )

    async def _await_published(self, pending: list[int]) -> list[int] | None:
        """The buckets of ``pending`` still unpublished once every other worker left (None:
        the others are alive and own them, or were given :data:`HANDOVER_CONFIRM_S`)."""
        ring, sub = self.ring, self.frames_sub
        assert ring is not None and sub is not None
        deadline = time.monotonic() + HANDOVER_CONFIRM_S
        while True:
            ring.changed.clear()
            while (sample := sub.recv_nowait()) is not None:
                self.published_buckets.add(sample.bucket)
            pending = [b for b in pending if b not in self.published_buckets]
            if not pending or not self.others_alive():
                return pending
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                _log.info(
                    "%d bucket(s) left to the other workers not yet published after %g s: they own them",
                    len(pending),
                    HANDOVER_CONFIRM_S,
                )
                return None
            changed = asyncio.ensure_future(ring.changed.wait())
            got = asyncio.ensure_future(sub.recv())
            await asyncio.wait({changed, got}, timeout=left_s, return_when=asyncio.FIRST_COMPLETED)
            changed.cancel()
            got.cancel()  # no-op if a frame came
            await asyncio.gather(got, return_exceptions=True)
            if not got.cancelled() and got.exception() is None:
                self.published_buckets.add(got.result().bucket)

    def summary(self) -> dict[str, Any]:
        return {
            **super().summary(),
            "taken_over": self.taken_over,
            "published_on_stop": self.published_on_stop,
        }
