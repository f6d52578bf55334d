"""What comes down the uplink: state tables mirrored and actions relayed to the robot's queue.

**State.** Each table of ``state_down`` is watched on the fleet bus (the robot's namespace
there) and every change is put in the robot's table of the same name. A link that drops
leaves the robot with the last values it had; once back, the watcher delivers what changed.

**Actions.** The uplink is an executor of the fleet queue for the kinds in ``actions_down``
(named ``uplink-<robot>``). It submits each action to the robot's queue with the idempotency key
``fleet:<id>``, passes feedback up, a cancel down, and reports the robot's outcome as its own.
When the link drops, the fleet may take the attempt back and retry it once the uplink is
reachable again; the retry finds the robot's action by its key and waits for the same run, so
the robot never runs it twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from embodied_bus.actions import Action, ActionContext, ActionStatus, Executor, PermanentFailure, Planner
from embodied_bus.actions.client import ActionHandle
from embodied_bus.bus import Bus
from embodied_bus.state import open_state
from embodied_bus.uplink.config import UplinkConfig

__all__ = ["mirror_state", "relay_actions", "run_down"]

_log = logging.getLogger("embodied_bus.uplink")


async def run_down(robot: Bus, fleet: Bus, cfg: UplinkConfig, stop: asyncio.Event) -> None:
    """Mirror ``cfg.state_down`` and relay ``cfg.actions_down`` until ``stop`` is set."""
    tasks = [asyncio.create_task(mirror_state(robot, fleet, table, stop)) for table in cfg.state_down]
    if cfg.actions_down:
        tasks.append(asyncio.create_task(relay_actions(robot, fleet, cfg, stop)))
    if not tasks:
        return
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def mirror_state(robot: Bus, fleet: Bus, table: str, stop: asyncio.Event) -> None:
    """Put every change of the fleet's ``table`` (current values first) in the robot's."""
    async with await open_state(fleet, table) as up, await open_state(robot, table) as down:
        stopping = asyncio.ensure_future(stop.wait())
        changes = up.watch(initial=True).__aiter__()
        try:
            while True:
                nxt = asyncio.ensure_future(changes.__anext__())
                done, _ = await asyncio.wait([nxt, stopping], return_when=asyncio.FIRST_COMPLETED)
                if nxt not in done:
                    nxt.cancel()
                    return
                entry = nxt.result()
                if entry.deleted:
                    await down.delete(entry.key)
                else:
                    await down.put(entry.key, entry.value)
        except StopAsyncIteration:
            return
        finally:
            stopping.cancel()


async def relay_actions(robot: Bus, fleet: Bus, cfg: UplinkConfig, stop: asyncio.Event) -> None:
    """Serve ``cfg.actions_down`` of the fleet queue by running them on the robot's queue."""
    async with Planner(robot) as planner:
        executor = Executor(fleet, f"uplink-{cfg.robot}", concurrency=64)

        async def relay(action: Action, ctx: ActionContext) -> Any:
            return await _relay(planner, action, ctx)

        for kind in cfg.actions_down:
            executor.handler(kind)(relay)
        await executor.run(stop)


async def _relay(planner: Planner, action: Action, ctx: ActionContext) -> Any:
    deadline_s = (action.deadline_ns - time.time_ns()) / 1e9 if action.deadline_ns else None
    handle = await planner.submit(
        action.kind,
        action.payload,
        priority=action.priority,
        deadline_s=max(deadline_s, 0.001) if deadline_s is not None else None,
        idempotency_key=f"fleet:{action.id}",
    )
    feedback = asyncio.create_task(_pass_feedback(handle, ctx))
    ended = asyncio.ensure_future(handle.result())
    cancel = asyncio.ensure_future(ctx.cancelled.wait())
    try:
        await asyncio.wait([ended, cancel], return_when=asyncio.FIRST_COMPLETED)
        if not ended.done():
            if ctx.lost:  # the link dropped: the robot's run goes on; a retry waits for it
                raise ConnectionError("the fleet took the attempt back; the robot's run goes on")
            await handle.cancel()
        result = await ended
    finally:
        for t in (feedback, cancel):
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await feedback
    if result.status is ActionStatus.SUCCEEDED:
        return result.result
    if result.status is ActionStatus.CANCELED:
        return None  # a cancel asked for: the fleet's action ends canceled
    last = result.attempts[-1].reason if result.attempts else "no attempt"
    raise PermanentFailure(f"the robot's queue dead-lettered it: {last}")


async def _pass_feedback(handle: ActionHandle, ctx: ActionContext) -> None:
    try:
        async for data in handle.feedback():
            ctx.feedback(data)
    except Exception as err:  # feedback is best effort
        _log.debug("feedback of %s: %s", handle.id, err)
