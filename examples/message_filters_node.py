"""A ROS 2 node that pairs each lidar sweep with a camera image, written for message_filters; with
``--bus`` the same code runs on the bus's fused frames, one import changed.

    python examples/message_filters_node.py                     # ROS 2 message_filters
    EMBODIED_BUS_CONFIG=config/robot.yaml \\
        python examples/message_filters_node.py --bus           # the bus's fused frames

Needs a ROS 2 Python (rclpy, sensor_msgs, message_filters); with ``--bus``, a fusion worker of
the robot YAML's spec (``embodied-bus fuse --config robot.yaml``) and its ``sensor_bridge``.
Prints one line per set (the members' stamps), then a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import rclpy
from rclpy.qos import QoSProfile, ReliabilityPolicy
from rosidl_runtime_py.utilities import get_message


def stamp_ns(msg: Any) -> int:
    return int(msg.header.stamp.sec) * 1_000_000_000 + int(msg.header.stamp.nanosec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bus", action="store_true", help="sets from the bus's fused frames")
    ap.add_argument("--topics", nargs="+", default=["/lidar/points", "/camera/image_raw"])
    ap.add_argument("--types", nargs="+", default=["sensor_msgs/msg/PointCloud2", "sensor_msgs/msg/Image"])
    ap.add_argument("--queue-size", type=int, default=10)
    ap.add_argument("--slop", type=float, default=0.05, help="seconds")
    ap.add_argument("--idle-s", type=float, default=3.0, help="stop once nothing came for this long")
    ap.add_argument("--timeout-s", type=float, default=60.0)
    args = ap.parse_args()

    if args.bus:
        from embodied_bus.ros import message_filters
    else:
        import message_filters  # type: ignore[import-not-found, no-redef]

    rclpy.init()
    node = rclpy.create_node("pairing")
    qos = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
    subs = [
        message_filters.Subscriber(node, get_message(t), topic, qos_profile=qos)
        for topic, t in zip(args.topics, args.types, strict=True)
    ]
    sync = message_filters.ApproximateTimeSynchronizer(subs, args.queue_size, args.slop)
    sets: list[list[int]] = []
    drops: list[dict[str, Any]] = []
    last = [0.0]

    def on_set(*msgs: Any) -> None:
        sets.append([stamp_ns(m) for m in msgs])
        last[0] = time.monotonic()
        print("set", *sets[-1], flush=True)

    sync.registerCallback(on_set)
    if args.bus:  # what message_filters cannot tell: each frame that gave no set, and why

        def on_drop(d: Any) -> None:
            drops.append({"reason": d.reason.value, "stamp_ns": d.reference_stamp_ns, "detail": d.detail})
            last[0] = time.monotonic()

        sync.registerDropCallback(on_drop)
    print("ready", file=sys.stderr, flush=True)
    deadline = time.monotonic() + args.timeout_s
    while time.monotonic() < deadline and not (last[0] and time.monotonic() - last[0] > args.idle_s):
        rclpy.spin_once(node, timeout_sec=0.05)
    summary: dict[str, Any] = {"sets": sets}
    if args.bus:
        summary |= {"drops": drops, "stats": sync.stats.as_dict()}
        sync.close()
    node.destroy_node()
    rclpy.try_shutdown()
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
