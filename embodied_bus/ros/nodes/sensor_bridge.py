"""``ros2 run embodied_bus sensor_bridge --ros-args -p config:=robot.yaml``

Subscribes to the robot YAML's ``streams:`` topics (and, with ``discover:``, to each published
topic it admits, with the type the graph shows) with ``raw=True`` (serialized CDR, no
deserialization on the hot path) and QoS from the config (sensor-data best effort by default),
and publishes each message as a bus sample stamped with its header stamp. A zero header stamp
falls back to the node clock (so ``use_sim_time`` is honoured), flagged on the sample.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from embodied_bus.bus import Bus, open_bus
from embodied_bus.errors import EmbodiedBusError
from embodied_bus.model.qos import PublisherOptions
from embodied_bus.ros.bridge_core import bus_backpressure, has_header, header_of
from embodied_bus.ros.config import RobotConfig, RobotConfigError, TopicRoute
from embodied_bus.ros.discovery import TopicSelection
from embodied_bus.ros.nodes.runtime import NodeParams, rclpy_qos, run_node
from embodied_bus.rosmsg.rmw_zenoh import Durability, QosProfile, Reliability
from embodied_bus.rosmsg.types import modality_of

__all__ = ["main"]

NODE_NAME = "sensor_bridge"


#: How often the node reads the ROS graph for topics ``discover:`` admits, in seconds.
DISCOVERY_PERIOD_S = 0.5


class SensorBridge:
    """ROS topics → bus streams, from the config's routes and, with ``discover:``, from the graph."""

    def __init__(self, node: Any, bus: Bus, cfg: RobotConfig) -> None:
        self.node = node
        self.bus = bus
        self.cfg = cfg
        self.log = node.get_logger()
        self._warned: set[str] = set()

    async def add(self, route: TopicRoute, msg_class: Any) -> None:
        """Bridge ``route`` (a subscription with ``raw=True``: CDR, no deserialization)."""
        cfg, node, log = self.cfg, self.node, self.log
        pub = await self.bus.publisher(
            route.stream,
            modality=modality_of(route.ros_type),
            encoding=f"cdr:{route.ros_type}",
            clock=cfg.clock,
            options=PublisherOptions(backpressure=bus_backpressure(route.qos)),
        )

        def on_message(raw: bytes) -> None:
            hdr = header_of(raw, route.ros_type, cfg.ros.distro)
            now_ns = int(node.get_clock().now().nanoseconds)  # sim time when use_sim_time
            stamp, frame_id, fallback = now_ns, "", False
            if hdr is not None:
                stamp, frame_id = hdr
                fallback = stamp == 0
                if fallback:
                    stamp = now_ns
            try:  # on the executor's one thread: straight to the engine, no hand-off
                pub.publish_from_thread(raw, stamp_ns=stamp, frame_id=frame_id, stamp_fallback=fallback)
            except EmbodiedBusError as err:
                log.error(f"{route.topic} -> {route.stream}: {err}", throttle_duration_sec=5.0)

        has_header(route.ros_type, cfg.ros.distro)  # the type store loads now, not on the first message
        qos = rclpy_qos(route.qos, relay=True)
        node.create_subscription(msg_class, route.topic, on_message, qos, raw=True)
        log.info(f"{route.topic} ({route.ros_type}) -> bus stream {route.stream}")

    def warn_once(self, key: str, text: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.log.warning(text)

    async def discover(self, selection: TopicSelection, stop: asyncio.Event) -> None:
        """Bridge each published topic ``selection`` admits, as the graph shows it, until
        ``stop`` is set."""
        own = self.cfg.resolved_under(self.node.get_namespace())
        routed = {r.topic for r in own.inbound}
        while not stop.is_set():
            for topic, types in self.node.get_topic_names_and_types():
                if topic in routed or own.publishes(topic) or not selection.admits(topic):
                    continue
                route = self._discovered(selection, topic, types)
                if route is None:
                    continue
                routed.add(topic)
                msg_class = _message_class(route.ros_type)
                if msg_class is None:
                    self.warn_once(topic, f"{topic}: {route.ros_type} is not installed here; not bridged")
                    continue
                await self.add(route, msg_class)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), DISCOVERY_PERIOD_S)

    def _discovered(self, selection: TopicSelection, topic: str, types: list[str]) -> TopicRoute | None:
        publishers = self.node.get_publishers_info_by_topic(topic)
        if not publishers:
            return None  # only subscriptions so far
        if len(types) != 1:
            self.warn_once(topic, f"{topic} is published with several types {types}; not bridged")
            return None
        stream = selection.stream_of(topic)
        if stream is None:
            self.warn_once(topic, f"{topic} makes no bus stream name; not bridged")
            return None
        return TopicRoute(topic, types[0], stream, selection.qos_for(_qos_of(publishers[0].qos_profile)))


def _message_class(ros_type: str) -> Any:
    from rosidl_runtime_py.utilities import get_message

    try:
        return get_message(ros_type)
    except (AttributeError, ModuleNotFoundError, ValueError):
        return None


def _qos_of(profile: Any) -> QosProfile:
    """An rclpy QoSProfile as the config's profile (rmw policy values are shared)."""
    best_effort = int(profile.reliability) == int(Reliability.BEST_EFFORT)
    latched = int(profile.durability) == int(Durability.TRANSIENT_LOCAL)
    return QosProfile(
        Reliability.BEST_EFFORT if best_effort else Reliability.RELIABLE,
        Durability.TRANSIENT_LOCAL if latched else Durability.VOLATILE,
        depth=int(profile.depth) or 10,
    )


async def serve(node: Any, params: NodeParams, stop: asyncio.Event) -> None:
    """Bridge every configured (and discovered) topic until ``stop`` is set."""
    cfg = params.config
    async with open_bus(params.bus, namespace=params.bus_namespace) as bus:
        bridge = SensorBridge(node, bus, cfg)
        for route in cfg.inbound:
            msg_class = _message_class(route.ros_type)
            if msg_class is None:
                raise RobotConfigError(f"{route.topic}: message type {route.ros_type} is not installed")
            await bridge.add(route, msg_class)
        found = ", and the topics discover: admits as they appear" if cfg.discover is not None else ""
        bridge.log.info(f"ready: {len(cfg.inbound)} configured topics{found}")
        if cfg.discover is not None:
            await bridge.discover(cfg.discover, stop)
        await stop.wait()


def main(args: list[str] | None = None) -> int:
    """Run the node (needs rclpy)."""
    return run_node(NODE_NAME, args, serve)


if __name__ == "__main__":
    raise SystemExit(main())
