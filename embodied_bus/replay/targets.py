"""Where a replay publishes (the bus, or ROS 2 topics: :mod:`embodied_bus.ros.rmw_replay`),
and pausing a replay while it runs."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from embodied_bus.bus import Bus
from embodied_bus.errors import EmbodiedBusError
from embodied_bus.model.clock import BucketClock
from embodied_bus.model.qos import Backpressure, PublisherOptions
from embodied_bus.replay.reader import modality_of, topic_to_stream

__all__ = ["BusTarget", "ReplayControl", "ReplayPublisher", "ReplayTarget", "TopicNotReplayable"]


class TopicNotReplayable(EmbodiedBusError):
    """A target cannot publish this topic (e.g. its type has no ROS 2 definition); the replay
    skips it and says why."""


class ReplayPublisher(Protocol):
    """One topic's publisher on a target."""

    async def publish(
        self, payload: Any, *, stamp_ns: int, frame_id: str | None = None, stamp_fallback: bool = False
    ) -> object: ...

    def publish_from_thread(
        self, payload: Any, *, stamp_ns: int, frame_id: str | None = None, stamp_fallback: bool = False
    ) -> object: ...

    async def flush(self) -> None: ...

    async def wait_for_subscribers(self, timeout_s: float) -> bool:
        """Wait until a subscriber matches; False if none did within ``timeout_s`` seconds."""
        ...


class ReplayTarget(Protocol):
    """Where a replay publishes."""

    async def publisher(
        self, topic: str, msgtype: str, frame_id: str, *, stream: str, clock: BucketClock
    ) -> ReplayPublisher:
        """The publisher of one recorded topic.

        Raises:
            TopicNotReplayable: This target cannot carry the topic (the replay skips it).
        """
        ...

    def played(self, log_time_ns: int) -> None:
        """The message recorded at ``log_time_ns`` was just published (drives ``/clock``)."""
        ...


class BusTarget:
    """Publish each topic as a bus stream (encoding ``cdr:<type>``, blocking backpressure)."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def publisher(
        self, topic: str, msgtype: str, frame_id: str, *, stream: str, clock: BucketClock
    ) -> ReplayPublisher:
        return await self.bus.publisher(
            stream or topic_to_stream(topic),
            modality=modality_of(msgtype),
            encoding=f"cdr:{msgtype}",
            frame_id=frame_id,
            clock=clock,
            options=PublisherOptions(backpressure=Backpressure.BLOCK),
        )

    def played(self, log_time_ns: int) -> None:
        """Nothing: bus samples carry their own stamps."""


class ReplayControl:
    """Pause and resume a timed replay from outside (a terminal key, a test): the recording's
    clock stops while paused and the replay resumes where it stopped."""

    def __init__(self) -> None:
        self._running = asyncio.Event()
        self._running.set()
        #: Total time spent paused, seconds.
        self.paused_s = 0.0
        self._since = 0.0

    @property
    def paused(self) -> bool:
        """Whether the replay is paused."""
        return not self._running.is_set()

    def pause(self) -> None:
        """Stop the replay clock (idempotent)."""
        if not self.paused:
            self._since = time.monotonic()
            self._running.clear()

    def resume(self) -> None:
        """Start the replay clock again (idempotent)."""
        if self.paused:
            self.paused_s += time.monotonic() - self._since
            self._running.set()

    def toggle(self) -> None:
        """Pause if running, resume if paused."""
        if self.paused:
            self.resume()
        else:
            self.pause()

    async def wait_running(self) -> float:
        """Wait while paused; how long this call waited, seconds."""
        if not self.paused:
            return 0.0
        t = time.monotonic()
        await self._running.wait()
        return time.monotonic() - t
