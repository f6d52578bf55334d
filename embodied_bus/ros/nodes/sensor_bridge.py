"""``ros2 run embodied_bus sensor_bridge --ros-args -p config:=robot.yaml``

Subscribes to the robot YAML's ``streams:`` topics with ``raw=True`` (serialized CDR, no
deserialization on the hot path) and QoS from the config (sensor-data best effort by default),
and publishes each message as a bus sample stamped with its header stamp. A zero header stamp
falls back to the node clock (so ``use_sim_time`` is honoured), flagged on the sample.
"""

from __future__ import annotations

import asyncio
from typing import Any

from embodied_bus.bus import open_bus
from embodied_bus.errors import EmbodiedBusError
from embodied_bus.model.qos import PublisherOptions
from embodied_bus.ros.bridge_core import bus_backpressure, has_header, header_of
from embodied_bus.ros.nodes.runtime import NodeParams, rclpy_qos, run_node
from embodied_bus.rosmsg.types import modality_of
from embodied_bus.streams.publisher import Publisher

__all__ = ["main"]

NODE_NAME = "sensor_bridge"


async def serve(node: Any, params: NodeParams, stop: asyncio.Event) -> None:
    """Bridge every configured topic until ``stop`` is set."""
    from rosidl_runtime_py.utilities import get_message

    cfg = params.config
    log = node.get_logger()
    async with open_bus(params.bus, namespace=params.bus_namespace) as bus:
        for route in cfg.inbound:
            pub = await bus.publisher(
                route.stream,
                modality=modality_of(route.ros_type),
                encoding=f"cdr:{route.ros_type}",
                clock=cfg.clock,
                options=PublisherOptions(backpressure=bus_backpressure(route.qos)),
            )

            def on_message(raw: bytes, route: Any = route, pub: Publisher = pub) -> None:
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
            node.create_subscription(
                get_message(route.ros_type),
                route.topic,
                on_message,
                rclpy_qos(route.qos, relay=True),
                raw=True,
            )
            log.info(f"{route.topic} ({route.ros_type}) -> bus stream {route.stream}")
        await stop.wait()


def main(args: list[str] | None = None) -> int:
    """Run the node (needs rclpy)."""
    return run_node(NODE_NAME, args, serve)


if __name__ == "__main__":
    raise SystemExit(main())
