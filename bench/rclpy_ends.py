"""The rclpy ends of ``bench/ros_rclpy.py``, run by a ROS 2 Python (each its own process).

    python rclpy_ends.py pub --topic T --size B --count N [--rate HZ]   (0: as fast as it can)
    python rclpy_ends.py sub --topic T --count N [--timeout-s S]
    python rclpy_ends.py relay --topic T --out T2                        (until SIGTERM)

PointCloud2 messages, reliable QoS keeping all history; each header stamp is the wall clock at
publish, so a subscriber on the same machine reads its latency from it. Each prints one JSON
line (``pub`` once every message is acknowledged, ``sub`` once it has them all).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from typing import Any

import numpy as np
import rclpy
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import PointCloud2

QOS = QoSProfile(depth=100, history=HistoryPolicy.KEEP_ALL, reliability=ReliabilityPolicy.RELIABLE)


def cmd_pub(args: argparse.Namespace) -> dict[str, Any]:
    node = rclpy.create_node("bench_pub")
    pub = node.create_publisher(PointCloud2, args.topic, QOS)
    msg = PointCloud2()
    msg.height, msg.width, msg.point_step = 1, max(1, args.size // 16), 16
    msg.row_step = msg.width * 16
    msg.data = bytes(args.size)
    msg.header.frame_id = "bench"
    deadline = time.monotonic() + 30
    while pub.get_subscription_count() < 1 and time.monotonic() < deadline:
        rclpy.spin_once(node, timeout_sec=0.05)
    time.sleep(0.5)  # the subscriber's side of discovery
    period = 1.0 / args.rate if args.rate > 0 else 0.0
    t0_ns = time.time_ns()
    t0 = time.monotonic()
    for i in range(args.count):
        now = time.time_ns()
        msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(now, 1_000_000_000)
        pub.publish(msg)
        if period:
            delay = t0 + (i + 1) * period - time.monotonic()
            if delay > 0:
                time.sleep(delay)
    end_ns = time.time_ns()
    pub.wait_for_all_acked(rclpy.duration.Duration(seconds=60))
    return {"count": args.count, "t0_ns": t0_ns, "end_ns": end_ns}


def cmd_sub(args: argparse.Namespace) -> dict[str, Any]:
    node = rclpy.create_node("bench_sub")
    lat: list[int] = []
    last = [0]

    def on_msg(m: PointCloud2) -> None:
        now = time.time_ns()
        lat.append(now - (m.header.stamp.sec * 1_000_000_000 + m.header.stamp.nanosec))
        last[0] = now

    node.create_subscription(PointCloud2, args.topic, on_msg, QOS)
    print("ready", file=sys.stderr, flush=True)
    deadline = time.monotonic() + args.timeout_s
    while len(lat) < args.count and time.monotonic() < deadline:
        rclpy.spin_once(node, timeout_sec=0.05)
    a = np.asarray(lat or [0], dtype=np.int64) / 1e6
    return {
        "received": len(lat),
        "last_ns": last[0],
        "p50_ms": float(np.percentile(a, 50)),
        "p99_ms": float(np.percentile(a, 99)),
    }


def cmd_relay(args: argparse.Namespace) -> dict[str, Any]:
    """The floor of any Python hop: raw bytes in, the same bytes out, in rclpy's callback."""
    node = rclpy.create_node("bench_relay")
    out = node.create_publisher(PointCloud2, args.out, QOS)
    node.create_subscription(PointCloud2, args.topic, out.publish, QOS, raw=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    print("ready", file=sys.stderr, flush=True)
    while not done.is_set():
        rclpy.spin_once(node, timeout_sec=0.05)
    return {}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("command", choices=["pub", "sub", "relay"])
    ap.add_argument("--topic", required=True)
    ap.add_argument("--out", default="")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--rate", type=float, default=0.0)
    ap.add_argument("--timeout-s", type=float, default=120.0)
    args = ap.parse_args()
    rclpy.init()
    try:
        out = {"pub": cmd_pub, "sub": cmd_sub, "relay": cmd_relay}[args.command](args)
    finally:
        rclpy.try_shutdown()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
