"""How fusion workers share the work: one worker alone, or a group (see
:mod:`embodied_bus.fusion.ownership`).

A :class:`ScaleOut` is the part of a :class:`~embodied_bus.fusion.worker.FusionWorker` that
differs between modes: which frames it publishes, what it keeps for the others, and how it
leaves. Every worker of a group receives every sample and assembles every frame, so the frames
are the same whoever publishes them. :class:`Ring` (the owner of a bucket publishes its frames:
Zenoh) lives here; :class:`~embodied_bus.fusion.key_shared.KeyShared` (the reference samples
dealt by Pulsar Key_Shared are the durable list of frames to publish) in its own module.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from embodied_bus.bus import Bus
from embodied_bus.fusion.assembler import Assembler, Event
from embodied_bus.fusion.frame import MultiModalFrame
from embodied_bus.fusion.inputs import AlignedInputs
from embodied_bus.fusion.ownership import OwnershipRing, rendezvous_owner
from embodied_bus.fusion.spec import FusionSpec, SpecError
from embodied_bus.model.qos import SubscriptionOptions
from embodied_bus.model.sample import Sample
from embodied_bus.streams.subscriber import Subscription

__all__ = [
    "COLD_SETTLE_S",
    "HANDOVER_CONFIRM_S",
    "HELD_FRAMES_S",
    "REFRESH_S",
    "TAKEOVER_GRACE_S",
    "Grouped",
    "HeldFrames",
    "RecentFrames",
    "Ring",
    "ScaleOut",
    "ScaleOutMode",
    "Single",
    "WorkerPort",
]

_log = logging.getLogger("embodied_bus.fusion")

#: Longest wait of a worker leaving a running ring for the others to publish the buckets it left
#: open (it publishes them itself if every other worker left meanwhile), seconds.
HANDOVER_CONFIRM_S = 2.0
#: How long a ring worker that joined from the start waits to see the others that did too
#: before it takes its first sample, seconds.
COLD_SETTLE_S = 0.5
#: How long a ring worker lets the frames a departed worker sent arrive before it publishes
#: the ones it did not, seconds.
TAKEOVER_GRACE_S = 0.3
#: How often a ring worker asks the group who is alive, in seconds.
REFRESH_S = 1.0
#: Recent frames remembered for group bookkeeping.
RECENT_FRAMES = 4096
#: Frames another worker publishes are held at most this long (wall clock) in case it dies,
#: seconds.
HELD_FRAMES_S = 30.0


class WorkerPort(Protocol):
    """The part of a :class:`~embodied_bus.fusion.worker.FusionWorker` a scale-out mode uses."""

    @property
    def bus(self) -> Bus:
        """The bus the worker reads and publishes on."""
        ...

    @property
    def spec(self) -> FusionSpec:
        """The fusion spec."""
        ...

    @property
    def frames_stream(self) -> str:
        """Where the frames go."""
        ...

    @property
    def subscription_options(self) -> SubscriptionOptions:
        """Options of the worker's lossless subscriptions."""
        ...

    @property
    def assembler(self) -> Assembler:
        """The worker's assembler (touched only while holding :attr:`handling`)."""
        ...

    @property
    def handling(self) -> asyncio.Lock:
        """Held while samples are handed to the assembler or frames taken from it."""
        ...

    async def publish_frame(self, frame: MultiModalFrame) -> None:
        """Publish one frame."""
        ...

    async def flush_frames(self) -> None:
        """Wait until the frames published so far are out."""
        ...

    async def open_inputs(self, streams: tuple[str, ...]) -> AlignedInputs:
        """One lossless subscription per input stream, taken in stamp order across them."""
        ...

    async def pump(self, inputs: AlignedInputs) -> None:
        """Feed every input sample to the assembler."""
        ...

    async def handle(self, events: list[Event]) -> None:
        """Publish what the assembler emitted, as the scale-out mode says."""
        ...


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


