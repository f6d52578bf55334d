"""A fusion worker on your own spec: one frame per 10 Hz lidar sweep with the nearest camera
image and the IMU samples between the midpoints to the neighbouring sweeps, from synthetic
sensors on an embedded Zenoh bus."""

import asyncio

from embodied_bus import open_bus
from embodied_bus.fusion import spec_from_dict
from embodied_bus.fusion.worker import FusionWorker
from embodied_bus.sim import DEFAULT_SENSORS, run_sensor

SPEC = spec_from_dict(
    {
        "name": "mine",
        "bucket_width_ms": 100,
        "bucket_offset_ms": 50,
        "streams": {
            "lidar/top": {"role": "reference", "expected_period_ms": 100},
            "camera/front": {"role": "required", "max_skew_ms": 40},
            "imu": {"role": "optional", "pick": "all", "window": "around"},
        },
    }
)


async def main() -> None:
    async with open_bus("zenoh:", namespace="robot1") as bus:
        frames = []
        worker = FusionWorker(bus, SPEC, on_frame=lambda frame, _emitted_ns: frames.append(frame))
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        await worker.ready.wait()
        sensors = [s for s in DEFAULT_SENSORS if s.stream in ("lidar/top", "camera/front", "imu")]
        publish = asyncio.Event()
        pubs = [
            await bus.publisher(
                s.stream, modality=s.modality, encoding=s.encoding, frame_id=s.frame_id, clock=SPEC.clock
            )
            for s in sensors
        ]
        runs = [asyncio.create_task(run_sensor(p, s, publish)) for p, s in zip(pubs, sensors, strict=True)]
        await asyncio.sleep(2.0)  # two seconds of sensor data
        publish.set()
        await asyncio.gather(*runs)
        stop.set()  # the worker publishes what is still open
        await task
        for f in frames[:5]:
            members = {name: len(ms) for name, ms in f.members.items()}
            skew = "n/a" if f.max_skew_ns is None else f"{f.max_skew_ns / 1e6:.1f} ms"
            print(f"sweep at {f.reference_stamp_ns}: complete={f.complete} members={members} skew {skew}")
        print(worker.summary()["completeness_pct"], "% complete of", len(frames), "frames")


asyncio.run(main())
