"""A planner and an executor with a durable queue service, all on one embedded Zenoh bus: an
action with feedback and a result, a retried one, and a poison one in the dead-letter queue."""

import asyncio
import tempfile
from pathlib import Path

from embodied_bus import open_bus
from embodied_bus.actions import Action, ActionContext, Executor, PermanentFailure, Planner, QueueService


async def main() -> None:
    async with open_bus("zenoh:", namespace="robot1") as bus:
        stop, service_stop, ready = asyncio.Event(), asyncio.Event(), asyncio.Event()
        db = Path(tempfile.mkdtemp()) / "actions.db"
        service = asyncio.create_task(QueueService(bus, db).run(service_stop, ready))
        await ready.wait()

        ex = Executor(bus, "arm")

        @ex.handler("pick")
        async def pick(action: Action, ctx: ActionContext) -> dict[str, str]:
            for progress in (0.25, 0.5, 0.75):
                await asyncio.sleep(0.1)  # moving the arm
                ctx.feedback({"progress": progress})
            if action.payload["obj"] == "ghost":
                raise PermanentFailure("no such object")  # dead-lettered at once
            if action.payload["obj"] == "slippery" and ctx.attempt == 1:
                raise RuntimeError("gripper slipped")  # a nack: retried
            await ctx.checkpoint({"grasped": True})
            return {"picked": action.payload["obj"]}

        running = asyncio.create_task(ex.run(stop))
        async with Planner(bus) as planner:
            handles = [
                await planner.submit("pick", {"obj": o}, priority=5) for o in ("cup", "slippery", "ghost")
            ]
            async for fb in handles[0].feedback():  # until the action ends
                print("feedback:", fb)
            for h in handles:
                done = await h.result(timeout_s=30)
                print(done.payload["obj"], done.status.value, done.result, [t.outcome for t in done.attempts])
            print(
                "dead letters:",
                [(a.payload["obj"], a.attempts[-1].reason) for a in await planner.dead_letters()],
            )
        stop.set()
        await running
        service_stop.set()
        await service


asyncio.run(main())
