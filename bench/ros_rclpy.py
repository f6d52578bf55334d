#!/usr/bin/env python3
"""rclpy publisher → ``sensor_bridge`` (the rclpy node, over Fast DDS) → bus → a bus subscriber,
against an rclpy publisher → an rclpy subscriber directly, in the same run; and the floor of any
Python hop: a bare rclpy relay (raw bytes in, the same bytes out, in its callback) → an rclpy
subscriber. PointCloud2, reliable QoS keeping all history; latency from each header stamp (one
machine, one clock). Prints one JSON document.

Usage: python bench/ros_rclpy.py [--quick] [--case 1KiB|1MiB|latency_1KiB|latency_1MiB ...]

``ratio`` = messages/s received through the bridge / received direct (target ≥ 0.8 at 1 KiB and
1 MiB), ``ratio_floor`` the same through the bare relay; ``added_p50_ms``/``added_p99_ms`` =
latency through the bridge minus direct for the paced cases (target p50 ≤ 1 ms at 1 KiB).
Needs a ROS 2 Python (``python -m embodied_bus.testing.ros2 setup``); without one the document
says why.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from embodied_bus import Backpressure, SubscriptionOptions, open_bus
from embodied_bus.testing.ports import free_port
from embodied_bus.testing.ros2 import RosPython, find_ros_python

ROOT = Path(__file__).resolve().parents[1]
ENDS = Path(__file__).with_name("rclpy_ends.py")
LOSSLESS = SubscriptionOptions(capacity=100_000, backpressure=Backpressure.BLOCK)
CASES: dict[str, dict[str, Any]] = {
    "1KiB": {"size": 1024, "count": 20_000, "rate": 0.0},
    "1MiB": {"size": 1 << 20, "count": 500, "rate": 0.0},
    "latency_1KiB": {"size": 1024, "count": 1000, "rate": 200.0},
    "latency_1MiB": {"size": 1 << 20, "count": 100, "rate": 20.0},
}
QUICK_COUNT = {"1KiB": 3000, "1MiB": 100, "latency_1KiB": 200, "latency_1MiB": 40}


class Ros:
    """The ROS 2 Python and one ROS domain for the run."""

    def __init__(self, ros: RosPython) -> None:
        self.ros = ros
        self.env = ros.environ(ROS_DOMAIN_ID=str(random.randint(101, 200)))

    def start(self, *argv: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [str(self.ros.python), *argv],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )

    def ready(self, *argv: str, marker: str = "ready") -> subprocess.Popen[str]:
        proc = self.start(*argv)
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if marker in line:
                return proc
            if not line and proc.poll() is not None:
                break
        proc.kill()
        raise RuntimeError(f"{argv[:3]} did not start")


def result(proc: subprocess.Popen[str], timeout_s: float = 180.0) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{proc.args[1:4]} failed: {err[-800:]}")  # type: ignore[index]
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def pub_argv(topic: str, case: dict[str, Any]) -> list[str]:
    return [str(ENDS), "pub", "--topic", topic, *("--size", str(case["size"])),
            *("--count", str(case["count"])), "--rate", str(case["rate"])]  # fmt: skip


def summary(pub: dict[str, Any], received: int, last_ns: int, p50_ms: float, p99_ms: float) -> dict[str, Any]:
    span_s = max(1e-9, (last_ns - pub["t0_ns"]) / 1e9)
    return {
        "published": pub["count"],
        "received": received,
        "rate_hz": round(received / span_s, 1),
        "latency_p50_ms": round(p50_ms, 3),
        "latency_p99_ms": round(p99_ms, 3),
    }


def rclpy_path(ros: Ros, topic_in: str, topic_out: str, case: dict[str, Any]) -> dict[str, Any]:
    """rclpy publisher on ``topic_in`` → (whatever relays) → an rclpy subscriber on ``topic_out``."""
    sub = ros.ready(str(ENDS), "sub", "--topic", topic_out, "--count", str(case["count"]))
    pub = result(ros.start(*pub_argv(topic_in, case)))
    got = result(sub)
    return summary(pub, got["received"], got["last_ns"], got["p50_ms"], got["p99_ms"])


async def bridge_path(ros: Ros, config: Path, port: int, case: dict[str, Any]) -> dict[str, Any]:
    """rclpy publisher → sensor_bridge → bus → this process's subscription."""
    async with open_bus(f"zenoh:?listen=tcp/127.0.0.1:{port}", namespace="bench") as bus:
        sub = await bus.subscribe("bench/cloud", options=LOSSLESS)
        node = await asyncio.to_thread(
            ros.ready, "-m", "embodied_bus.ros.nodes.sensor_bridge", "--ros-args", "-p", f"config:={config}",
            marker="-> bus stream bench/cloud",
        )  # fmt: skip
        try:
            publisher = ros.start(*pub_argv("/bench/in", case))
            lat: list[int] = []
            last_ns = 0
            while len(lat) < case["count"]:
                try:
                    batch = await sub.recv_many(1000, timeout_s=30)
                except TimeoutError:
                    break
                now = time.time_ns()
                lat.extend(now - s.stamp_ns for s in batch)
                last_ns = now
            pub = await asyncio.to_thread(result, publisher)
        finally:
            await asyncio.to_thread(stop, node)
    a = np.asarray(lat or [0], dtype=np.int64) / 1e6
    return summary(pub, len(lat), last_ns, float(np.percentile(a, 50)), float(np.percentile(a, 99)))


