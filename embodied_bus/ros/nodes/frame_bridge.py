"""``ros2 run embodied_bus frame_bridge --ros-args -p config:=robot.yaml``

Republishes the members of each fused frame (``publish.frames`` in the robot YAML) on
``<namespace>/<stream>`` with their original types and stamps (serialized CDR, published raw),
and per-frame statistics as ``diagnostic_msgs/DiagnosticArray``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from embodied_bus.bus import open_bus
from embodied_bus.errors import EncodingError
from embodied_bus.fusion.codec import decode_frame
from embodied_bus.ros.bridge_core import DIAGNOSTICS_TYPE, frame_diagnostics_cdr, frame_messages, frame_topics
from embodied_bus.ros.config import FrameRoute, RobotConfig
from embodied_bus.ros.nodes.runtime import NodeParams, run_node

__all__ = ["main"]

NODE_NAME = "frame_bridge"
#: History of each republishing topic: a frame's members go out at once (20 IMU samples of a
#: sweep), and a reliable reader that is a little slow must still get all of them.
FRAME_DEPTH = 100


async def _forward(node: Any, bus: Any, route: FrameRoute, config: RobotConfig) -> None:
    from rosidl_runtime_py.utilities import get_message

    pubs: dict[tuple[str, str], Any] = {}
    log = node.get_logger()

    def publisher(topic: str, ros_type: str) -> Any:
        pub = pubs.get((topic, ros_type))
        if pub is None:
            pub = node.create_publisher(get_message(ros_type), topic, FRAME_DEPTH)
            pubs[(topic, ros_type)] = pub
        return pub

    for known in frame_topics(config, route):  # matched by subscribers before the first frame
        try:
            publisher(known.topic, known.ros_type)
        except (ValueError, ModuleNotFoundError, AttributeError) as err:
            log.warning(f"cannot publish {known.topic} ({known.ros_type}): {err}")
    sub = await bus.subscribe(route.stream)
    try:
        async for sample in sub:
            try:
                frame = decode_frame(sample.payload)
            except EncodingError as err:
                log.warning(f"undecodable frame on {route.stream}: {err}", throttle_duration_sec=5.0)
                continue
            for msg in frame_messages(frame, route):
                try:
                    publisher(msg.topic, msg.ros_type).publish(bytes(msg.cdr))
                except (ValueError, ModuleNotFoundError, AttributeError) as err:
                    log.warning(f"cannot republish {msg.topic} ({msg.ros_type}): {err}", once=True)
            publisher(route.diagnostics, DIAGNOSTICS_TYPE).publish(
                frame_diagnostics_cdr(frame, route, distro=config.ros.distro)
            )
    finally:
        await sub.close()


async def serve(node: Any, params: NodeParams, stop: asyncio.Event) -> None:
    """Forward every configured frame stream until ``stop`` is set."""
    cfg = params.config
    async with open_bus(params.bus, namespace=params.bus_namespace) as bus:
        tasks = [asyncio.create_task(_forward(node, bus, r, cfg)) for r in cfg.frames]
        await stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def main(args: list[str] | None = None) -> int:
    """Run the node (needs rclpy)."""
    return run_node(NODE_NAME, args, serve)


if __name__ == "__main__":
    raise SystemExit(main())
