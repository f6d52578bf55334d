#!/usr/bin/env python3
"""message_filters' own ApproximateTimeSynchronizer (ROS 2 Jazzy, Python) on samples given as
JSON, in their arrival order, with real sensor_msgs messages. Run by ``bench/fusion.py`` under a
Python with rclpy and message_filters (``python -m embodied_bus.testing.ros2 find``); prints one
JSON document.

Input (a file): ``{"topics": [...], "samples": [[topic index, stamp_ns, receive_ns, seq], ...],
"configs": [[queue_size, slop_s], ...]}``. A set is emitted at the receive time of the sample
whose ``add`` completed it; its added latency is that minus its latest member's receive time.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import message_filters
import numpy as np
from builtin_interfaces.msg import Time
from sensor_msgs.msg import Image, Imu, NavSatFix, PointCloud2

TYPES = {"lidar": PointCloud2, "camera": Image, "gps": NavSatFix, "imu": Imu}


def _type(topic: str) -> Any:
    return next((t for key, t in TYPES.items() if key in topic), Imu)


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


def run(topics: list[str], samples: list[list[int]], queue_size: int, slop_s: float) -> dict[str, Any]:
    inputs = [message_filters.SimpleFilter() for _ in topics]
    sync = message_filters.ApproximateTimeSynchronizer(inputs, queue_size, slop_s)
    sets: list[tuple[tuple[Any, ...], int]] = []
    now = [0]
    sync.registerCallback(lambda *msgs: sets.append((msgs, now[0])))
    msgs = []
    for index, stamp, receive, seq in samples:
        msg = _type(topics[index])()
        msg.header.stamp = Time(sec=stamp // 1_000_000_000, nanosec=stamp % 1_000_000_000)
        msg.header.frame_id = str(seq)
        msgs.append((index, msg, receive))
    arrival = {id(m): r for _, m, r in msgs}
    t0 = time.process_time()
    for index, msg, receive in msgs:
        now[0] = receive
        inputs[index].signalMessage(msg)
    cpu_s = time.process_time() - t0

    def stamp_of(m: Any) -> int:
        return m.header.stamp.sec * 1_000_000_000 + m.header.stamp.nanosec

    counts = [sum(1 for s in samples if s[0] == i) for i in range(len(topics))]
    used = [len({stamp_of(ms[i]) for ms, _ in sets}) for i in range(len(topics))]
    skew = [max(abs(stamp_of(m) - stamp_of(ms[0])) for m in ms[1:]) / 1e6 for ms, _ in sets]
    camera = next((i for i, t in enumerate(topics) if "camera" in t), None)
    cam_skew = [abs(stamp_of(ms[camera]) - stamp_of(ms[0])) / 1e6 for ms, _ in sets] if camera else []
    added = [(t - max(arrival[id(m)] for m in ms)) / 1e6 for ms, t in sets]
    return {
        "queue_size": queue_size,
        "slop_ms": slop_s * 1e3,
        "sets": len(sets),
        "used_pct": {t: round(100 * u / max(1, n), 2) for t, u, n in zip(topics, used, counts, strict=True)},
        "skew_p99_ms": _pct(skew, 99),
        "camera_skew_p99_ms": _pct(cam_skew, 99),
        "added_latency_p50_ms": _pct(added, 50),
        "added_latency_p99_ms": _pct(added, 99),
        "cpu_us_per_sample": round(cpu_s / max(1, len(samples)) * 1e6, 2),
    }


def main() -> int:
    with open(sys.argv[1]) as fh:
        doc = json.load(fh)
    out = [run(doc["topics"], doc["samples"], int(q), float(slop)) for q, slop in doc["configs"]]
    print(json.dumps({"message_filters": message_filters.__file__, "runs": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
