"""Replay recordings as ROS 2 topics over rmw_zenoh (``embodied-bus replay BAG --ros``): no ROS
install, the player's timing, and ``/clock`` for nodes on ``use_sim_time``.

Each recorded topic is published under its own name and type by one ROS node; a type with no
ROS 2 definition (neither in the distribution nor on the interface search path) is skipped with
the reason. With a clock rate, ``/clock`` (``rosgraph_msgs/msg/Clock``) carries the recording's
time at that rate, also between messages; it holds still while the replay is paused.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from embodied_bus.model.clock import BucketClock
from embodied_bus.replay.targets import ReplayControl, ReplayPublisher, TopicNotReplayable
from embodied_bus.ros.rmw_node import RmwNode, RosPublisher
from embodied_bus.rosmsg.interfaces import InterfaceError
from embodied_bus.rosmsg.rmw_zenoh import DEFAULT_QOS, QosProfile

__all__ = ["CLOCK_TOPIC", "ReplayClock", "RosReplayTarget"]

CLOCK_TOPIC = "/clock"
_CLOCK_TYPE = "rosgraph_msgs/msg/Clock"


class _RosTopic:
    """A recorded topic's ROS publisher, shaped as the player's publisher."""

    def __init__(self, pub: RosPublisher) -> None:
        self.pub = pub

    async def publish(
        self, payload: Any, *, stamp_ns: int, frame_id: str | None = None, stamp_fallback: bool = False
    ) -> None:
        self.pub.put(payload)

    def publish_from_thread(
        self, payload: Any, *, stamp_ns: int, frame_id: str | None = None, stamp_fallback: bool = False
    ) -> None:
        self.pub.put(payload)

    async def flush(self) -> None:
        """Nothing to wait for: Zenoh sends at once."""

    async def wait_for_subscribers(self, timeout_s: float) -> bool:
        """Wait until a ROS subscription matches this topic."""
        deadline = time.monotonic() + timeout_s
        while not self.pub.has_subscribers():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True


class ReplayClock:
    """The recording's time for ``/clock``: the last message's log time, advanced at the replay
    rate between messages, held while paused, never backwards; published by ``put`` (sim time,
    ns) at ``clock_hz``.

    Args:
        put: Publishes one ``/clock`` message.
        clock_hz: How often (None: never).
        rate: The replay's speed factor.
        control: The replay's pause control.
    """

    def __init__(
        self,
        put: Any,
        *,
        clock_hz: float | None,
        rate: float = 1.0,
        control: ReplayControl | None = None,
    ) -> None:
        if clock_hz is not None and clock_hz <= 0:
            raise ValueError(f"clock rate must be > 0 Hz, got {clock_hz}")
        self.put = put
        self.clock_hz = clock_hz
        self.rate = rate
        self.control = control
        #: ``/clock`` messages published.
        self.ticks = 0
        self._last: tuple[int, float, float] | None = None  # log time, monotonic, paused_s then
        self._clock_ns = 0

    def played(self, log_time_ns: int) -> None:
        paused = self.control.paused_s if self.control is not None else 0.0
        self._last = (log_time_ns, time.monotonic(), paused)

    def now_ns(self) -> int | None:
        """The recording's time now: the last message's log time, advanced at the replay rate
        (not while paused); None before the first message."""
        if self._last is None:
            return None
        log_ns, mono, paused_then = self._last
        if self.control is not None and self.control.paused:
            return self._clock_ns or log_ns
        paused = (self.control.paused_s if self.control is not None else 0.0) - paused_then
        return log_ns + int((time.monotonic() - mono - paused) * self.rate * 1e9)

    def tick(self) -> bool:
        """Publish ``/clock`` once (never backwards); False before the first message."""
        now = self.now_ns()
        if now is None or self.clock_hz is None:
            return False
        self._clock_ns = max(self._clock_ns, now)
        self.put(self._clock_ns)
        self.ticks += 1
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Publish ``/clock`` at ``clock_hz`` until ``stop`` is set (returns at once without a
        clock rate)."""
        if self.clock_hz is None:
            return
        period = 1.0 / self.clock_hz
        next_at = time.monotonic()
        while not stop.is_set():
            self.tick()
            next_at += period
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, next_at - time.monotonic()))


class RosReplayTarget:
    """Publishes a replay on ROS 2 topics over rmw_zenoh (see the module docstring).

    Args:
        node: The player's ROS node.
        clock_hz: Publish ``/clock`` this often (None: no ``/clock``; a recorded ``/clock`` is
            then replayed like any topic).
        rate: The replay's speed factor (``/clock`` advances at it between messages).
        control: The replay's pause control (``/clock`` holds while paused).
        qos: QoS of the replayed topics.
    """

    def __init__(
        self,
        node: RmwNode,
        *,
        clock_hz: float | None = None,
        rate: float = 1.0,
        control: ReplayControl | None = None,
        qos: QosProfile = DEFAULT_QOS,
    ) -> None:
        self.node = node
        self.qos = qos
        self._clock_pub = node.publisher(CLOCK_TOPIC, _CLOCK_TYPE) if clock_hz is not None else None
        self.clock = ReplayClock(self._put_clock, clock_hz=clock_hz, rate=rate, control=control)

    def _put_clock(self, ns: int) -> None:
        assert self._clock_pub is not None
        sec, nsec = divmod(ns, 1_000_000_000)
        self._clock_pub.put(
            self.node.interfaces.serialize(_CLOCK_TYPE, {"clock": {"sec": sec, "nanosec": nsec}})
        )

    @property
    def clock_ticks(self) -> int:
        """``/clock`` messages published."""
        return self.clock.ticks

    async def publisher(
        self, topic: str, msgtype: str, frame_id: str, *, stream: str, clock: BucketClock
    ) -> ReplayPublisher:
        if topic == CLOCK_TOPIC and self._clock_pub is not None:
            raise TopicNotReplayable("the recorded /clock is replaced by the replay's own (--clock)")
        try:
            return _RosTopic(self.node.publisher(topic, msgtype, self.qos))
        except InterfaceError as err:
            raise TopicNotReplayable(f"{msgtype} has no ROS 2 definition here ({err})") from None

    def played(self, log_time_ns: int) -> None:
        self.clock.played(log_time_ns)

    def now_ns(self) -> int | None:
        """The recording's time now (see :meth:`ReplayClock.now_ns`)."""
        return self.clock.now_ns()

    def tick(self) -> bool:
        """Publish ``/clock`` once (never backwards); False before the first message."""
        return self.clock.tick()

    async def run_clock(self, stop: asyncio.Event) -> None:
        """Publish ``/clock`` at the clock rate until ``stop`` is set."""
        await self.clock.run(stop)
