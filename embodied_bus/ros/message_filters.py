"""message_filters' synchronizers, fed by fused frames from the bus. A node that uses
message_filters changes one import::

    from embodied_bus.ros import message_filters  # instead of: import message_filters

    cloud = message_filters.Subscriber(node, PointCloud2, "/lidar/points")
    image = message_filters.Subscriber(node, Image, "/camera/image_raw")
    sync = message_filters.ApproximateTimeSynchronizer([cloud, image], queue_size=10, slop=0.05)
    sync.registerCallback(on_set)  # on_set(cloud_msg, image_msg), on the node's executor

The sets are the frames a fusion worker assembles from the bridged topics (one per reference
sample, members picked by the robot YAML's fusion spec), so a set per lidar sweep whatever the
sensors' rates and phases. A frame that gives no set is never dropped silently: it goes to the
drop callbacks with the reason (:class:`DropReason`), is counted in :attr:`stats`, and logged.

The robot YAML (``config=``, else ``$EMBODIED_BUS_CONFIG``) gives the bus, the stream of each
subscribed topic and the fusion spec. Needs rclpy (the callbacks run on the node's executor).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embodied_bus.bus import open_bus
from embodied_bus.errors import BusConfigError, EncodingError
from embodied_bus.fusion.codec import decode_frame
from embodied_bus.fusion.frame import MultiModalFrame
from embodied_bus.fusion.sets import DroppedSet, DropReason, FrameSets, MemberSet
from embodied_bus.ros.config import RobotConfig, load_robot_config, resolve_name
from embodied_bus.ros.launching import require_shared_bus

__all__ = [
    "CONFIG_ENV",
    "ApproximateTimeSynchronizer",
    "DropReason",
    "DroppedSet",
    "Subscriber",
    "SyncStats",
    "TimeSynchronizer",
]

#: Environment variable naming the robot YAML where ``config=`` is not given.
CONFIG_ENV = "EMBODIED_BUS_CONFIG"
#: Longest wait for the bus subscription at construction, seconds.
READY_TIMEOUT_S = 15.0
#: Seconds between two log lines about dropped sets.
DROP_LOG_PERIOD_S = 5.0


class Subscriber:
    """A subscribed topic, as ``message_filters.Subscriber(node, msg_type, topic, qos_profile)``.

    Its messages come from the bus (the fused frames), not from a ROS subscription, so
    ``qos_profile`` is accepted and unused: the bridge's QoS toward the sensor applies.

    Args:
        node: The rclpy node whose executor runs the callbacks.
        msg_type: The message class, e.g. ``sensor_msgs.msg.PointCloud2``.
        topic: The ROS topic (relative names resolve under the node's namespace).
        stream: The bus stream, where the robot YAML does not bridge ``topic``.
    """

    def __init__(
        self, node: Any, msg_type: Any, topic: str, qos_profile: Any = None, *, stream: str | None = None
    ) -> None:
        self.node = node
        self.msg_type = msg_type
        self.topic = topic
        self.stream = stream

    def getTopic(self) -> str:
        return self.topic


@dataclass(slots=True)
class SyncStats:
    """What a synchronizer did with the frames it saw."""

    delivered: int = 0
    dropped: dict[DropReason, int] = field(default_factory=lambda: dict.fromkeys(DropReason, 0))

    def as_dict(self) -> dict[str, Any]:
        return {"delivered": self.delivered, "dropped": {r.value: n for r, n in self.dropped.items()}}


def _ros_type(msg_type: Any) -> str:
    """``pkg/msg/Name`` of an rclpy message class."""
    return f"{msg_type.__module__.split('.')[0]}/msg/{msg_type.__name__}"


def _config(config: RobotConfig | str | Path | None) -> RobotConfig:
    if isinstance(config, RobotConfig):
        return config
    path = config or os.environ.get(CONFIG_ENV)
    if not path:
        raise BusConfigError(
            f"no robot YAML for the bus synchronizer: pass config= or set ${CONFIG_ENV} "
            "(it maps the topics to bus streams and names the fusion spec)"
        )
    return load_robot_config(path)


def _stream_of(sub: Subscriber, cfg: RobotConfig) -> str:
    """The bus stream of a subscriber: its own, or the one the robot YAML bridges its topic to."""
    if sub.stream is not None:
        return sub.stream
    topic = sub.node.resolve_topic_name(sub.topic)
    for route in cfg.inbound:
        if resolve_name(route.topic, cfg.ros.namespace) == topic:
            if route.ros_type != _ros_type(sub.msg_type):
                raise BusConfigError(
                    f"{topic}: the robot YAML bridges it as {route.ros_type}, "
                    f"the subscriber asks for {_ros_type(sub.msg_type)}"
                )
            return route.stream
    known = ", ".join(sorted(resolve_name(r.topic, cfg.ros.namespace) for r in cfg.inbound)) or "none"
    raise BusConfigError(f"{topic} is not bridged by the robot YAML's streams: (bridged: {known})")


class _FrameFeed:
    """The frame stream's subscription, on a thread with its own event loop."""

    def __init__(
        self,
        url: str,
        namespace: str | None,
        stream: str,
        on_frame: Callable[[MultiModalFrame], None],
        on_lost: Callable[[int, str], None],
    ) -> None:
        self.url, self.namespace, self.stream = url, namespace, stream
        self.on_frame, self.on_lost = on_frame, on_lost
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="eb-message-filters", daemon=True)

    def start(self, timeout_s: float) -> None:
        """Start; return once subscribed (raises what prevented it)."""
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"no subscription to {self.stream} on {self.url} within {timeout_s} s")
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as err:  # reported by start(), or on the node's log
            self.error = err
            if self._ready.is_set():
                self.on_lost(0, f"the bus subscription ended: {err}")
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with open_bus(self.url, namespace=self.namespace) as bus:
            sub = await bus.subscribe(self.stream)
            self._ready.set()
            consume = asyncio.create_task(self._consume(sub))
            await self._stop.wait()
            consume.cancel()
            await asyncio.gather(consume, return_exceptions=True)
            await sub.close()

    async def _consume(self, sub: Any) -> None:
        lost = 0
        async for sample in sub:
            counters = sub.counters()
            now_lost = counters["missing"] + counters["dropped"]
            if now_lost > lost:
                self.on_lost(now_lost - lost, f"{now_lost - lost} frames lost on {self.stream}")
                lost = now_lost
            try:
                frame = decode_frame(sample.payload)
            except EncodingError as err:
                self.on_lost(1, f"undecodable frame on {self.stream}: {err}")
                continue
            self.on_frame(frame)

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(5.0)


