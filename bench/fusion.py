#!/usr/bin/env python3
"""Fusion benchmark: the transport-free assembler on a realistic scenario (lidar 10 Hz, camera
30 Hz, GPS 5 Hz, IMU 200 Hz with stamp jitter and transport latency) and its fault variants,
plus samples/s through one fusion worker over embedded Zenoh. Prints one JSON document.

Latencies are in the scenario's simulated clock: a frame is "emitted" at the arrival time of the
sample whose push produced it. Added latency is reported over all complete frames and split by
whether every sample the frame could have used arrived (a frame that lost one can only be
decided when later data shows the loss). Assembler CPU time is process CPU time, the fastest of
three identical runs.

Beside ours, in the same run on the same samples: message_filters' ApproximateTime policy
(``bench/approximate_time.py``, a port of its published algorithm that reproduces the upstream
test cases) with the four topics, at a queue size of 10 (what examples use) and 100.

Usage: python bench/fusion.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from approximate_time import ApproximateTime  # noqa: E402

from embodied_bus.fusion import Assembler, LateSample, MultiModalFrame, load_spec  # noqa: E402
from embodied_bus.sim.scenario import Scenario, generate  # noqa: E402
from embodied_bus.sim.scenario import lost_input as scenario_lost_input  # noqa: E402

MS = 1_000_000
VARIANTS = {
    "nominal": {},
    "loss_5pct": {"loss": 0.05},
    "camera_blackout_2s": {"camera_blackout": (20.0, 2.0)},
    "camera_clock_offset_20ms": {"camera_offset_ns": 20 * MS},
    "camera_delay_spike_250ms": {"camera_delay_spike": (20.0, 1.0, 250 * MS)},
}


def pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


#: Repetitions of each variant's assembler run; the CPU time of the fastest is reported (the
#: output is deterministic, so every repetition does the same work).
CPU_REPEATS = 3


def run_variant(duration_s: float, **kw: Any) -> dict[str, Any]:
    spec = load_spec(ROOT / "config" / "fusion.yaml")
    lost: list[tuple[str, int]] = []
    samples = generate(Scenario(duration_s=duration_s, **kw), lost=lost)
    cpu_s = float("inf")
    frames: list[tuple[MultiModalFrame, int]] = []
    late = 0
    for rep in range(CPU_REPEATS):
        asm = Assembler(spec)
        got: list[tuple[MultiModalFrame, int]] = []
        n_late = 0
        t0 = time.process_time()
        for s in samples:
            for ev in asm.push(s):
                if isinstance(ev, MultiModalFrame) and ev.pane == 0:
                    got.append((ev, s.receive_ns))
                elif isinstance(ev, LateSample):
                    n_late += 1
        cpu_s = min(cpu_s, time.process_time() - t0)
        end_ns = samples[-1].receive_ns
        got += [(f, end_ns) for f in asm.flush() if isinstance(f, MultiModalFrame)]
        if rep == 0:
            frames, late = got, n_late
        elif [f.bucket for f, _ in got] != [f.bucket for f, _ in frames]:
            raise AssertionError("the assembler gave different frames for the same input")
    camera = next(st for st in spec.streams if st.name == "camera/front")
    skew_bound_ms = spec.skew_ns(camera) / MS
    # A frame "lost input" when a sample that its picks could have used was lost in transport.
    lost_input = scenario_lost_input(spec, lost)

    sweeps = sum(1 for s in samples if s.stream == "lidar/top")
    imu_total = sum(1 for s in samples if s.stream == "imu")
    with_lidar = [(f, t) for f, t in frames if f.member("lidar/top")]
    complete = [(f, t) for f, t in with_lidar if f.complete]
    skew = [
        abs(f.member("camera/front").skew_ns) / MS
        for f, _ in with_lidar  # type: ignore[union-attr]
        if f.member("camera/front")
    ]
    added = [(t - f.last_arrival_ns) / MS for f, t in complete]
    added_whole = [(t - f.last_arrival_ns) / MS for f, t in complete if not lost_input(f)]
    added_lost = [(t - f.last_arrival_ns) / MS for f, t in complete if lost_input(f)]
    e2e = [(t - f.reference_stamp_ns) / MS for f, t in with_lidar]
    imu_used = sum(len(f.members.get("imu", ())) for f, _ in frames)
    return {
        "frames_per_s": round(len(frames) / duration_s, 2),
        "lidar_coverage_pct": round(100 * len(with_lidar) / sweeps, 2),
        "imu_samples_used_pct": round(100 * imu_used / imu_total, 2),
        "complete_pct": round(100 * len(complete) / max(1, len(with_lidar)), 2),
        "lidar_camera_skew_p50_ms": pct(skew, 50),
        "lidar_camera_skew_p99_ms": pct(skew, 99),
        "max_skew_ms": round(max(skew), 3) if skew else None,
        "skew_bound_ms": skew_bound_ms,
        "skew_within_bound": not skew or max(skew) <= skew_bound_ms,
        "added_latency_p50_ms": pct(added, 50),
        "added_latency_p99_ms": pct(added, 99),
        "complete_frames_with_all_input": len(added_whole),
        "added_latency_p99_ms_all_input_arrived": pct(added_whole, 99),
        "complete_frames_that_lost_input": len(added_lost),
        "added_latency_p99_ms_lost_input": pct(added_lost, 99),
        "end_to_end_p50_ms": pct(e2e, 50),
        "end_to_end_p99_ms": pct(e2e, 99),
        "late": late,
        "incomplete": len(with_lidar) - len(complete),
        "assembler_cpu_us_per_sample": round(cpu_s / len(samples) * 1e6, 2),
        "assembler_samples_per_s": round(len(samples) / cpu_s),
    }


#: Topics of the message_filters synchronizer, in its input order (the lidar first).
TOPICS = ("lidar/top", "camera/front", "gps", "imu")
#: Queue sizes the message_filters synchronizer is measured at.
QUEUE_SIZES = (10, 100)


def run_message_filters(duration_s: float, queue_size: int, **kw: Any) -> dict[str, Any]:
    """message_filters' ApproximateTime on the variant's samples, in arrival order: a set is
    emitted at the arrival time of the sample whose ``add`` completed it."""
    samples = generate(Scenario(duration_s=duration_s, **kw))
    sets: list[tuple[list[Any], int]] = []
    now = [0]
    sync = ApproximateTime(len(TOPICS), queue_size, lambda got: sets.append(([m for _, m in got], now[0])))
    index = {name: i for i, name in enumerate(TOPICS)}
    t0 = time.process_time()
    for s in samples:
        now[0] = s.receive_ns
        sync.add(index[s.stream], s.stamp_ns, s)
    cpu_s = time.process_time() - t0
    sweeps = sum(1 for s in samples if s.stream == "lidar/top")
    imu_total = sum(1 for s in samples if s.stream == "imu")
    skew = [abs(m[1].stamp_ns - m[0].stamp_ns) / MS for m, _ in sets]
    added = [(t - max(x.receive_ns for x in m)) / MS for m, t in sets]
    e2e = [(t - m[0].stamp_ns) / MS for m, t in sets]
    return {
        "queue_size": queue_size,
        "sets_per_s": round(len(sets) / duration_s, 2),
        "lidar_coverage_pct": round(100 * len(sets) / sweeps, 2),
        "imu_samples_used_pct": round(100 * len(sets) / imu_total, 2),
        "lidar_camera_skew_p50_ms": pct(skew, 50),
        "lidar_camera_skew_p99_ms": pct(skew, 99),
        "max_skew_ms": round(max(skew), 3) if skew else None,
        "added_latency_p50_ms": pct(added, 50),
        "added_latency_p99_ms": pct(added, 99),
        "end_to_end_p50_ms": pct(e2e, 50),
        "end_to_end_p99_ms": pct(e2e, 99),
        "dropped_silently": sync.dropped,
        "cpu_us_per_sample": round(cpu_s / len(samples) * 1e6, 2),
    }


async def through_zenoh_worker(n_seconds: float) -> dict[str, Any]:
    from embodied_bus import Backpressure, PublisherOptions, open_bus
    from embodied_bus.fusion.worker import FusionWorker
    from embodied_bus.testing.ports import free_port

    spec = load_spec(ROOT / "config" / "fusion.yaml")
    samples = generate(Scenario(duration_s=n_seconds))
    port = free_port()
    async with (
        open_bus(f"zenoh:?listen=tcp/127.0.0.1:{port}", namespace="bf") as a,
        open_bus(f"zenoh://127.0.0.1:{port}", namespace="bf") as b,
    ):
        worker = FusionWorker(b, spec, idle_flush_s=0.5, capacity=len(samples))
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        await worker.ready.wait()
        pubs = {
            n: await a.publisher(
                n, clock=spec.clock, options=PublisherOptions(backpressure=Backpressure.BLOCK)
            )
            for n in ("lidar/top", "camera/front", "gps", "imu")
        }
        for p in pubs.values():
            await p.wait_for_subscribers(10)
        t0 = time.perf_counter()
        for s in samples:
            await pubs[s.stream].publish(b"", stamp_ns=s.stamp_ns)
        while worker.assembler.stats.samples < len(samples) and time.perf_counter() - t0 < 60:
            await asyncio.sleep(0.005)
        dt = time.perf_counter() - t0
        stop.set()
        await task
    return {"samples": len(samples), "seconds": round(dt, 3), "samples_per_s": round(len(samples) / dt)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="30 s scenarios instead of 60 s")
    args = ap.parse_args()
    duration = 30.0 if args.quick else 60.0
    doc: dict[str, Any] = {
        "benchmark": "fusion",
        "scenario_s": duration,
        "variants": {k: run_variant(duration, **v) for k, v in VARIANTS.items()},
    }
    doc["one_worker_over_zenoh"] = asyncio.run(through_zenoh_worker(10.0 if args.quick else 20.0))
    doc["targets"] = {
        "lidar_coverage_pct": ">= 99.9",
        "complete_pct_at_5pct_loss": ">= 99",
        "added_latency_p99_ms_when_complete": "<= 5",
        "skew_never_above_configured_bound": True,
        "assembler_samples_per_s": ">= 100000",
    }
    doc["message_filters_approximate_time"] = {
        k: {f"queue_{q}": run_message_filters(duration, q, **v) for q in QUEUE_SIZES}
        for k, v in VARIANTS.items()
    }
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
