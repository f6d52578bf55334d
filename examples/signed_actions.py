"""Signed actions: the executor runs only actions a key on its allow-list signed for this robot;
an unsigned or forged one is dead-lettered with the reason before any handler sees it."""

import asyncio
import dataclasses

from embodied_bus import open_bus
from embodied_bus.actions import Action, ActionContext, Executor, MemoryQueue, Planner
from embodied_bus.security import AllowList, Signer, Verifier, generate_private_key, public_entry


async def main() -> None:
    ops_key = generate_private_key()  # the planner's key (embodied-bus keys generate ops)
    allow = AllowList(
        [public_entry("ops", ops_key, ["dock"])]
    )  # embodied-bus keys allow ops.pub --kinds dock
    queue = MemoryQueue()  # the queue service's logic in this process; a bus works the same
    async with open_bus("zenoh:", namespace="robot1") as bus:
        ex = Executor(queue=queue, name="base", verifier=Verifier(allow, audience=bus.namespace))

        @ex.handler("dock")
        async def dock(action: Action, ctx: ActionContext) -> str:
            return f"docked at {action.payload['station']}"

        stop = asyncio.Event()
        running = asyncio.create_task(ex.run(stop))
        signed = Planner(bus, queue=queue, signer=Signer(ops_key))  # signs for this bus's namespace
        unsigned = Planner(queue=queue)
        good = await signed.submit("dock", {"station": 1})
        plain = await unsigned.submit("dock", {"station": 2})
        forged_action = Signer(ops_key, audience="robot1").sign(Action("dock", {"station": 3}))
        forged = (await unsigned.submit_many([dataclasses.replace(forged_action, payload={"station": 4})]))[0]
        for name, h in (("signed", good), ("unsigned", plain), ("tampered", forged)):
            done = await h.result(timeout_s=10)
            print(f"{name}: {done.status.value}", done.result or done.attempts[-1].reason)
        stop.set()
        await running


asyncio.run(main())
