"""Latest-value state: a robot publishes its calibration and mission progress; a process that
starts later loads the newest value of every key at once and follows what changes."""

import asyncio
import tempfile

from embodied_bus import open_bus
from embodied_bus.state import StateService, open_state


async def main() -> None:
    async with open_bus("zenoh:", namespace="robot1") as bus:  # or "pulsar://host:6650"
        # On Zenoh a state service keeps the tables (`embodied-bus queue` hosts one); on Pulsar
        # each table is a compacted topic and nothing needs to run.
        stop = asyncio.Event()
        ready = asyncio.Event()
        with tempfile.TemporaryDirectory() as tmp:
            service = asyncio.create_task(StateService(bus, f"{tmp}/state.db").run(stop, ready))
            await ready.wait()

            robot = await open_state(bus, "robot")
            await robot.put("calibration/lidar_front", {"xyz_m": [1.2, 0.0, 1.5], "rpy_rad": [0, 0, 0]})
            for step in ("undocking", "driving", "picking"):
                await robot.put("mission/step", step)  # durable once it returns

            late = await open_state(bus, "robot")  # a process that starts now
            print("late joiner:", {key: entry.value for key, entry in sorted(late.snapshot().items())})

            async def follow() -> None:
                async for change in late.watch("mission/"):
                    print(f"changed: {change.key} = {change.value}")
                    return

            watcher = asyncio.create_task(follow())
            await asyncio.sleep(0)  # the watcher is listening
            await robot.put("mission/step", "placing")
            await watcher
            stop.set()
            await service


asyncio.run(main())