class RecentFrames:
    """Identities (reference stamps) of the most recent frames seen (bounded, oldest forgotten
    first)."""

    def __init__(self, limit: int = RECENT_FRAMES) -> None:
        self._keys: OrderedDict[int, None] = OrderedDict()
        self._limit = limit

    def add(self, key: int) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self._limit:
            self._keys.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)


class HeldFrames:
    """Frames this worker assembled but another worker publishes, kept to publish them if that
    worker dies or leaves, by reference stamp. A frame seen on the frames stream is let go at
    once, so only frames not yet out are held: for at most :data:`HELD_FRAMES_S` (wall clock:
    the time a dead worker takes to be noticed) and :data:`RECENT_FRAMES` frames."""

    def __init__(self) -> None:
        self._frames: OrderedDict[int, tuple[MultiModalFrame, float]] = OrderedDict()

    def add(self, frame: MultiModalFrame) -> None:
        now = time.monotonic()
        self._frames[frame.reference_stamp_ns] = (frame, now)
        floor = now - HELD_FRAMES_S
        frames = self._frames
        while frames and (len(frames) > RECENT_FRAMES or next(iter(frames.values()))[1] < floor):
            frames.popitem(last=False)

    def pop(self, key: int) -> MultiModalFrame | None:
        held = self._frames.pop(key, None)
        return None if held is None else held[0]

    def __contains__(self, key: object) -> bool:
        return key in self._frames

    def frames(self) -> list[MultiModalFrame]:
        """The held frames, oldest first."""
        return [f for f, _ in self._frames.values()]


class ScaleOut:
    """One worker alone: it receives every input sample and publishes every frame.

    Subclasses change the hooks the worker calls; each default is the single worker's. In every
    mode each worker assembles every frame from every sample (so any worker can stand in for
    another with the very same frames); the modes differ in who publishes which frame.
    """

    #: The worker group (None for a single worker).
    ring: OwnershipRing | None = None
    #: Whether :meth:`after_push` does anything (it is not called otherwise).
    needs_after_push = False

    def __init__(self, worker: WorkerPort) -> None:
        self.worker = worker

    async def start(self, inputs: tuple[str, ...], stop: asyncio.Event) -> list[asyncio.Task[None]]:
        """Subscribe and start the background tasks (ended when the worker stops)."""
        w = self.worker
        return [asyncio.create_task(w.pump(await w.open_inputs(inputs)))]

    async def after_push(self, sample: Sample) -> None:
        """Called after a sample went to the assembler, before its events are handled."""

    async def should_publish(self, frame: MultiModalFrame) -> bool:
        """Whether this worker publishes the frame (a mode may hold or skip it)."""
        return True

    def mark_published(self, key: int) -> None:
        """Called as this worker publishes the frame anchored at ``key``."""

    async def published(self, frame: MultiModalFrame) -> None:
        """Called after a frame of the assembler was published."""

    def owns(self, bucket: int) -> bool:
        """Whether late samples of the bucket are this worker's to publish."""
        return True

    def dropped(self, key: int) -> None:
        """Called when the assembler dropped an incomplete frame."""

    async def tick(self) -> None:
        """Called about every 0.1 s (with the worker's handling lock held)."""

    async def leave(self, stop: asyncio.Event) -> set[int]:
        """Stopping on an open bus, before the subscriptions close: hand work over. Returns the
        frames (reference stamps) left to other workers."""
        return set()

    async def after_flush(self, handed: set[int]) -> None:
        """After the last flush: make sure the frames handed over are out."""

    async def close(self) -> None:
        """Release what :meth:`start` opened besides the worker's subscriptions."""

    def summary(self) -> dict[str, Any]:
        """Counters of this mode, for :meth:`FusionWorker.summary`."""
        return {}


class Single(ScaleOut):
    """One worker alone."""


