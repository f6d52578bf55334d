#!/usr/bin/env python3
"""Fusion benchmark: our assembler beside message_filters' own ApproximateTimeSynchronizer, in
the same run, on the same samples: a nominal robot (lidar 10 Hz, camera 30 Hz, GPS 5 Hz, IMU
200 Hz with stamp jitter and transport latency), its fault variants, and sensor clocks as
robots have them (a 10.03 or 9.98 Hz lidar, a 29.97 Hz camera with 3 ms jitter, IMU jitter, a
clock offset, stamp bursts under load). Plus samples/s through one fusion worker over embedded
Zenoh and of the assembler alone. Prints one JSON document.

Ours, per scenario: sweeps in exactly one frame, camera images used, IMU samples in exactly one
frame, camera skew p99, added latency p50/p99 (in the scenario's clock: a frame is "emitted" at
the arrival of the sample whose push produced it), and whether the frames equal the offline
computation's (every nearest member truly the nearest). message_filters: the real ROS 2 Jazzy
Python synchronizer, run under a Python with rclpy (``python -m embodied_bus.testing.ros2
setup``), at queue size 10 / slop 50 ms and queue size 100 / slop 100 ms; where none is there,
the C++ ApproximateTime policy's port (``bench/approximate_time.py``), labelled so.

Usage: python bench/fusion.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from approximate_time import ApproximateTime  # noqa: E402

from embodied_bus.fusion import Assembler, MultiModalFrame, load_spec  # noqa: E402
from embodied_bus.fusion.offline import digest, frame_record, offline_frames  # noqa: E402
from embodied_bus.sim.scenario import REAL_CLOCKS, Scenario, generate  # noqa: E402
from embodied_bus.testing.ros2 import find_ros_python  # noqa: E402

MS = 1_000_000
SPEC = load_spec(ROOT / "config" / "fusion.yaml")
TOPICS = ("lidar/top", "camera/front", "gps", "imu")
SCENARIOS: dict[str, Scenario] = {
    "nominal_10hz": Scenario(),
    "loss_5pct": Scenario(loss=0.05),
    "camera_blackout_2s": Scenario(camera_blackout=(8.0, 2.0)),  # inside the --quick run too
    "camera_delay_spike_250ms": Scenario(camera_delay_spike=(8.0, 1.0, 250 * MS)),
    **REAL_CLOCKS,
}
#: (queue size, slop s) of the message_filters runs.
MF_CONFIGS = ((10, 0.05), (100, 0.1))
#: Repetitions of each assembler run; the CPU time of the fastest is reported.
CPU_REPEATS = 3


def pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


def ours(samples: list[Any]) -> dict[str, Any]:
    cpu_s = float("inf")
    frames: list[tuple[MultiModalFrame, int]] = []
    for _ in range(CPU_REPEATS):
        asm = Assembler(SPEC)
        got: list[tuple[MultiModalFrame, int]] = []
        t0 = time.process_time()
        for s in samples:
            for ev in asm.push(s):
                if isinstance(ev, MultiModalFrame) and ev.pane == 0:
                    got.append((ev, s.receive_ns))
        cpu_s = min(cpu_s, time.process_time() - t0)
        got += [(f, samples[-1].receive_ns) for f in asm.flush() if isinstance(f, MultiModalFrame)]
        frames = got
    count = Counter(s.stream for s in samples)

    def once_pct(stream: str) -> float:
        uses = Counter((m.sample.seq) for f, _ in frames for m in f.members.get(stream, ()))
        return round(100 * sum(1 for v in uses.values() if v == 1) / max(1, count[stream]), 2)

    cam = [abs(f.members["camera/front"][0].skew_ns) / MS for f, _ in frames if f.member("camera/front")]
    added = [(t - f.last_arrival_ns) / MS for f, t in frames if f.last_arrival_ns]
    same = digest(frame_record(f) for f, _ in frames) == digest(offline_frames(SPEC, samples))
    return {
        "sweeps_in_exactly_one_frame_pct": once_pct("lidar/top"),
        "camera_used_pct": once_pct("camera/front"),
        "imu_in_exactly_one_frame_pct": once_pct("imu"),
        "camera_skew_p99_ms": pct(cam, 99),
        "added_latency_p50_ms": pct(added, 50),
        "added_latency_p99_ms": pct(added, 99),
        "frames_with_reference_lost": sum(1 for f, _ in frames if "lidar/top" in f.missing),
        "equal_to_offline": same,
        "assembler_samples_per_s": round(len(samples) / cpu_s),
    }


def message_filters_real(samples: dict[str, list[Any]], python: Path, env: dict[str, str]) -> dict[str, Any]:
    """The real synchronizer on each scenario, in one child process per scenario."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, ss in samples.items():
            path = Path(tmp) / f"{name}.json"
            rows = [[TOPICS.index(s.stream), s.stamp_ns, s.receive_ns, s.seq] for s in ss]
            path.write_text(json.dumps({"topics": TOPICS, "samples": rows, "configs": MF_CONFIGS}))
            run = subprocess.run(
                [str(python), str(ROOT / "bench" / "message_filters_sets.py"), str(path)],
                capture_output=True,
                text=True,
                env=env,
                timeout=600,
                check=True,
            )
            out[name] = json.loads(run.stdout.strip().splitlines()[-1])["runs"]
    return out