class ApproximateTimeSynchronizer:
    """Calls back with one message per subscriber for each fused frame.

    Args:
        fs: The subscribers, in callback argument order (all of one node).
        queue_size: Sets waiting for the callback at most; beyond, the oldest is dropped
            (:attr:`DropReason.QUEUE_FULL`).
        slop: Largest span of a set's stamps, seconds; a wider frame is dropped
            (:attr:`DropReason.SLOP`).
        allow_headerless: Not supported (fused members carry their sensor stamps).
        config: Robot YAML (path or loaded); default ``$EMBODIED_BUS_CONFIG``.
        frames: The frame stream; default ``frames/<fusion.name>`` of the robot YAML.
        bus: Bus URL; default the robot YAML's.
    """

    def __init__(
        self,
        fs: Sequence[Subscriber],
        queue_size: int,
        slop: float,
        allow_headerless: bool = False,
        *,
        config: RobotConfig | str | Path | None = None,
        frames: str | None = None,
        bus: str | None = None,
    ) -> None:
        if allow_headerless:
            raise ValueError("allow_headerless: fused members always carry their sensor stamps")
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        if not fs or any(not isinstance(f, Subscriber) for f in fs):
            raise TypeError("fs: embodied_bus.ros.message_filters.Subscriber objects, at least one")
        self.node = fs[0].node
        if any(f.node is not self.node for f in fs):
            raise ValueError("the subscribers of one synchronizer belong to one node")
        cfg = _config(config)
        self.subscribers = tuple(fs)
        self.streams = tuple(_stream_of(f, cfg) for f in fs)
        self.frames = frames or self._frame_stream(cfg)
        self.queue_size = queue_size
        self.stats = SyncStats()
        self._sets = FrameSets(self.streams, round(slop * 1e9))
        self._callbacks: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self._drop_callbacks: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self._lock = threading.Lock()
        self._pending: deque[MemberSet] = deque()
        self._drops: deque[DroppedSet] = deque()
        self._log = self.node.get_logger()
        self._guard = self.node.create_guard_condition(self._drain)
        url = require_shared_bus(cfg.bus_url(bus), who="message_filters")
        self._feed = _FrameFeed(url, cfg.namespace, self.frames, self._on_frame, self._on_lost)
        self._feed.start(READY_TIMEOUT_S)

    def _frame_stream(self, cfg: RobotConfig) -> str:
        spec = cfg.fusion
        if spec is None:
            raise BusConfigError("the robot YAML has no fusion: spec; give frames= (a frame stream)")
        fused = sorted(s.name for s in spec.streams)
        unfused = [s for s in self.streams if s not in fused]
        if unfused:
            raise BusConfigError(
                f"streams {unfused} are not in the fusion spec {spec.name!r} (its streams: {fused})"
            )
        return f"frames/{spec.name}"

    def registerCallback(self, cb: Callable[..., Any], *args: Any) -> int:
        """Call ``cb(msg_1, ..., msg_n, *args)`` for each set."""
        self._callbacks.append((cb, args))
        return len(self._callbacks) - 1

    def registerDropCallback(self, cb: Callable[..., Any], *args: Any) -> int:
        """Call ``cb(dropped, *args)`` with a :class:`DroppedSet` for each frame giving no set."""
        self._drop_callbacks.append((cb, args))
        return len(self._drop_callbacks) - 1

    def close(self) -> None:
        """Stop taking frames (the sets already taken are still delivered by the executor)."""
        self._feed.stop()

    # -- the bus thread ------------------------------------------------------------------------

    def _on_frame(self, frame: MultiModalFrame) -> None:
        taken = self._sets.take(frame)
        if taken is None:
            return
        with self._lock:
            if isinstance(taken, DroppedSet):
                self._drops.append(taken)
            else:
                self._pending.append(taken)
                if len(self._pending) > self.queue_size:
                    old = self._pending.popleft()
                    self._drops.append(
                        DroppedSet(
                            DropReason.QUEUE_FULL, old.reference_stamp_ns, f"queue_size {self.queue_size}"
                        )
                    )
        self._guard.trigger()

    def _on_lost(self, count: int, detail: str) -> None:
        with self._lock:
            self._drops.append(DroppedSet(DropReason.LOST, None, detail, count))
        self._guard.trigger()

    # -- the node's executor -------------------------------------------------------------------

    def _drain(self) -> None:
        from rclpy.serialization import deserialize_message

        with self._lock:
            sets, self._pending = list(self._pending), deque()
            drops, self._drops = list(self._drops), deque()
        for d in drops:
            self.stats.dropped[d.reason] += d.count
            self._log.warning(
                f"no set for {d.count} frame(s) of {self.frames}: {d.reason.value} ({d.detail})",
                throttle_duration_sec=DROP_LOG_PERIOD_S,
            )
            for cb, args in self._drop_callbacks:
                cb(d, *args)
        for s in sets:
            msgs = [
                deserialize_message(bytes(sample.payload), sub.msg_type)
                for sample, sub in zip(s.samples, self.subscribers, strict=True)
            ]
            self.stats.delivered += 1
            for cb, args in self._callbacks:
                cb(*msgs, *args)


class TimeSynchronizer(ApproximateTimeSynchronizer):
    """Sets whose members carry the same stamp, as ``message_filters.TimeSynchronizer``."""

    def __init__(self, fs: Sequence[Subscriber], queue_size: int, **kw: Any) -> None:
        super().__init__(fs, queue_size, 0.0, **kw)
