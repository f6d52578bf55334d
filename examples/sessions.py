"""An ordered session: "navigate, then pick, then place" run in that order, one step at a time,
on whichever executors are free; a dead step cancels the rest of its session with the reason."""

import asyncio

from embodied_bus.actions import Action, ActionContext, Executor, MemoryQueue, PermanentFailure, Planner


async def main() -> None:
    queue = MemoryQueue()  # or Planner(bus) / Executor(bus, ...) on a Zenoh bus with a queue service
    order: list[str] = []
    executors = [Executor(queue=queue, name=name, concurrency=2) for name in ("base", "arm")]
    for ex in executors:

        @ex.handler("navigate")
        @ex.handler("pick")
        @ex.handler("place")
        async def step(action: Action, ctx: ActionContext) -> str:
            if action.kind == "pick" and action.payload == "ghost":
                raise PermanentFailure("no such object")
            await asyncio.sleep(0.01)
            order.append(f"{action.session}:{action.kind}")
            return f"{action.kind} done"

    stop = asyncio.Event()
    tasks = [asyncio.create_task(ex.run(stop)) for ex in executors]
    async with Planner(queue=queue) as planner:
        handles = []
        for task, obj in (("task-1", "cup"), ("task-2", "ghost")):
            for kind in ("navigate", "pick", "place"):  # submitted at once: the queue orders them
                handles.append(await planner.submit(kind, obj, session=task))
        results = [await h.result(timeout_s=10) for h in handles]
    stop.set()
    await asyncio.gather(*tasks)
    print("ran in order:", ", ".join(o for o in order if o.startswith("task-1")))
    for a in results[3:]:
        print(f"task-2 {a.kind}: {a.status.value}", f"({a.ended_reason})" if a.ended_reason else "")


asyncio.run(main())
