"""The durable action queue and retry policy, transport-free (SQLite on disk)."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from embodied_bus import BusConfigError
from embodied_bus.actions import (
    Action,
    ActionError,
    ActionStatus,
    ActionStore,
    Attempt,
    RetryPolicy,
    decode_action,
    encode_action,
)

S = 1_000_000_000
FAST = RetryPolicy(max_attempts=3, initial_backoff_s=1.0, max_backoff_s=10.0, jitter=0.0)


@pytest.fixture
def store(tmp_path: Path) -> ActionStore:
    return ActionStore(tmp_path / "q.db", policy=FAST)


def test_an_urgent_action_overtakes_a_backlog_and_each_priority_is_fifo(store: ActionStore) -> None:
    moves = [store.submit(Action("navigate_to", {"i": i}, priority=1), now_ns=i)[0].id for i in range(1000)]
    stop = store.submit(Action("e_stop", priority=9), now_ns=2000)[0]
    dock = store.submit(Action("dock", priority=5), now_ns=2001)[0]
    order = [store.lease("ex", ["navigate_to", "e_stop", "dock"], now_ns=3000) for _ in range(4)]
    assert [a.id for a in order if a] == [stop.id, dock.id, moves[0], moves[1]]


def test_the_same_idempotency_key_yields_the_same_action(store: ActionStore) -> None:
    a, new = store.submit(Action("pick", {"obj": "cup"}, idempotency_key="goal-42"))
    b, again = store.submit(Action("pick", {"obj": "cup"}, idempotency_key="goal-42"))
    assert new and not again and a.id == b.id
    assert store.lease("ex", ["pick"]) is not None and store.lease("ex", ["pick"]) is None


def test_a_nacked_action_is_retried_after_backoff_on_another_executor(store: ActionStore) -> None:
    a, _ = store.submit(Action("pick"), now_ns=0)
    assert store.lease("ex1", ["pick"], live_executors={"ex2": ["pick"]}, now_ns=0).id == a.id  # type: ignore[union-attr]
    store.nack(a.id, "ex1", "gripper slipped", now_ns=1 * S)
    assert store.get(a.id).status is ActionStatus.RETRYING  # type: ignore[union-attr]
    assert (
        store.lease("ex2", ["pick"], live_executors={"ex1": ["pick"]}, now_ns=int(1.5 * S)) is None
    )  # backoff 1 s
    assert (
        store.lease("ex1", ["pick"], live_executors={"ex2": ["pick"]}, now_ns=3 * S) is None
    )  # ex1 failed it
    again = store.lease("ex2", ["pick"], live_executors={"ex1": ["pick"]}, now_ns=3 * S)
    assert again is not None and again.attempt_count == 2 and again.attempts[0].reason == "gripper slipped"


def test_a_live_executor_of_other_kinds_does_not_hold_a_retry_back(store: ActionStore) -> None:
    a, _ = store.submit(Action("pick"), now_ns=0)
    assert store.lease("ex1", ["pick"], live_executors={"ex2": ["place"]}, now_ns=0).id == a.id  # type: ignore[union-attr]
    store.nack(a.id, "ex1", "gripper slipped", now_ns=1 * S)
    # ex2 is alive but cannot run "pick": the retry goes back to ex1, the only one that can
    again = store.lease("ex1", ["pick"], live_executors={"ex2": ["place"]}, now_ns=3 * S)
    assert again is not None and again.attempt_count == 2


def test_the_failed_executor_retries_when_it_is_the_only_one_alive(store: ActionStore) -> None:
    a, _ = store.submit(Action("pick"), now_ns=0)
    store.lease("ex1", ["pick"], now_ns=0)
    store.nack(a.id, "ex1", "try again", now_ns=0)
    assert store.lease("ex1", ["pick"], now_ns=5 * S) is not None


def test_a_poison_action_ends_in_the_dead_letter_queue_with_every_reason(store: ActionStore) -> None:
    a, _ = store.submit(Action("dock"), now_ns=0)
    t = 0
    for n in range(3):
        t += 100 * S
        leased = store.lease(f"ex{n}", ["dock"], now_ns=t)
        assert leased is not None
        store.nack(a.id, f"ex{n}", f"charger not found ({n})", now_ns=t)
    dead = store.dead_letters()
    assert [d.id for d in dead] == [a.id]
    assert [x.reason for x in dead[0].attempts] == [f"charger not found ({n})" for n in range(3)]
    assert [x.executor for x in dead[0].attempts] == ["ex0", "ex1", "ex2"]
    requeued = store.requeue(a.id, now_ns=t)
    assert requeued.status is ActionStatus.QUEUED and store.lease("ex9", ["dock"], now_ns=t) is not None
    assert store.get(a.id).attempt_count == 4  # type: ignore[union-attr]  # history kept


def test_a_permanent_failure_dead_letters_at_once(store: ActionStore) -> None:
    a, _ = store.submit(Action("pick"))
    store.lease("ex", ["pick"])
    assert store.nack(a.id, "ex", "object does not exist", permanent=True).status is ActionStatus.DEAD


def test_an_action_past_its_deadline_is_never_started(store: ActionStore) -> None:
    a, _ = store.submit(Action("navigate_to", deadline_ns=10 * S), now_ns=0)
    assert store.lease("ex", ["navigate_to"], now_ns=11 * S) is None
    dead = store.get(a.id)
    assert dead is not None and dead.status is ActionStatus.DEAD
    assert dead.attempts[-1].outcome == "expired" and dead.attempts[-1].executor == ""


def test_a_lost_lease_counts_an_attempt_and_hands_over_with_the_checkpoint(store: ActionStore) -> None:
    a, _ = store.submit(Action("navigate_to"), now_ns=0)
    store.lease("ex1", ["navigate_to"], lease_s=5, now_ns=0)
    store.checkpoint(a.id, "ex1", {"waypoint": 3})
    store.extend(a.id, "ex1", lease_s=5, now_ns=4 * S)
    assert store.release_lost(now_ns=8 * S) == []  # extended: still held
    lost = store.release_lost(now_ns=20 * S)
    assert [x.id for x in lost] == [a.id] and lost[0].attempts[0].outcome == "lost"
    again = store.lease("ex2", ["navigate_to"], live_executors={"ex1": ["navigate_to"]}, now_ns=30 * S)
    assert again is not None and again.checkpoint == {"waypoint": 3} and again.attempt_count == 2
    with pytest.raises(ActionError, match="does not hold a lease"):
        store.ack(a.id, "ex1")  # the old executor came back too late
    assert store.ack(a.id, "ex2", {"ok": True}).status is ActionStatus.SUCCEEDED


def test_a_dead_executor_gives_back_everything_it_held(store: ActionStore) -> None:
    ids = [store.submit(Action("pick", {"i": i}))[0].id for i in range(3)]
    for _ in ids:
        store.lease("ex1", ["pick"], lease_s=600)
    back = store.release_lost(executor="ex1")
    assert sorted(a.id for a in back) == sorted(ids)
    assert all(a.status is ActionStatus.RETRYING for a in back)


def test_cancel_removes_a_queued_action_and_flags_a_running_one(store: ActionStore) -> None:
    q, _ = store.submit(Action("pick"))
    r, _ = store.submit(Action("dock", priority=9))
    store.lease("ex", ["dock"])
    assert store.cancel(q.id).status is ActionStatus.CANCELED  # type: ignore[union-attr]
    assert store.lease("ex", ["pick"]) is None
    assert store.cancel(r.id).cancel_requested  # type: ignore[union-attr]
    assert store.extend(r.id, "ex").cancel_requested
    assert store.nack(r.id, "ex", "stopped on request").status is ActionStatus.CANCELED


def test_selectors_route_actions_to_matching_executors(store: ActionStore) -> None:
    a, _ = store.submit(Action("pick", selector={"arm": "left"}))
    assert store.lease("right-arm", ["pick"], labels={"arm": "right"}) is None
    assert store.lease("left-arm", ["pick"], labels={"arm": "left"}).id == a.id  # type: ignore[union-attr]


def test_backlog_counts_per_kind_priority_and_state(store: ActionStore) -> None:
    for _ in range(3):
        store.submit(Action("pick", priority=2))
    store.lease("ex", ["pick"])
    assert store.backlog() == {"pick/p2": {"queued": 2, "leased": 1, "retrying": 0, "dead": 0, "blocked": 0}}


def test_pruning_keeps_the_newest_ended_actions_and_everything_still_open_or_dead(tmp_path: Path) -> None:
    store = ActionStore(tmp_path / "q.db", policy=FAST, keep_ended=3)
    done = []
    for i in range(8):  # ended: succeeded, every third canceled while queued
        a, _ = store.submit(Action("pick", idempotency_key=f"goal-{i}"))
        if i % 3 == 2:
            store.cancel(a.id)
        else:
            leased = store.lease("ex", ["pick"])
            assert leased is not None and leased.id == a.id
            store.ack(a.id, "ex", result=i)
        done.append(a.id)
    dead, _ = store.submit(Action("pick"))
    assert store.lease("ex", ["pick"]) is not None
    store.nack(dead.id, "ex", "no gripper", permanent=True)
    running, _ = store.submit(Action("pick"))
    assert store.lease("ex", ["pick"]) is not None
    queued, _ = store.submit(Action("pick"))
    assert store.prune() == 5 and store.pruned == 5
    assert [store.get(i) is not None for i in done] == [False] * 5 + [True] * 3  # newest 3 kept
    assert store.get(dead.id).status is ActionStatus.DEAD  # type: ignore[union-attr]
    assert store.get(queued.id).status is ActionStatus.QUEUED  # type: ignore[union-attr]
    assert store.get(running.id).status is ActionStatus.RUNNING  # type: ignore[union-attr]
    assert store.prune() == 0  # nothing beyond the bound any more
    again, new = store.submit(Action("pick", idempotency_key="goal-0"))
    assert new and again.id != done[0]  # a pruned action's idempotency key is free again
    kept, new = store.submit(Action("pick", idempotency_key="goal-7"))
    assert not new and kept.id == done[7]
    store.close()


def test_pruning_a_large_excess_goes_in_bounded_transactions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from embodied_bus.actions import store as store_module

    monkeypatch.setattr(store_module, "PRUNE_CHUNK", 7)
    store = ActionStore(tmp_path / "q.db", policy=FAST, keep_ended=0)
    handles = store.submit_many([Action("pick") for _ in range(30)])
    for a, _ in handles:
        store.cancel(a.id)
    assert store.prune() == 30
    assert store.backlog() == {} and store.stats() == {}
    with pytest.raises(ValueError, match="keep_ended"):
        ActionStore(tmp_path / "r.db", keep_ended=-1)
    store.close()


def test_an_acknowledged_submit_survives_kill_9(tmp_path: Path) -> None:
    db = tmp_path / "q.db"
    code = (
        f"import os, sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\n"
        "from embodied_bus.actions import ActionStore, Action\n"
        f"s = ActionStore({str(db)!r})\n"
        "a, _ = s.submit(Action('dock', {'bay': 2}, priority=7))\n"
        "print(a.id, flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9
    action_id = proc.stdout.strip()
    again = ActionStore(db).get(action_id)
    assert again is not None and again.payload == {"bay": 2} and again.priority == 7


@pytest.mark.parametrize(
    ("action", "message"),
    [
        (Action("pick up"), "invalid action kind"),
        (Action("pick", priority=10), "priority"),
        (Action("pick", payload={"x": object()}), "not JSON-serializable"),
        (Action("pick", payload="x" * 300_000), "exceeds the limit"),
        (Action("pick", selector={"arm": 1}), "selector"),  # type: ignore[dict-item]
    ],
)
def test_bad_actions_are_refused_with_a_clear_error(store: ActionStore, action: Action, message: str) -> None:
    with pytest.raises(ActionError, match=message):
        store.submit(action)


@pytest.mark.parametrize("blob", [b"", b"{", b"[1,2]", b'{"kind": 3}', b'{"kind": "x", "priority": "high"}'])
def test_malformed_envelopes_raise_action_errors(blob: bytes) -> None:
    with pytest.raises(ActionError):
        decode_action(blob)


def test_envelopes_round_trip() -> None:
    a = Action(
        "navigate_to",
        {"x": 1.5, "y": -2},
        priority=3,
        deadline_ns=5,
        idempotency_key="k",
        selector={"a": "b"},
    )
    assert decode_action(encode_action(a)) == a


def test_backoff_grows_exponentially_with_bounded_jitter() -> None:
    p = RetryPolicy(initial_backoff_s=1, max_backoff_s=8, multiplier=2, jitter=0.25)
    rng = random.Random(1)
    for failures, base in ((1, 1), (2, 2), (3, 4), (4, 8), (9, 8)):
        d = p.backoff_s(failures, rng)
        assert base * 0.75 <= d <= base * 1.25
    with pytest.raises(BusConfigError):
        RetryPolicy(max_attempts=0)


def test_the_envelope_carries_every_field_of_an_action_and_round_trips() -> None:
    import dataclasses
    import json

    from embodied_bus.actions import Attempt, decode_action, encode_action

    a = Action(
        "pick",
        {"obj": [1, 2]},
        priority=3,
        idempotency_key="k",
        selector={"arm": "left"},
        attempts=[Attempt(1, "ex", 5, 6, "nack", "slipped")],
        checkpoint={"w": 1},
        budget_from=1,
        auth={"key_id": "x"},
    )
    env = json.loads(encode_action(a))
    assert list(env) == [f.name for f in dataclasses.fields(Action)]
    assert decode_action(encode_action(a)) == a


def test_acks_and_checkpoints_see_every_change_made_since_the_lease(store: ActionStore) -> None:
    # the store keeps leased actions in memory for the ack: each other write must show through
    store.submit(Action("pick", id="a"))
    store.submit(Action("pick", id="b"))
    leased = store.lease_many("ex1", ["pick"], 2)
    assert {a.id for a in leased} == {"a", "b"}
    store.checkpoint("a", "ex1", {"step": 3})
    store.cancel("a")  # flags the running action
    done = store.ack("a", "ex1")
    assert done.status is ActionStatus.CANCELED and done.checkpoint == {"step": 3}
    reread = store.get("a")
    assert reread is not None and reread.status is ActionStatus.CANCELED and reread.checkpoint == {"step": 3}
    with pytest.raises(ActionError):
        store.ack("b", "ex2")  # not its lease
    store.release_lost(executor="ex1")  # b goes back to the queue as a lost attempt
    with pytest.raises(ActionError):
        store.ack("b", "ex1")  # its lease is gone
    later = time.time_ns() + 5 * S  # past the retry backoff
    again = store.lease("ex2", ["pick"], now_ns=later)
    assert again is not None and again.id == "b" and again.attempt_count == 2
    assert store.ack("b", "ex2", now_ns=later).status is ActionStatus.SUCCEEDED


def test_an_action_copy_equals_the_action_and_owns_its_lists() -> None:
    a = Action("pick", {"x": 1}, priority=4, deadline_ns=9, idempotency_key="k", selector={"arm": "left"})
    a.attempts.append(Attempt(1, "ex1", 10))
    a.status, a.result, a.checkpoint, a.created_ns = ActionStatus.RUNNING, [1], {"step": 2}, 7
    a.cancel_requested, a.budget_from, a.auth = True, 1, {"key": "k1"}
    b = a.copy()
    assert b == a  # every field, in its place
    b.attempts.append(Attempt(2, "ex2", 11))
    b.selector["arm"] = "right"
    assert len(a.attempts) == 1 and a.selector == {"arm": "left"}
    assert a.attempts[0].ended(12, "nack", "boom") == Attempt(1, "ex1", 10, 12, "nack", "boom")
