"""Replay a real ROS 1 recording (the shipped tilt_laser bag: LaserScan, IMU, GPS) into a fusion
worker at 4x speed with its recorded timing, and print what was fused."""

import asyncio
from pathlib import Path

from embodied_bus import open_bus
from embodied_bus.fusion import load_spec
from embodied_bus.fusion.worker import FusionWorker
from embodied_bus.replay import ReplayOptions, replay

ROOT = Path(__file__).resolve().parents[1]
BAG = ROOT / "data" / "tilt_laser" / "tilt_laser.bag"
TOPICS = {"/scan": "scan", "/imu_data": "imu", "/position_gps": "gps"}  # topic -> bus stream


async def main() -> None:
    spec = load_spec(ROOT / "config" / "demo.yaml")  # one frame per scan, its IMU samples, the held GPS fix
    async with open_bus("zenoh:", namespace="replay") as bus:
        worker = FusionWorker(bus, spec, idle_flush_s=0.5)
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        await worker.ready.wait()
        options = ReplayOptions(
            rate=4.0, topics=tuple(TOPICS), mapping=TOPICS, duration_s=8.0, clock=spec.clock
        )
        summary = await replay(bus, [BAG], options)
        print("replayed:", summary.as_dict()["messages"])
        stop.set()
        await task
        s = worker.summary()
        print(f"{s['frames']} frames, {s['completeness_pct']}% complete, presence {s['presence_pct']}")
        print("end to end:", s.get("end_to_end") or s["end_to_end_p50_ms"])


asyncio.run(main())