def message_filters_port(samples: list[Any], queue_size: int) -> dict[str, Any]:
    """The C++ ApproximateTime policy's port (when no real message_filters is there)."""
    sets: list[tuple[list[Any], int]] = []
    now = [0]
    sync = ApproximateTime(len(TOPICS), queue_size, lambda got: sets.append(([m for _, m in got], now[0])))
    for s in samples:
        now[0] = s.receive_ns
        sync.add(TOPICS.index(s.stream), s.stamp_ns, s)
    count = Counter(s.stream for s in samples)
    used = {t: len({id(m[i]) for m, _ in sets}) for i, t in enumerate(TOPICS)}
    cam = [abs(m[1].stamp_ns - m[0].stamp_ns) / MS for m, _ in sets]
    added = [(t - max(x.receive_ns for x in m)) / MS for m, t in sets]
    return {
        "queue_size": queue_size,
        "sets": len(sets),
        "used_pct": {t: round(100 * used[t] / max(1, count[t]), 2) for t in TOPICS},
        "camera_skew_p99_ms": pct(cam, 99),
        "added_latency_p50_ms": pct(added, 50),
        "added_latency_p99_ms": pct(added, 99),
        "dropped_silently": sync.dropped,
    }


async def publish_scenario(endpoint: str, n_seconds: float) -> None:
    """The publisher process: the scenario's samples to the worker as fast as the engine takes
    them, consecutive samples of one stream in one run (as a driver reading a burst would)."""
    from embodied_bus import Backpressure, PublisherOptions, open_bus

    samples = generate(Scenario(duration_s=n_seconds))
    opts = PublisherOptions(backpressure=Backpressure.BLOCK)
    async with open_bus(f"zenoh://{endpoint}", namespace="bf") as bus:
        pubs = {n: await bus.publisher(n, clock=SPEC.clock, options=opts) for n in TOPICS}
        for p in pubs.values():
            await p.wait_for_subscribers(20)
        i = 0
        while i < len(samples):
            j = i
            while j < len(samples) and samples[j].stream == samples[i].stream and j - i < 256:
                j += 1
            await pubs[samples[i].stream].publish_many(
                [b""] * (j - i), stamps_ns=[s.stamp_ns for s in samples[i:j]]
            )
            i = j
        for p in pubs.values():
            await p.flush()


