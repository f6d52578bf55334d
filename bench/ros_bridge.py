#!/usr/bin/env python3
"""ROS → bus → ROS through ``embodied-bus ros-bridge`` against ros-z publishing straight to
ros-z, in the same run: a ros-z publisher floods ``sensor_msgs/PointCloud2`` and a ros-z
subscriber counts what arrives and how late (from each header stamp; one machine, one clock).
Also the floor: a hand-written zenoh-python relay (ROS key in → ROS key out in the Zenoh
callback, no bus) shows what any Python hop reaches. Prints one JSON document.

Usage: python bench/ros_bridge.py [--quick] [--case 1KiB|1MiB|1KiB_10kHz|latency_1KiB ...]

``ratio`` = messages/s received through the hop / messages/s received direct (target ≥ 0.8 for
the bridge at 1 KiB and 1 MiB); ``delivered_ratio`` = messages received through the bridge /
received direct; ``added_p50_ms``/``added_p99_ms`` = latency through the bridge minus direct
for paced cases (target p50 ≤ 0.5 ms at a steady 200 Hz of 1 KiB clouds). Needs ros-z beside the
repository (``test/ros_z.py`` installs its wheels); without it the document says why.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "test"))

CONFIG = """
ros: {connect: [%(endpoint)s], node_name: bench_bridge}
streams:
  bench/cloud: {topic: /bench/in, type: sensor_msgs/msg/PointCloud2, qos: default}
publish:
  streams: [{stream: bench/cloud, topic: /bench/out, type: sensor_msgs/msg/PointCloud2}]
"""
RELAY = """
import signal, sys, threading, time, zenoh
from embodied_bus.ros.config import RosLink
from embodied_bus.ros.rmw_node import RmwNode
from embodied_bus.ros.rmw_bridge import rmw_session_config
from embodied_bus.rosmsg.interfaces import Interfaces
from embodied_bus.rosmsg.rmw_zenoh import DEFAULT_QOS
link = RosLink(connect=(sys.argv[1],), node_name="bench_relay")
s = zenoh.open(rmw_session_config(link))
node = RmwNode(s, link, Interfaces())
out = node.publisher("/bench/out", "sensor_msgs/msg/PointCloud2")
relay = lambda smp: out.put(smp.payload.to_bytes())
node.subscribe("/bench/in", "sensor_msgs/msg/PointCloud2", DEFAULT_QOS, relay)
print("ready", flush=True)
done = threading.Event()
signal.signal(signal.SIGTERM, lambda *a: done.set())
done.wait()
"""


def run_json(argv: list[str], env: dict[str, str], timeout_s: float = 120.0) -> dict[str, Any]:
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"{argv[2:4]} failed: {out.stderr[-800:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def measure(
    endpoint: str, env: dict[str, str], topic_in: str, topic_out: str, *, size: int, count: int, rate: float
) -> dict[str, Any]:
    """One flood through ``topic_in`` → ``topic_out`` (the same topic when direct)."""
    from ros_z import peer_command

    sink_argv = ["--topic", topic_out, "--count", str(count), "--timeout-s", "60"]
    sink = subprocess.Popen(
        peer_command("sink", "--connect", endpoint, *sink_argv),
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    assert sink.stdout is not None
    sink.stdout.readline()  # ready
    flood_argv = ["--topic", topic_in, "--size", str(size), "--count", str(count), "--rate", str(rate)]
    flood = run_json(peer_command("flood", "--connect", endpoint, *flood_argv), env)
    out, _ = sink.communicate(timeout=90)
    got: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    got["published"] = flood["published"]
    return got


def spawn_ready(argv: list[str], env: dict[str, str], marker: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    for line in proc.stdout:
        if marker in line:
            return proc
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"{argv[1:4]} did not start")


def stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


CASES = ("1KiB", "1MiB", "1KiB_10kHz", "latency_1KiB")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--case", action="append", choices=CASES, help="run only this case (repeatable)")
    args = ap.parse_args()
    try:
        from ros_z import peer_env

        env = peer_env()
    except BaseException as err:  # pytest's skip: ros-z is not beside the repository
        print(json.dumps({"skipped": str(err) or type(err).__name__}))
        return 0
    from embodied_bus.testing.ports import free_port

    endpoint = f"tcp/127.0.0.1:{free_port()}"
    cases: dict[str, dict[str, Any]] = {
        "1KiB": {"size": 1024, "count": 3000 if args.quick else 20000, "rate": 0.0},
        "1MiB": {"size": 1 << 20, "count": 100 if args.quick else 1500, "rate": 0.0},
        "1KiB_10kHz": {"size": 1024, "count": 3000 if args.quick else 20000, "rate": 10000.0},
        "latency_1KiB": {"size": 1024, "count": 200 if args.quick else 1000, "rate": 200.0},
    }
    router = spawn_ready(
        [sys.executable, "-m", "embodied_bus.cli.main", "router", "--listen", endpoint], env, "router"
    )
    results: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            config = Path(tmp) / "robot.yaml"
            config.write_text(CONFIG % {"endpoint": endpoint})
            for name, case in cases.items():
                if args.case and name not in args.case:
                    continue
                direct = measure(endpoint, env, "/bench/direct", "/bench/direct", **case)
                bridge_argv = ["ros-bridge", "--config", str(config), "--bus", "zenoh:"]
                bridge = spawn_ready(
                    [sys.executable, "-m", "embodied_bus.cli.main", *bridge_argv], env, "ros-bridge: node"
                )
                try:
                    bridged = measure(endpoint, env, "/bench/in", "/bench/out", **case)
                finally:
                    stop(bridge)
                relay = spawn_ready([sys.executable, "-c", RELAY, endpoint], env, "ready")
                try:
                    floor = measure(endpoint, env, "/bench/in", "/bench/out", **case)
                finally:
                    stop(relay)
                results[name] = summarize(direct, bridged, floor, latency=case["rate"] > 0)
    finally:
        stop(router)
    print(json.dumps({"bench": "ros_bridge", "quick": args.quick, **results}, indent=2))
    return 0


def summarize(
    direct: dict[str, Any], bridged: dict[str, Any], floor: dict[str, Any], *, latency: bool
) -> dict[str, Any]:
    def ratio(a: dict[str, Any]) -> float | None:
        return (
            round(a["rate_hz"] / direct["rate_hz"], 3) if a.get("rate_hz") and direct.get("rate_hz") else None
        )

    doc: dict[str, Any] = {"direct": direct, "bridge": bridged, "relay_floor": floor}
    if direct.get("received"):  # what arrives through the bridge of what arrives without it
        doc["delivered_ratio"] = round(bridged["received"] / direct["received"], 3)
    if latency:
        doc["added_p50_ms"] = round(bridged["latency_p50_ms"] - direct["latency_p50_ms"], 4)
        doc["added_p99_ms"] = round(bridged["latency_p99_ms"] - direct["latency_p99_ms"], 4)
        doc["floor_added_p50_ms"] = round(floor["latency_p50_ms"] - direct["latency_p50_ms"], 4)
    doc["ratio"] = ratio(bridged)
    doc["ratio_floor"] = ratio(floor)
    return doc


if __name__ == "__main__":
    raise SystemExit(main())
