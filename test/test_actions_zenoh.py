"""The action queue over real Zenoh sessions: planner, queue service, executors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from embodied_bus import open_bus
from embodied_bus.actions import (
    Action,
    ActionError,
    ActionStatus,
    Executor,
    PermanentFailure,
    Planner,
    QueueService,
    RetryPolicy,
)

from conftest import wait_until, zenoh_urls

FAST = RetryPolicy(max_attempts=3, initial_backoff_s=0.05, max_backoff_s=0.2, jitter=0.0)


class Rig:
    def __init__(
        self,
        planner: Planner,
        buses: list,
        tasks: list,
        stop: asyncio.Event,  # type: ignore[type-arg]
        service: QueueService,
    ) -> None:
        self.planner, self.buses, self.tasks, self.stop, self.service = planner, buses, tasks, stop, service

    async def executors_up(self, n: int) -> None:
        await wait_until(lambda: len(self.service._live) >= n, 10, f"{n} executors announced")

    async def executor(self, name: str, **handlers) -> Executor:  # type: ignore[no-untyped-def]
        ex = Executor(self.buses[2], name)
        for kind, fn in handlers.items():
            ex.handler(kind)(fn)
        self.tasks.append(asyncio.create_task(ex.run(self.stop)))
        return ex


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    url_a, url_b = zenoh_urls()
    stop = asyncio.Event()
    async with (
        open_bus(url_a, namespace="act") as svc_bus,
        open_bus(url_b, namespace="act") as plan_bus,
        open_bus(url_b, namespace="act") as ex_bus,
    ):
        ready = asyncio.Event()
        service = QueueService(svc_bus, tmp_path / "queue.db", FAST)
        tasks = [asyncio.create_task(service.run(stop, ready))]
        await ready.wait()
        planner = Planner(plan_bus)
        for _ in range(100):  # wait until the service answers through the network
            try:
                await planner.backlog()
                break
            except Exception:
                await asyncio.sleep(0.05)
        yield Rig(planner, [svc_bus, plan_bus, ex_bus], tasks, stop, service)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_an_action_runs_with_feedback_and_returns_its_result(rig: Rig) -> None:
    async def pick(action: Action, ctx):  # type: ignore[no-untyped-def]
        ctx.feedback({"progress": 0.5})
        return {"picked": action.payload["obj"], "attempt": ctx.attempt}

    await rig.executor("ex1", pick=pick)
    handle = await rig.planner.submit("pick", {"obj": "cup"})
    done = await handle.result(timeout_s=10)
    assert done.status is ActionStatus.SUCCEEDED and done.result == {"picked": "cup", "attempt": 1}
    again = await rig.planner.get(handle.id)  # a planner that was away gets it from the store
    assert again is not None and again.result == done.result


async def test_a_failed_action_is_retried_on_another_executor_and_resumes_its_checkpoint(rig: Rig) -> None:
    async def first_try_fails(action: Action, ctx):  # type: ignore[no-untyped-def]
        if ctx.attempt == 1:
            await ctx.checkpoint({"waypoint": 2})
            raise RuntimeError("wheel slipped")
        return {"resumed_from": ctx.previous_checkpoint, "attempt": ctx.attempt}

    await rig.executor("left", navigate_to=first_try_fails)
    await rig.executor("right", navigate_to=first_try_fails)
    await rig.executors_up(2)
    handle = await rig.planner.submit("navigate_to", {"x": 1})
    done = await handle.result(timeout_s=10)
    assert done.status is ActionStatus.SUCCEEDED
    assert done.result == {"resumed_from": {"waypoint": 2}, "attempt": 2}
    first, second = done.attempts
    assert "wheel slipped" in first.reason and second.executor != first.executor


async def test_a_poison_action_lands_in_the_dead_letter_queue_with_its_history(rig: Rig) -> None:
    async def boom(action: Action, ctx):  # type: ignore[no-untyped-def]
        raise ValueError("cannot parse target")

    await rig.executor("ex1", dock=boom)
    handle = await rig.planner.submit("dock", {"bay": "?"})
    done = await handle.result(timeout_s=10)
    assert done.status is ActionStatus.DEAD and done.attempt_count == 3
    dead = await rig.planner.dead_letters()
    assert [d.id for d in dead] == [handle.id]
    assert all("cannot parse target" in a.reason for a in dead[0].attempts)


async def test_a_permanent_failure_dead_letters_at_once(rig: Rig) -> None:
    async def reject(action: Action, ctx):  # type: ignore[no-untyped-def]
        raise PermanentFailure("object does not exist")

    await rig.executor("ex1", pick=reject)
    done = await (await rig.planner.submit("pick")).result(timeout_s=10)
    assert done.status is ActionStatus.DEAD and done.attempt_count == 1


async def test_cancel_signals_a_running_action(rig: Rig) -> None:
    started = asyncio.Event()

    async def long(action: Action, ctx):  # type: ignore[no-untyped-def]
        started.set()
        await asyncio.wait_for(ctx.cancelled.wait(), 10)
        raise RuntimeError("stopped on request")

    await rig.executor("ex1", navigate_to=long)
    handle = await rig.planner.submit("navigate_to")
    await asyncio.wait_for(started.wait(), 10)
    await handle.cancel()
    done = await handle.result(timeout_s=10)
    assert done.status is ActionStatus.CANCELED


async def test_bad_input_gets_a_clear_error_from_the_service(rig: Rig) -> None:
    with pytest.raises(ActionError, match="priority"):
        await rig.planner.submit("pick", priority=12)
    with pytest.raises(ActionError, match="exceeds the limit"):
        await rig.planner.submit("pick", "x" * 300_000)
    with pytest.raises(ActionError, match="not JSON-serializable"):
        await rig.planner.submit("pick", {1, 2})


async def test_an_urgent_action_overtakes_queued_routine_ones(rig: Rig) -> None:
    order: list[str] = []

    async def work(action: Action, ctx):  # type: ignore[no-untyped-def]
        order.append(action.kind)
        await asyncio.sleep(0.01)

    routine = await rig.planner.submit_many([Action("navigate_to", {"i": i}, priority=1) for i in range(30)])
    urgent = await rig.planner.submit("e_stop", priority=9)
    await rig.executor("ex1", navigate_to=work, e_stop=work)
    await urgent.result(timeout_s=10)
    assert order[0] == "e_stop"
    await routine[-1].result(timeout_s=20)
    assert order.count("navigate_to") == 30


async def test_a_stale_command_is_never_executed(rig: Rig) -> None:
    ran: list[str] = []

    async def go(action: Action, ctx):  # type: ignore[no-untyped-def]
        ran.append(action.id)

    handle = await rig.planner.submit("navigate_to", deadline_s=0.05)
    await asyncio.sleep(0.2)  # the deadline passes while no executor runs
    await rig.executor("ex1", navigate_to=go)
    done = await handle.result(timeout_s=10)
    assert done.status is ActionStatus.DEAD and done.attempts[-1].outcome == "expired" and not ran