async def _consume(n: int, consumer: str, n_seconds: float) -> dict[str, Any]:
    """Samples/s of one consumer (a fusion worker, or a bare subscription: the floor) of the
    publisher process, from its first sample to its last."""
    from embodied_bus import Backpressure, SubscriptionOptions, open_bus
    from embodied_bus.fusion.worker import FusionWorker
    from embodied_bus.testing.ports import free_port

    port = free_port()
    async with open_bus(f"zenoh:?listen=tcp/127.0.0.1:{port}", namespace="bf") as bus:
        stop = asyncio.Event()
        count: list[int] = [0]
        times: list[float] = []
        if consumer == "worker":
            worker = FusionWorker(bus, SPEC, idle_flush_s=1.0, capacity=16384)
            push_many = worker.push_many

            async def timed(samples: list[Any]) -> None:  # first and last sample handled
                times.append(time.perf_counter())
                await push_many(samples)
                times.append(time.perf_counter())

            worker.push_many = timed  # type: ignore[method-assign]
            task = asyncio.create_task(worker.run(stop))
            await worker.ready.wait()

            def done() -> int:
                return worker.assembler.stats.samples
        else:
            sub = await bus.subscribe(
                TOPICS, options=SubscriptionOptions(capacity=16384, backpressure=Backpressure.BLOCK)
            )

            async def drain() -> None:
                async for _ in sub:
                    if not count[0]:
                        times.append(time.perf_counter())
                    count[0] += 1
                    if count[0] == n:
                        times.append(time.perf_counter())

            task = asyncio.create_task(drain())

            def done() -> int:
                return count[0]

        pub = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--publish", f"127.0.0.1:{port}", str(n_seconds)
        )
        deadline = time.perf_counter() + 120
        while done() < n and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
        dt = times[-1] - times[0]
        await pub.wait()
        stop.set()
        if consumer == "worker":
            await task
        else:
            task.cancel()
    out = {"samples": done(), "seconds": round(dt, 3), "samples_per_s": round(done() / dt)}
    if consumer == "worker":
        out["waits_for_a_stream_behind"] = worker.summary()["aligned_waits"]
    return out


def through_zenoh(n_seconds: float) -> dict[str, Any]:
    """One fusion worker fed by a publisher process over Zenoh, beside a bare subscription of
    the same samples in the same run (the floor: what the engine hands a Python consumer)."""
    n = len(generate(Scenario(duration_s=n_seconds)))
    worker = asyncio.run(_consume(n, "worker", n_seconds))
    floor = asyncio.run(_consume(n, "subscription", n_seconds))
    return {
        "worker": worker,
        "bare_subscription": floor,
        "ratio_to_bare_subscription": round(worker["samples_per_s"] / floor["samples_per_s"], 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="20 s scenarios instead of 60 s")
    ap.add_argument("--publish", nargs=2, metavar=("ENDPOINT", "SECONDS"), help=argparse.SUPPRESS)
    ap.add_argument("--only-worker", action="store_true", help="only the worker throughput")
    args = ap.parse_args()
    if args.publish:
        asyncio.run(publish_scenario(args.publish[0], float(args.publish[1])))
        return 0
    if args.only_worker:
        print(json.dumps({"one_worker_over_zenoh": through_zenoh(10.0 if args.quick else 120.0)}))
        return 0
    duration = 20.0 if args.quick else 60.0
    samples = {name: generate(dataclasses.replace(sc, duration_s=duration)) for name, sc in SCENARIOS.items()}
    doc: dict[str, Any] = {
        "benchmark": "fusion",
        "scenario_s": duration,
        "ours": {name: ours(ss) for name, ss in samples.items()},
    }
    ros = find_ros_python()
    if isinstance(ros, str):
        doc["message_filters"] = {
            "implementation": f"port of the C++ ApproximateTime policy ({ros})",
            "scenarios": {
                name: [message_filters_port(ss, q) for q, _ in MF_CONFIGS] for name, ss in samples.items()
            },
        }
    else:
        doc["message_filters"] = {
            "implementation": "message_filters.ApproximateTimeSynchronizer (ROS 2 Jazzy, Python)",
            "scenarios": message_filters_real(samples, ros.python, ros.environ()),
        }
    doc["one_worker_over_zenoh"] = through_zenoh(10.0 if args.quick else 120.0)
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