class Grouped(ScaleOut):
    """A worker in a group: a membership, the frames stream tracked so that no frame is
    published twice, and the frames others publish held for when one of them dies."""

    def __init__(self, worker: WorkerPort, worker_id: str | None) -> None:
        super().__init__(worker)
        self.worker_id = worker_id
        #: Frames (reference stamps) some worker of the group published (recent, bounded).
        self.published_frames = RecentFrames()
        #: Frames assembled here that another worker publishes.
        self.held = HeldFrames()
        self.frames_sub: Subscription | None = None
        #: Frames not published because another worker already had.
        self.skipped = 0
        #: Held frames published because their publisher died or left.
        self.taken_over = 0
        #: Frames pending here that were left to the other workers when this one stopped.
        self.handed_back = 0

    async def start(self, inputs: tuple[str, ...], stop: asyncio.Event) -> list[asyncio.Task[None]]:
        w = self.worker
        self.ring = OwnershipRing(w.bus, w.spec.name, self.worker_id)
        self.frames_sub = await w.bus.subscribe(w.frames_stream, options=w.subscription_options)
        return [asyncio.create_task(self._track_published(self.frames_sub))]

    def mark_published(self, key: int) -> None:
        self.published_frames.add(key)

    def saw_published(self, key: int) -> None:
        """A frame is on the frames stream: never publish it here, stop holding it."""
        self.published_frames.add(key)
        self.held.pop(key)

    async def _track_published(self, sub: Subscription) -> None:
        async for sample in sub:
            self.saw_published(sample.stamp_ns)

    def drain_published(self) -> None:
        """Take in the frames the tracking subscription has received so far."""
        sub = self.frames_sub
        if sub is not None:
            while (sample := sub.recv_nowait()) is not None:
                self.saw_published(sample.stamp_ns)

    def hold(self, frame: MultiModalFrame) -> None:
        if frame.pane == 0:
            self.held.add(frame)

    async def publish_held(self, mine: Callable[[MultiModalFrame], bool]) -> None:
        """Publish the held frames that are now this worker's and that no worker published."""
        self.drain_published()
        for frame in self.held.frames():
            key = frame.reference_stamp_ns
            if key in self.published_frames:
                self.held.pop(key)
            elif mine(frame):
                self.held.pop(key)
                self.taken_over += 1
                await self.worker.publish_frame(frame)
                await self.published(frame)

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
        return {
            "worker": self.ring.worker_id,
            "skipped": self.skipped,
            "taken_over": self.taken_over,
            "handed_back": self.handed_back,
        }


