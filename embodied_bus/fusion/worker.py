"""A fusion worker: subscribes to a spec's input streams, assembles frames, publishes them.

Frames go to the stream ``frames/<spec.name>`` (encoding ``ebframe``, modality FRAME, stamped
with the reference stamp, bucketed with the spec's clock) and late samples, unchanged, to
``frames/<spec.name>/late``.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from embodied_bus.bus import Bus
from embodied_bus.fusion.assembler import Assembler, DroppedBucket, Event, LateSample, StampJump
from embodied_bus.fusion.codec import FRAME_ENCODING, encode_frame
from embodied_bus.fusion.frame import MultiModalFrame
from embodied_bus.fusion.ownership import ZenohRing
from embodied_bus.fusion.spec import FusionSpec
from embodied_bus.model.qos import Backpressure, PublisherOptions, SubscriptionOptions
from embodied_bus.model.sample import Sample
from embodied_bus.model.wire import Modality
from embodied_bus.streams.publisher import Publisher
from embodied_bus.streams.subscriber import Subscription

__all__ = ["DEFAULT_IDLE_FLUSH_S", "FusionMetrics", "FusionWorker", "frames_stream"]

#: With no input for this long, open buckets are flushed (end of a recording, sensors down).
DEFAULT_IDLE_FLUSH_S = 1.0
_WINDOW = 4096
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
    presence: dict[str, int] = field(default_factory=dict)
    skew_ms: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    added_ms: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    e2e_ms: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))

    def record(self, frame: MultiModalFrame, emitted_ns: int) -> None:
        self.frames += 1
        self.complete += frame.complete
        for name in frame.members:
            self.presence[name] = self.presence.get(name, 0) + 1
        self.skew_ms.append(frame.max_skew_ns / 1e6)
        if frame.last_arrival_ns:
            self.added_ms.append((emitted_ns - frame.last_arrival_ns) / 1e6)
        self.e2e_ms.append((emitted_ns - frame.reference_stamp_ns) / 1e6)

    def as_dict(self) -> dict[str, Any]:
        elapsed = max(1e-9, time.monotonic() - self.started)
        skew = _pct(self.skew_ms)
        added = _pct(self.added_ms)
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
        ring: Scale out over a Zenoh ownership ring (see :mod:`embodied_bus.fusion.ownership`):
            several workers with the same spec share the buckets, each published exactly once.
        worker_id: Ring member id (default: random).
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
        ring: bool = False,
        worker_id: str | None = None,
        join_margin_buckets: int | None = None,
    ) -> None:
        self.bus = bus
        self.spec = spec
        self.assembler = Assembler(spec)
        self.metrics = FusionMetrics()
        self._on_frame = on_frame
        self._capacity = capacity
        self._idle_flush_s = idle_flush_s
        self._subs: list[Subscription] = []
        self._frames_pub: Publisher | None = None
        self._late_pub: Publisher | None = None
        self._last_input = time.monotonic()
        self.ready = asyncio.Event()
        self._use_ring = ring
        self._worker_id = worker_id
        self._margin = (
            join_margin_buckets
            if join_margin_buckets is not None
            else -(-spec.lateness_ns // spec.clock.width_ns) + 3
        )
        self.ring: ZenohRing | None = None
        self._joining = False
        #: Buckets whose frame some worker of the ring published (recent, bounded).
        self._published: OrderedDict[int, None] = OrderedDict()
        #: Frames this worker assembled but another member owned (for takeover).
        self._held: OrderedDict[int, MultiModalFrame] = OrderedDict()
        #: Frames not published because another worker already had.
        self.skipped = 0
        #: Frames published on behalf of a worker that left.
        self.taken_over = 0

    def _mark_published(self, bucket: int) -> None:
        self._published[bucket] = None
        self._published.move_to_end(bucket)
        while len(self._published) > _RECENT:
            self._published.popitem(last=False)

    async def _publish_frame(self, frame: MultiModalFrame) -> None:
        now = time.time_ns()
        if frame.pane == 0:
            self.metrics.record(frame, now)
            self._mark_published(frame.bucket)
        assert self._frames_pub is not None
        await self._frames_pub.publish(encode_frame(frame), stamp_ns=frame.reference_stamp_ns)
        if self._on_frame is not None:
            self._on_frame(frame, now)

    async def _handle(self, events: list[Event]) -> None:
        ring = self.ring
        for ev in events:
            if isinstance(ev, MultiModalFrame):
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
            elif isinstance(ev, LateSample):
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
            elif isinstance(ev, DroppedBucket):
                self.metrics.dropped += 1
            elif isinstance(ev, StampJump):
                self.metrics.jumps += 1

    async def push(self, sample: Sample) -> None:
        """Feed one sample (the subscriptions call this; tests and replay may too)."""
        self._last_input = time.monotonic()
        events = self.assembler.push(sample)
        ring = self.ring
        if ring is not None and not self._joining and ring.joined_from is None and not ring.joined:
            # Joining a running ring: own buckets from a little ahead of the current event time.
            self._joining = True
            await ring.join(self.spec.clock.bucket_of(sample.stamp_ns) + self._margin)
        await self._handle(events)

    async def _pump(self, sub: Subscription) -> None:
        async for sample in sub:
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
        if self._use_ring:
            self.ring = ZenohRing(self.bus, self.spec.name, self._worker_id)
            frames_sub = await self.bus.subscribe(frames_stream(self.spec), options=opts)
            self._subs.append(frames_sub)
            tasks.append(asyncio.create_task(self._track_published(frames_sub)))
            tasks.append(asyncio.create_task(self._take_over()))
            if not await self.ring.watch():
                await self.ring.join(None)  # first worker: own everything from the start
        self._subs += [await self.bus.subscribe(s.name, options=opts) for s in self.spec.streams]
        tasks += [asyncio.create_task(self._pump(s)) for s in self._subs[1 if self._use_ring else 0 :]]
        self.ready.set()
        try:
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), self._idle_flush_s / 2)
                except TimeoutError:
                    pass
                for t in tasks:
                    if t.done() and not t.cancelled() and t.exception() is not None:
                        raise t.exception()  # type: ignore[misc]
                if self.assembler.open_buckets and time.monotonic() - self._last_input > self._idle_flush_s:
                    await self._handle(self.assembler.flush())
        finally:
            for s in self._subs:
                await s.close()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._handle(self.assembler.flush())
            if self.ring is not None:
                await self.ring.leave()
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
            out.update(worker=self.ring.worker_id, skipped=self.skipped, taken_over=self.taken_over)
        return out
