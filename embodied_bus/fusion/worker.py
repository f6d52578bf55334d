"""A fusion worker: subscribes to a spec's input streams, assembles frames, publishes them.

Frames go to the stream ``frames/<spec.name>`` (encoding ``ebframe``, modality FRAME, stamped
with the reference stamp, bucketed with the spec's clock) and late samples, unchanged, to
``frames/<spec.name>/late``. Several workers of one spec share the buckets as their
:class:`~embodied_bus.fusion.scale_out.ScaleOutMode` says.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from embodied_bus.bus import Bus
from embodied_bus.errors import BusClosedError
from embodied_bus.fusion.assembler import Assembler, DroppedFrame, Event, LateSample, StampJump
from embodied_bus.fusion.codec import FRAME_ENCODING, encode_frame
from embodied_bus.fusion.frame import MultiModalFrame
from embodied_bus.fusion.inputs import AlignedInputs
from embodied_bus.fusion.key_shared import FRAMES_HISTORY_S, KeyShared
from embodied_bus.fusion.metrics import FusionMetrics
from embodied_bus.fusion.ownership import OwnershipRing
from embodied_bus.fusion.scale_out import Ring, ScaleOut, ScaleOutMode, Single
from embodied_bus.fusion.spec import FusionSpec
from embodied_bus.model.header import Modality
from embodied_bus.model.qos import Backpressure, PublisherOptions, SubscriptionOptions
from embodied_bus.model.sample import Sample
from embodied_bus.streams.publisher import Publisher
from embodied_bus.streams.subscriber import Subscription

__all__ = [
    "DEFAULT_IDLE_FLUSH_S",
    "FRAMES_HISTORY_S",
    "FusionMetrics",
    "FusionWorker",
    "ScaleOutMode",
    "frames_stream",
]

#: With no input for this long, open buckets are flushed (end of a recording, sensors down).
DEFAULT_IDLE_FLUSH_S = 1.0
#: An input whose subscription reconnected is waited for until it delivers again (what its
#: publishers sent meanwhile comes once they have reconnected too), at most this long (s).
RECONNECT_HOLD_S = 30.0
_log = logging.getLogger("embodied_bus.fusion")


def frames_stream(spec: FusionSpec) -> str:
    """Stream carrying the frames of a spec."""
    return f"frames/{spec.name}"


class FusionWorker:
    """Runs one assembler fed from the bus.

    Args:
        bus: An open bus.
        spec: The fusion spec.
        on_frame: Called with each published frame and its emit time (ns), e.g. to write JSON
            lines.
        capacity: Buffer of each input subscription (lossless ``block`` policy).
        idle_flush_s: Flush open buckets after this long without input.
        scale_out: None (one worker), :attr:`ScaleOutMode.RING` (``"ring"``: Zenoh ownership
            ring, the owner of a bucket publishes its frames) or :attr:`ScaleOutMode.KEY_SHARED`
            (``"key-shared"``: Pulsar Key_Shared STICKY slots of the reference stream, each
            reference sample acknowledged after its frame). Every worker assembles every frame.
            See :mod:`embodied_bus.fusion.scale_out`.
        worker_id: Member id in the worker group (default: random).
        join_margin_buckets: A worker joining a running ring owns buckets from its current
            bucket plus this many (default: the lateness bound in buckets + 3).

    Raises:
        SpecError: An unknown ``scale_out``.
    """

    def __init__(
        self,
        bus: Bus,
        spec: FusionSpec,
        *,
        on_frame: Callable[[MultiModalFrame, int], None] | None = None,
        capacity: int = 4096,
        idle_flush_s: float = DEFAULT_IDLE_FLUSH_S,
        scale_out: ScaleOutMode | str | None = None,
        worker_id: str | None = None,
        join_margin_buckets: int | None = None,
    ) -> None:
        self.bus = bus
        self.spec = spec
        self.frames_stream = frames_stream(spec)
        self.assembler = Assembler(spec)
        self.metrics = FusionMetrics.for_spec(spec)
        self.subscription_options = SubscriptionOptions(capacity=capacity, backpressure=Backpressure.BLOCK)
        self._on_frame = on_frame
        self._idle_flush_s = idle_flush_s
        self._subs: list[Subscription] = []
        self._inputs: AlignedInputs | None = None
        self._input_subs: dict[str, Subscription] = {}
        #: Inputs whose subscription is reconnecting (their frames wait for them).
        self.held: frozenset[str] = frozenset()
        #: input -> (samples it had delivered, when) as last seen disconnected
        self._reconnecting: dict[str, tuple[int, float]] = {}
        self._frames_pub: Publisher | None = None
        self._late_pub: Publisher | None = None
        self._last_input = time.monotonic()
        #: Samples refused for being stamped with another bucket clock, by stream.
        self.foreign_clock: Counter[str] = Counter()
        self.ready = asyncio.Event()
        #: Held while a sample is handled (or buckets are flushed): Key_Shared slots are re-dealt
        #: only between samples, so a frame published is never left with its samples
        #: unacknowledged.
        self.handling = asyncio.Lock()
        mode = ScaleOutMode.of(scale_out)
        margin = (
            join_margin_buckets
            if join_margin_buckets is not None
            else -(-spec.lateness_ns // spec.clock.width_ns) + 3
        )
        #: What differs between one worker and a group: see :mod:`embodied_bus.fusion.scale_out`.
        self.scale_out: ScaleOut = (
            Ring(self, worker_id, margin)
            if mode is ScaleOutMode.RING
            else KeyShared(self, worker_id)
            if mode is ScaleOutMode.KEY_SHARED
            else Single(self)
        )

    @property
    def ring(self) -> OwnershipRing | None:
        """The worker group (None for a worker alone)."""
        return self.scale_out.ring

    async def subscribe(self, streams: tuple[str, ...] | str) -> Subscription:
        """A lossless subscription of this worker, closed when it stops."""
        sub = await self.bus.subscribe(streams, options=self.subscription_options)
        self._subs.append(sub)
        return sub

    async def open_inputs(self, streams: tuple[str, ...]) -> AlignedInputs:
        """One lossless subscription per input stream, taken in stamp order across them."""
        subs = {name: await self.subscribe(name) for name in streams}
        self._input_subs = subs
        offsets = {s.name: s.clock_offset_ns for s in self.spec.streams}
        lateness = self.spec.lateness_ns
        return AlignedInputs(subs, offsets, align_ns=lateness // 2, idle_s=lateness / 1e9)

    async def pump(self, inputs: AlignedInputs) -> None:
        """Feed every input sample to the assembler, earliest stamp first, a batch at a time."""
        self._inputs = inputs
        handling = self.handling
        while True:
            try:
                batch = await inputs.next_batch()
            except BusClosedError:
                return
            async with handling:
                await self.push_many(batch)

    async def push(self, sample: Sample) -> None:
        """Feed one sample (the subscriptions call this; tests and replay may too)."""
        await self.push_many([sample])

    async def push_many(self, samples: list[Sample]) -> None:
        """Feed samples in order, publishing what they complete."""
        self._last_input = time.monotonic()
        self.update_hold()
        push = self.assembler.push
        so = self.scale_out
        after = so.needs_after_push
        width, offset = self.spec.clock.width_ns, self.spec.clock.offset_ns
        for sample in samples:
            h = sample.header
            if (h.bucket_width_ns != width or h.bucket_offset_ns != offset) and not self.same_clock(sample):
                continue
            events = push(sample)
            if after:
                await so.after_push(sample)
            if events:
                await self.handle(events)

    def update_hold(self) -> bool:
        """Hold the frames that need an input whose subscription is reconnecting (its broker
        died; what it carries meanwhile comes late, not never); True while one is."""
        now = time.monotonic()
        for name, sub in self._input_subs.items():
            if not sub.connected():
                self._reconnecting[name] = (sub.counters()["delivered"], now)
        for name, (delivered, seen) in list(self._reconnecting.items()):
            sub = self._input_subs[name]
            if sub.connected() and (sub.counters()["delivered"] > delivered or now - seen > RECONNECT_HOLD_S):
                del self._reconnecting[name]  # it delivers again (or its publishers are gone)
        held = frozenset(self._reconnecting)
        if held != self.held:
            self.held = held
            self.assembler.hold(held)
            if held:
                _log.warning(
                    "fusion %r: waiting for %s (reconnecting)", self.spec.name, ", ".join(sorted(held))
                )
            else:
                _log.warning("fusion %r: every input connected again", self.spec.name)
        return bool(held)

    def same_clock(self, sample: Sample) -> bool:
        """True if ``sample`` was bucketed with the spec's clock. Otherwise it is refused
        (acknowledged, counted, and named in a warning once per stream): its bucket id, the
        routing key of scale-out, would send its bucket's samples to different workers."""
        h, clock = sample.header, self.spec.clock
        if h.bucket_width_ns == clock.width_ns and h.bucket_offset_ns == clock.offset_ns:
            return True
        if not self.foreign_clock[sample.stream]:
            _log.warning(
                "refusing %s samples: bucketed %g ms offset %g ms, but fusion spec %r uses %g ms "
                "offset %g ms; publish with the spec's clock (robot YAML clock: or fusion:, "
                "replay --spec or --config)",
                sample.stream,
                h.bucket_width_ns / 1e6,
                h.bucket_offset_ns / 1e6,
                self.spec.name,
                clock.width_ns / 1e6,
                clock.offset_ns / 1e6,
            )
        self.foreign_clock[sample.stream] += 1
        sample.ack()
        return False

    async def publish_frame(self, frame: MultiModalFrame) -> None:
        """Publish a frame (and count it)."""
        now = time.time_ns()
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug(
                "publish frame %d (bucket %d) members %s forced %s",
                frame.reference_stamp_ns,
                frame.bucket,
                sorted(frame.members),
                frame.forced,
            )
        if frame.pane == 0:
            self.metrics.record(frame, now)
            self.scale_out.mark_published(frame.reference_stamp_ns)
        assert self._frames_pub is not None
        await self._frames_pub.publish(encode_frame(frame), stamp_ns=frame.reference_stamp_ns)
        if self._on_frame is not None:
            self._on_frame(frame, now)

    async def flush_frames(self) -> None:
        """Wait until the frames published so far are stored (Pulsar) or sent (Zenoh)."""
        assert self._frames_pub is not None
        await self._frames_pub.flush()

    async def handle(self, events: list[Event]) -> None:
        """Publish what the assembler emitted, as the scale-out mode says."""
        so = self.scale_out
        for ev in events:
            if isinstance(ev, MultiModalFrame):
                if await so.should_publish(ev):
                    await self.publish_frame(ev)
                    await so.published(ev)
            elif isinstance(ev, LateSample):
                _log.debug("late %s sample for bucket %d", ev.sample.stream, ev.bucket)
                if so.owns(ev.bucket):
                    await self._publish_late(ev)
            elif isinstance(ev, DroppedFrame):
                self.metrics.dropped += 1
                so.dropped(ev.reference_stamp_ns)
            elif isinstance(ev, StampJump):
                self.metrics.jumps += 1

    async def _publish_late(self, ev: LateSample) -> None:
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

    async def run(self, stop: asyncio.Event) -> None:
        """Subscribe, fuse until ``stop`` is set, flush and publish what is left.

        Raises:
            BusClosedError: The bus was closed under the worker.
            Exception: What a subscription's task failed with.
        """
        blocking = PublisherOptions(backpressure=Backpressure.BLOCK)
        self._frames_pub = await self.bus.publisher(
            self.frames_stream,
            modality=Modality.FRAME,
            encoding=FRAME_ENCODING,
            clock=self.spec.clock,
            options=blocking,
        )
        self._late_pub = await self.bus.publisher(
            self.frames_stream + "/late", clock=self.spec.clock, options=blocking
        )
        tasks = await self.scale_out.start(tuple(s.name for s in self.spec.streams), stop)
        self.ready.set()
        try:
            await self._serve(stop, tasks)
        finally:
            if self.bus.closed:  # nothing can be published or handed over any more
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            else:
                await self._wind_down(stop, tasks)

    async def _serve(self, stop: asyncio.Event, tasks: list[asyncio.Task[None]]) -> None:
        """Until ``stop``: watch the tasks, let the mode tick, flush open buckets when idle."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), min(0.1, self._idle_flush_s / 2))
            except TimeoutError:
                pass
            if self.bus.closed:  # the program closed the bus first: nothing in, nothing out
                raise BusClosedError(
                    f"fusion worker of {self.spec.name!r}: its bus was closed while it ran; it "
                    f"stopped with {self.assembler.pending_frames} pending frame(s) unpublished"
                )
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            async with self.handling:
                await self.scale_out.tick()
                held = self.update_hold()
                idle = time.monotonic() - self._last_input > self._idle_flush_s
                if self.assembler.pending_frames and idle and not held:
                    await self.handle(self.assembler.flush())

    async def _wind_down(self, stop: asyncio.Event, tasks: list[asyncio.Task[None]]) -> None:
        """Stopping on an open bus: hand over or publish what is pending, then flush."""
        handed = await self.scale_out.leave(stop)
        for s in self._subs:
            await s.close()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.handle(self.assembler.flush())  # a leaver's frames are held
        await self.scale_out.after_flush(handed)
        await self.scale_out.close()
        assert self._frames_pub is not None and self._late_pub is not None  # made by run()
        await self._frames_pub.flush()
        await self._late_pub.flush()

    def summary(self) -> dict[str, Any]:
        """Metrics plus assembler counters and those of the scale-out mode."""
        s = self.assembler.stats
        return {
            **self.metrics.as_dict(),
            "samples": s.samples,
            "duplicates": s.duplicates,
            "stamp_fallbacks": s.stamp_fallbacks,
            "unused": s.unused,
            "forced": s.forced,
            "pending": self.assembler.pending_frames,
            "foreign_clock": dict(self.foreign_clock),
            "aligned_waits": self._inputs.waits if self._inputs is not None else 0,
            **self.scale_out.summary(),
        }