class Ring(Grouped):
    """Every worker receives every sample; the owner of a frame's bucket publishes it, the
    others hold it to publish if the owner leaves or dies."""

    needs_after_push = True

    def __init__(self, worker: WorkerPort, worker_id: str | None, join_margin_buckets: int) -> None:
        super().__init__(worker, worker_id)
        self.margin = join_margin_buckets
        self._joining = False
        #: Of the frames handed back on stopping, those this worker published after all
        #: because the others stopped too.
        self.published_on_stop = 0
        self._former: dict[str, int | None] = {}

    async def start(self, inputs: tuple[str, ...], stop: asyncio.Event) -> list[asyncio.Task[None]]:
        tasks = await super().start(inputs, stop)
        assert self.ring is not None
        tasks.append(asyncio.create_task(self._take_over()))
        if self._starting_together(await self.ring.watch()):
            await self.ring.join(None)  # own everything from the start, as the others do
            # workers started together may each have found no other and joined from the start
            # too: see them before the first frame, so that each bucket has one owner (and ask
            # the group once more: a join announced while the peers were still meeting can be
            # missed by the watch)
            await asyncio.sleep(COLD_SETTLE_S)
            await self.ring.refresh()
        w = self.worker
        tasks.append(asyncio.create_task(self._refresh_members()))
        tasks.append(asyncio.create_task(w.pump(await w.open_inputs(inputs))))
        return tasks

    async def _refresh_members(self) -> None:
        """Ask the group who is alive every :data:`REFRESH_S`, so a join this worker missed
        (announced while the peers were still meeting) is seen within that."""
        assert self.ring is not None
        while True:
            await asyncio.sleep(REFRESH_S)
            await self.ring.refresh()

    def _starting_together(self, others: list[str]) -> bool:
        """Whether this worker joins from the start: no other is there, or every other joined
        from the start and no frame has come yet (they started a moment before this one,
        before any data). Joining a running ring from an event time a margin ahead instead
        relies on that margin lasting longer than the news of the join takes to spread, which a
        replay at full speed outruns."""
        assert self.ring is not None
        if not others:
            return True
        self.drain_published()
        members = self.ring.members()
        return not self.published_frames and all(members.get(m) is None for m in others)

    async def after_push(self, sample: Sample) -> None:
        ring = self.ring
        if ring is not None and not self._joining and ring.joined_from is None and not ring.joined:
            # Joining a running ring: own buckets from a little ahead of the current event time.
            self._joining = True
            await ring.join(self.worker.spec.clock.bucket_of(sample.stamp_ns) + self.margin)

    async def should_publish(self, frame: MultiModalFrame) -> bool:
        assert self.ring is not None
        if frame.pane == 0 and frame.reference_stamp_ns in self.published_frames:
            self.skipped += 1
            return False
        if not self.ring.owns(frame.bucket):
            self.hold(frame)
            return False
        return True

    def owns(self, bucket: int) -> bool:
        return self.ring is not None and self.ring.owns(bucket)

    async def _take_over(self) -> None:
        ring = self.ring
        assert ring is not None
        while True:
            await ring.departures.get()
            # frames the departed worker sent just before it died are still on their way to
            # the frames stream: let them arrive, so none of them is published a second time
            await asyncio.sleep(TAKEOVER_GRACE_S)
            async with self.worker.handling:
                await self.publish_held(lambda f: ring.owns(f.bucket))

    async def leave(self, stop: asyncio.Event) -> set[int]:
        """Leaving a running ring: the others own this worker's buckets from now on and publish
        them whole (every worker has every sample); :meth:`after_flush` covers the others
        stopping at the same moment."""
        if not self.others_alive():
            return set()
        assert self.ring is not None
        self._former = self.ring.members()
        await self.ring.leave(keep_watching=True)
        handed = set(self.worker.assembler.pending_stamps)
        self.handed_back = len(handed)
        if handed:
            _log.info("left the ring with %d pending frame(s) to the other workers", len(handed))
        return handed

    async def after_flush(self, handed: set[int]) -> None:
        """Wait (at most :data:`HANDOVER_CONFIRM_S`) until the frames this worker left pending
        are out. If every other worker has left meanwhile (they stopped at the same moment),
        publish those this worker owned in the ring it left: of the workers stopping together,
        the one that bucket hashes highest to publishes it, so none is lost, and none is
        repeated unless they left one by one."""
        if not handed:
            return
        pending = await self._await_published(sorted(handed))
        if pending is None:
            return
        assert self.ring is not None
        for key in pending:
            frame = self.held.pop(key)
            if frame is not None and rendezvous_owner(frame.bucket, self._former) == self.ring.worker_id:
                self.published_on_stop += 1
                await self.worker.publish_frame(frame)
        if self.published_on_stop:
            _log.info(
                "the other workers stopped too: published %d frame(s) left pending", self.published_on_stop
            )

    async def _await_published(self, pending: list[int]) -> list[int] | None:
        """The frames of ``pending`` still unpublished once every other worker left (None: the
        others are alive and own them, or were given :data:`HANDOVER_CONFIRM_S`)."""
        ring, sub = self.ring, self.frames_sub
        assert ring is not None and sub is not None
        deadline = time.monotonic() + HANDOVER_CONFIRM_S
        while True:
            ring.changed.clear()
            self.drain_published()
            pending = [k for k in pending if k not in self.published_frames]
            if not pending or not self.others_alive():
                return pending
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                _log.info(
                    "%d frame(s) left to the other workers not yet published after %g s: they own them",
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
                self.saw_published(got.result().stamp_ns)

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "published_on_stop": self.published_on_stop}
