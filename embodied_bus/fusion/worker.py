"""A fusion worker: subscribes to a spec's input streams, assembles frames, publishes them.

Frames go to the stream ``frames/<spec.name>`` (encoding ``ebframe``, modality FRAME, stamped
with the reference stamp, bucketed with the spec's clock) and late samples, unchanged, to
``frames/<spec.name>/late``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from embodied_bus.bus import Bus
from embodied_bus.fusion.assembler import Assembler, DroppedBucket, Event, LateSample, StampJump
from embodied_bus.fusion.codec import FRAME_ENCODING, encode_frame
from embodied_bus.fusion.frame import MultiModalFrame
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
        on_frame: Called with each frame and its emit time (ns), e.g. to write JSON lines.
        capacity: Buffer of each input subscription (lossless ``block`` policy).
        idle_flush_s: Flush open buckets after this long without input.
    """

    def __init__(
        self,
        bus: Bus,
        spec: FusionSpec,
        *,
        on_frame: Callable[[MultiModalFrame, int], None] | None = None,
        capacity: int = 4096,
        idle_flush_s: float = DEFAULT_IDLE_FLUSH_S,
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

    async def _handle(self, events: list[Event]) -> None:
        for ev in events:
            if isinstance(ev, MultiModalFrame):
                now = time.time_ns()
                if ev.pane == 0:
                    self.metrics.record(ev, now)
                assert self._frames_pub is not None
                await self._frames_pub.publish(encode_frame(ev), stamp_ns=ev.reference_stamp_ns)
                if self._on_frame is not None:
                    self._on_frame(ev, now)
            elif isinstance(ev, LateSample):
                self.metrics.late += 1
                assert self._late_pub is not None
                await self._late_pub.publish(
                    ev.sample.payload if isinstance(ev.sample.payload, bytes) else bytes(ev.sample.payload),
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
        await self._handle(self.assembler.push(sample))

    async def _pump(self, sub: Subscription) -> None:
        async for sample in sub:
            await self.push(sample)

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
        self._subs = [await self.bus.subscribe(s.name, options=opts) for s in self.spec.streams]
        pumps = [asyncio.create_task(self._pump(s)) for s in self._subs]
        self.ready.set()
        try:
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), self._idle_flush_s / 2)
                except TimeoutError:
                    pass
                for t in pumps:
                    if t.done() and t.exception() is not None:
                        raise t.exception()  # type: ignore[misc]
                if self.assembler.open_buckets and time.monotonic() - self._last_input > self._idle_flush_s:
                    await self._handle(self.assembler.flush())
        finally:
            for s in self._subs:
                await s.close()
            for t in pumps:
                t.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            await self._handle(self.assembler.flush())
            await self._frames_pub.flush()
            await self._late_pub.flush()

    def summary(self) -> dict[str, Any]:
        """Metrics plus assembler counters."""
        s = self.assembler.stats
        return {
            **self.metrics.as_dict(),
            "samples": s.samples,
            "duplicates": s.duplicates,
            "stamp_fallbacks": s.stamp_fallbacks,
            "unused": s.unused,
            "forced": s.forced,
        }
