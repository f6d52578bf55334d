"""Ordered action sessions: the store's rules directly (order, one step at a time, priorities
across sessions, a retried step keeping its place, cancel / hold / continue after a dead step,
100,000 open sessions), then the in-process queue with real executors and planners."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import pytest
from test_actions_contract import Rig, rig  # noqa: F401  (the fixture: Zenoh, Pulsar, in-process)

from embodied_bus.actions import (
    Action,
    ActionError,
    ActionStatus,
    ActionStore,
    Executor,
    MemoryQueue,
    PermanentFailure,
    Planner,
    RetryPolicy,
    SessionFailure,
)

KINDS = ["nav", "pick", "place"]


def steps(
    session: str, n: int, *, priority: int = 0, on_failure: SessionFailure = SessionFailure.CANCEL
) -> list[Action]:
    return [
        Action(KINDS[i % 3], {"step": i}, priority=priority, session=session, on_failure=on_failure)
        for i in range(n)
    ]


def take(store: ActionStore, executor: str = "e", n: int = 100) -> list[Action]:
    return store.lease_many(executor, KINDS, n, session="s1", lease_s=30)


def test_steps_of_a_session_start_in_order_one_at_a_time() -> None:
    store = ActionStore(":memory:")
    a = steps("task-a", 3)
    free = Action("nav", "independent")
    store.submit_many([*a, free])
    first = take(store)
    assert {x.id for x in first} == {a[0].id, free.id}  # the session's head and the free action
    store.ack(free.id, "e")
    assert take(store) == []  # step 2 waits for step 1
    store.ack(a[0].id, "e")
    assert [x.id for x in take(store)] == [a[1].id]
    store.ack(a[1].id, "e")
    (last,) = take(store)
    assert last.id == a[2].id and last.session == "task-a"
    store.ack(a[2].id, "e")
    assert store.get(a[2].id).status is ActionStatus.SUCCEEDED  # type: ignore[union-attr]
    assert store.backlog() == {}


def test_a_step_submitted_after_the_session_went_idle_starts_at_once() -> None:
    store = ActionStore(":memory:")
    (one,) = steps("s", 1)
    store.submit(one)
    store.ack(take(store)[0].id, "e")
    (two,) = steps("s", 1)
    store.submit(two)
    assert [x.id for x in take(store)] == [two.id]


def test_priorities_order_the_heads_of_different_sessions() -> None:
    store = ActionStore(":memory:")
    low, high = steps("low", 2, priority=1), steps("high", 2, priority=8)
    store.submit_many([*low, *high])
    assert [x.id for x in store.lease_many("e", KINDS, 1)] == [high[0].id]
    assert [x.id for x in store.lease_many("e", KINDS, 1)] == [low[0].id]
    assert store.lease_many("e", KINDS, 1) == []


def test_a_retried_or_lost_step_keeps_its_place() -> None:
    policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.0, max_backoff_s=0.0, jitter=0.0)
    store = ActionStore(":memory:", policy)
    a = steps("s", 2)
    store.submit_many(a)
    take(store)
    store.nack(a[0].id, "e", "slipped")
    again = take(store, "e2")
    assert [x.id for x in again] == [a[0].id]  # the retry, not step 2
    store.release_lost(executor="e2")  # its executor died
    third = take(store, "e3")
    assert [x.id for x in third] == [a[0].id] and third[0].attempt_count == 3
    store.ack(a[0].id, "e3")
    assert [x.id for x in take(store)] == [a[1].id]


def test_a_dead_step_cancels_the_later_steps_by_default_with_the_reason() -> None:
    store = ActionStore(":memory:")
    a = steps("s", 3)
    store.submit_many(a)
    take(store)
    store.nack(a[0].id, "e", "gripper jammed", permanent=True)
    for later in a[1:]:
        got = store.get(later.id)
        assert got is not None and got.status is ActionStatus.CANCELED
        assert a[0].id in got.ended_reason and "gripper jammed" in got.ended_reason
    assert {x.id for x in store.take_expired()} == {a[1].id, a[2].id}  # their results go out
    assert take(store) == []


def test_hold_keeps_the_later_steps_until_the_dead_step_is_requeued_or_purged() -> None:
    store = ActionStore(":memory:")
    a = steps("s", 3, on_failure=SessionFailure.HOLD)
    store.submit_many(a)
    take(store)
    store.nack(a[0].id, "e", "no path", permanent=True)
    assert take(store) == []  # held
    store.requeue(a[0].id)
    assert [x.id for x in take(store)] == [a[0].id]
    store.ack(a[0].id, "e")
    assert [x.id for x in take(store)] == [a[1].id]
    store.nack(a[1].id, "e", "dropped", permanent=True)
    assert take(store) == []
    assert store.purge_dead() == 1  # the operator gave up on step 2: the session goes on
    assert [x.id for x in take(store)] == [a[2].id]


def test_continue_runs_the_later_steps_after_a_dead_one() -> None:
    store = ActionStore(":memory:")
    a = steps("s", 2, on_failure=SessionFailure.CONTINUE)
    store.submit_many(a)
    take(store)
    store.nack(a[0].id, "e", "skipped", permanent=True)
    assert [x.id for x in take(store)] == [a[1].id]


def test_canceling_a_waiting_step_lets_the_session_go_on() -> None:
    store = ActionStore(":memory:")
    a = steps("s", 3)
    store.submit_many(a)
    store.cancel(a[1].id)
    take(store)
    store.ack(a[0].id, "e")
    assert [x.id for x in take(store)] == [a[2].id]


def test_bad_sessions_are_refused_by_name() -> None:
    with pytest.raises(ActionError, match="session must be"):
        Action("nav", session="").validate()
    with pytest.raises(ActionError, match="on_failure must be one of cancel, hold, continue"):
        Action("nav", session="s", on_failure="retry").validate()  # type: ignore[arg-type]


def test_a_queue_file_of_the_layout_before_sessions_opens_and_serves_them(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript(
        "CREATE TABLE actions (id TEXT PRIMARY KEY, kind TEXT NOT NULL, priority INTEGER NOT NULL, "
        "deadline_ns INTEGER NOT NULL, idem TEXT UNIQUE, status TEXT NOT NULL, "
        "available_ns INTEGER NOT NULL, lease_owner TEXT, lease_until_ns INTEGER, seq INTEGER NOT NULL, "
        "body TEXT NOT NULL);"
        "CREATE INDEX ready ON actions(status, priority DESC, seq);"
    )
    db.close()
    store = ActionStore(path)
    a = steps("s", 2)
    store.submit_many(a)
    assert [x.id for x in take(store)] == [a[0].id]


def test_a_hundred_thousand_open_sessions_cost_rows_not_tables() -> None:
    store = ActionStore(":memory:")
    sessions = 100_000
    for start in range(0, sessions, 10_000):
        batch = [Action("nav", None, session=f"task-{i}") for i in range(start, start + 10_000)]
        batch += [Action("pick", None, session=f"task-{i}") for i in range(start, start + 10_000)]
        store.submit_many(batch)
    tables = store.table.db.execute("SELECT COUNT(*) FROM sqlite_master WHERE type='table'").fetchone()[0]
    assert tables == 1
    t0 = time.perf_counter()
    heads = store.lease_many("e", ["nav", "pick"], 100)
    took_s = time.perf_counter() - t0
    assert [a.kind for a in heads] == ["nav"] * 100  # every head is a first step: the second ones wait
    store.ack(heads[0].id, "e")
    assert store.lease_many("e", ["pick"], 1)[0].session == heads[0].session
    assert took_s < 0.5, f"leasing 100 heads among 200,000 steps took {took_s:.3f} s"


async def test_sessions_run_in_order_across_concurrent_executors_of_an_in_process_queue() -> None:
    queue = MemoryQueue()
    log: list[tuple[str, int, str]] = []
    running: dict[str, int] = {}
    overlap: list[str] = []

    async def handler(action: Action, ctx: object) -> int:
        session = action.session or ""
        running[session] = running.get(session, 0) + 1
        if running[session] > 1:
            overlap.append(session)
        log.append((session, action.payload["step"], "start"))
        await asyncio.sleep(0.002)
        running[session] -= 1
        return int(action.payload["step"])

    executors = [Executor(queue=queue, name=f"e{i}", concurrency=4) for i in range(3)]
    for ex in executors:
        for kind in KINDS:
            ex.handler(kind)(handler)
    stop = asyncio.Event()
    async with Planner(queue=queue) as planner:
        tasks = [asyncio.create_task(ex.run(stop)) for ex in executors]
        handles = []
        for step in range(5):  # interleaved: step k of every session, then step k+1
            handles += await planner.submit_many(
                [Action(KINDS[step % 3], {"step": step}, session=f"s{i}") for i in range(40)]
            )
        results = [await h.result(timeout_s=30) for h in handles]
        stop.set()
        await asyncio.gather(*tasks)
    assert all(r.status is ActionStatus.SUCCEEDED for r in results)
    assert not overlap
    for i in range(40):
        assert [step for s, step, _ in log if s == f"s{i}"] == [0, 1, 2, 3, 4]


# ---------------------------------------------------------------------------- every backend


async def test_the_session_contract_on_every_backend(rig: Rig) -> None:  # noqa: F811
    """30 sessions of 4 steps on 3 executors: each session in order, one step at a time; a
    dead step cancels the rest of its session (the default) or holds it until it is requeued."""
    log: list[tuple[str, int]] = []
    running: dict[str, int] = {}
    overlap: list[str] = []
    failed_once: set[str] = set()

    async def step(action: Action, ctx: object) -> int:
        session = action.session or ""
        running[session] = running.get(session, 0) + 1
        if running[session] > 1:
            overlap.append(session)
        log.append((session, action.payload["step"]))
        try:
            await asyncio.sleep(0.005)
            if action.payload.get("fail") and action.id not in failed_once:
                failed_once.add(action.id)
                raise PermanentFailure("gripper jammed")
            return int(action.payload["step"])
        finally:
            running[session] -= 1

    for name in ("e0", "e1", "e2"):
        ex = rig.make_executor(name, concurrency=2)
        for kind in KINDS:
            ex.handler(kind)(step)
        rig.tasks.append(asyncio.create_task(ex.run(rig.stop)))
    await rig.executors_up(3)
    handles = []
    for k in range(4):  # step k of every session, then step k+1
        batch = [Action(KINDS[k % 3], {"step": k}, session=f"s{i}") for i in range(30)]
        batch.append(Action(KINDS[k % 3], {"step": k, "fail": k == 1}, session="cancels"))
        hold = SessionFailure.HOLD
        batch.append(Action(KINDS[k % 3], {"step": k, "fail": k == 1}, session="holds", on_failure=hold))
        handles += await rig.planner.submit_many(batch)
    held = handles[-1 - 32], handles[-1]  # the held session's steps 2 and 3 wait for step 1
    ends = {h.id: await h.result(timeout_s=60) for h in handles if h not in held}
    cancels = [a for a in ends.values() if a.session == "cancels"]
    holds = [a for a in ends.values() if a.session == "holds"]
    assert [a.status for a in cancels] == [
        ActionStatus.SUCCEEDED,
        ActionStatus.DEAD,
        ActionStatus.CANCELED,
        ActionStatus.CANCELED,
    ]
    assert all(cancels[1].id in a.ended_reason and "gripper jammed" in a.ended_reason for a in cancels[2:])
    assert [a.status for a in holds] == [ActionStatus.SUCCEEDED, ActionStatus.DEAD]
    for h in held:
        waiting = await rig.planner.get(h.id)
        assert waiting is not None and waiting.status is ActionStatus.QUEUED  # behind the dead step
    await rig.planner.requeue(holds[1].id)
    for h in held:  # they run once the requeued step succeeded
        assert (await h.result(timeout_s=60)).status is ActionStatus.SUCCEEDED
    assert (await rig.planner.get(holds[1].id)).status is ActionStatus.SUCCEEDED  # type: ignore[union-attr]
    assert not overlap, f"steps of one session ran at once: {overlap[:5]}"
    for i in range(30):
        assert [k for s, k in log if s == f"s{i}"] == [0, 1, 2, 3]
        assert all(a.status is ActionStatus.SUCCEEDED for a in ends.values() if a.session == f"s{i}")
    assert [k for s, k in log if s == "holds"] == [0, 1, 1, 2, 3]