def compare(
    direct: dict[str, Any], bridged: dict[str, Any], floor: dict[str, Any], paced: bool
) -> dict[str, Any]:
    doc: dict[str, Any] = {"direct": direct, "bridge": bridged, "relay_floor": floor}
    doc["ratio"] = round(bridged["rate_hz"] / direct["rate_hz"], 3)
    doc["ratio_floor"] = round(floor["rate_hz"] / direct["rate_hz"], 3)
    if paced:
        doc["added_p50_ms"] = round(bridged["latency_p50_ms"] - direct["latency_p50_ms"], 3)
        doc["added_p99_ms"] = round(bridged["latency_p99_ms"] - direct["latency_p99_ms"], 3)
        doc["floor_added_p50_ms"] = round(floor["latency_p50_ms"] - direct["latency_p50_ms"], 3)
    return doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="only this case (repeatable)")
    args = ap.parse_args()
    found = find_ros_python()
    if isinstance(found, str):
        print(json.dumps({"bench": "ros_rclpy", "skipped": found}))
        return 0
    ros = Ros(found)
    port = free_port()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "robot.yaml"
        config.write_text(
            f"bus: zenoh://127.0.0.1:{port}\nnamespace: bench\n"
            "streams:\n  bench/cloud: {topic: /bench/in, type: sensor_msgs/msg/PointCloud2, qos: default}\n"
        )
        for name, case in CASES.items():
            if args.case and name not in args.case:
                continue
            case = dict(case, count=QUICK_COUNT[name] if args.quick else case["count"])
            direct = rclpy_path(ros, "/bench/direct", "/bench/direct", case)
            bridged = asyncio.run(bridge_path(ros, config, port, case))
            relay = ros.ready(str(ENDS), "relay", "--topic", "/bench/relay_in", "--out", "/bench/relayed")
            try:
                floor = rclpy_path(ros, "/bench/relay_in", "/bench/relayed", case)
            finally:
                stop(relay)
            results[name] = compare(direct, bridged, floor, paced=case["rate"] > 0)
            print(f"{name}: {json.dumps(results[name])}", file=sys.stderr, flush=True)
    print(
        json.dumps(
            {"bench": "ros_rclpy", "middleware": "rmw_fastrtps_cpp", "quick": args.quick, **results}, indent=2
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
