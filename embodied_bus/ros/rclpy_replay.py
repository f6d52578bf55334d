"""Replay recordings as ROS 2 topics through rclpy (``embodied-bus replay BAG --ros`` run by a
Python that has rclpy): any middleware the ROS install uses (Fast DDS, Cyclone DDS, rmw_zenoh),
the player's timing, and ``/clock`` for nodes on ``use_sim_time``.

Each recorded topic is published under its own name and type, its recorded CDR bytes as they
are (no deserialization); a type whose Python package is not installed is skipped with the
reason. Imported only where rclpy is importable.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from embodied_bus.model.clock import BucketClock
from embodied_bus.replay.targets import ReplayControl, ReplayPublisher, TopicNotReplayable
from embodied_bus.ros.rmw_replay import CLOCK_TOPIC, ReplayClock

__all__ = ["RclpyReplayTarget", "rclpy_replay_target"]

#: History of each replayed topic (reliable): a burst of a recording is not dropped by a reader
#: that is a little slow.
DEPTH = 100


class _RclpyTopic:
    """A recorded topic's rclpy publisher, shaped as the player's publisher."""

    def __init__(self, pub: Any) -> None:
        self.pub = pub

    async def publish(
        self, payload: Any, *, stamp_ns: int, frame_id: str | None = None, stamp_fallback: bool = False
    ) -> None:
        self.pub.publish(bytes(payload))

    def publish_from_thread(
        self, payload: Any, *, stamp_ns: int, frame_id: str | None = None, stamp_fallback: bool = False
    ) -> None:
        self.pub.publish(bytes(payload))

    async def flush(self) -> None:
        """Nothing to wait for: rclpy hands the message to the middleware at once."""

    async def wait_for_subscribers(self, timeout_s: float) -> bool:
        """Wait until a ROS subscription matches this topic."""
        deadline = time.monotonic() + timeout_s
        while self.pub.get_subscription_count() == 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True


class RclpyReplayTarget:
    """Publishes a replay on ROS 2 topics through an rclpy node.

    Args:
        node: The player's rclpy node (spun by the caller).
        clock_hz: Publish ``/clock`` this often (None: no ``/clock``; a recorded ``/clock`` is
            then replayed like any topic).
        rate: The replay's speed factor.
        control: The replay's pause control.
    """

    def __init__(
        self,
        node: Any,
        *,
        clock_hz: float | None = None,
        rate: float = 1.0,
        control: ReplayControl | None = None,
    ) -> None:
        from rclpy.qos import QoSProfile, ReliabilityPolicy
        from rosgraph_msgs.msg import Clock

        self.node = node
        self._qos = QoSProfile(depth=DEPTH, reliability=ReliabilityPolicy.RELIABLE)
        self._clock_msg = Clock
        self._clock_pub = node.create_publisher(Clock, CLOCK_TOPIC, 10) if clock_hz is not None else None
        self.clock = ReplayClock(self._put_clock, clock_hz=clock_hz, rate=rate, control=control)

    def _put_clock(self, ns: int) -> None:
        assert self._clock_pub is not None
        msg = self._clock_msg()
        msg.clock.sec, msg.clock.nanosec = divmod(ns, 1_000_000_000)
        self._clock_pub.publish(msg)

    async def publisher(
        self, topic: str, msgtype: str, frame_id: str, *, stream: str, clock: BucketClock
    ) -> ReplayPublisher:
        from rosidl_runtime_py.utilities import get_message

        if topic == CLOCK_TOPIC and self._clock_pub is not None:
            raise TopicNotReplayable("the recorded /clock is replaced by the replay's own (--clock)")
        try:
            cls = get_message(msgtype)
        except (AttributeError, ModuleNotFoundError, ValueError) as err:
            raise TopicNotReplayable(f"{msgtype} is not installed for rclpy here ({err})") from None
        return _RclpyTopic(self.node.create_publisher(cls, topic, self._qos))

    def played(self, log_time_ns: int) -> None:
        self.clock.played(log_time_ns)

    async def run_clock(self, stop: asyncio.Event) -> None:
        """Publish ``/clock`` at the clock rate until ``stop`` is set."""
        await self.clock.run(stop)


def rclpy_available() -> bool:
    """Whether this Python has rclpy."""
    try:
        import rclpy  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.asynccontextmanager
async def rclpy_replay_target(
    node_name: str, *, clock_hz: float | None, rate: float, control: ReplayControl
) -> AsyncIterator[RclpyReplayTarget]:
    """An rclpy node spun on a thread and its replay target, ``/clock`` running; shut down
    cleanly after."""
    import rclpy
    from rclpy.executors import SingleThreadedExecutor

    context = rclpy.Context()
    rclpy.init(context=context)
    node = rclpy.create_node(node_name, context=context)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, name="replay-spin", daemon=True)
    spinner.start()
    target = RclpyReplayTarget(node, clock_hz=clock_hz, rate=rate, control=control)
    stop_clock = asyncio.Event()
    ticking = asyncio.create_task(target.run_clock(stop_clock))
    try:
        yield target
    finally:
        stop_clock.set()
        await ticking
        executor.shutdown()
        spinner.join(5.0)
        node.destroy_node()
        rclpy.try_shutdown(context=context)
