"""Signed actions: the verifier on its own (every rejection reason), the keys CLI, and executors
on a real Zenoh queue that run only what an allowed key signed."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from embodied_bus import open_bus
from embodied_bus.actions import (
    Action,
    ActionStatus,
    Executor,
    Planner,
    QueueService,
    RetryPolicy,
)
from embodied_bus.cli.main import main as cli_main
from embodied_bus.security import (
    ActionRejected,
    AllowedKey,
    AllowList,
    KeyFileError,
    RejectReason,
    Signer,
    Verifier,
    generate_private_key,
    load_allow_list,
    load_private_key,
    public_key_b64,
    save_allow_list,
)

from conftest import wait_until, zenoh_urls

NOW = 1_800_000_000_000_000_000
PLANNER = generate_private_key()
STRANGER = generate_private_key()


def allow(**extra: int) -> AllowList:
    return AllowList(
        [AllowedKey("ops", public_key_b64(PLANNER), frozenset({"navigate_to", "dock"}), **extra)]
    )


def signed(action: Action | None = None, *, key=PLANNER, ttl_s: float = 60, aud: str | None = "r1") -> Action:  # type: ignore[no-untyped-def]
    return Signer(key, ttl_s=ttl_s, audience=aud).sign(
        action or Action("navigate_to", {"x": 1.5}), now_ns=NOW
    )


def test_a_signed_action_verifies_and_names_its_key() -> None:
    v = Verifier(allow(), audience="r1")
    assert v.verify(signed(), now_ns=NOW + 1) == "ops"
    assert v.accepted == 1 and not v.rejected


def _tampered() -> Action:
    return dataclasses.replace(signed(), payload={"x": 99})


def _forged() -> Action:
    a = signed(key=STRANGER)
    auth = dict(a.auth or {})
    auth["key"] = Signer(PLANNER).key_id  # claims to be the allowed planner
    return dataclasses.replace(a, auth=auth)


def _malformed() -> Action:
    a = signed()
    return dataclasses.replace(a, auth={**(a.auth or {}), "expires_ns": "soon"})


CASES: dict[RejectReason, Callable[[], Action]] = {
    RejectReason.UNSIGNED: lambda: Action("navigate_to", {"x": 1}),
    RejectReason.MALFORMED: _malformed,
    RejectReason.UNKNOWN_KEY: lambda: signed(key=STRANGER),
    RejectReason.NOT_ALLOWED: lambda: signed(Action("e_stop")),
    RejectReason.BAD_SIGNATURE: _tampered,
    RejectReason.EXPIRED: lambda: signed(ttl_s=-10),
    RejectReason.EXPIRY_TOO_FAR: lambda: signed(ttl_s=10 * 86400),
    RejectReason.WRONG_AUDIENCE: lambda: signed(aud="r2"),
}


@pytest.mark.parametrize("reason", list(CASES))
def test_each_kind_of_bad_action_is_rejected_with_its_reason_and_counted(reason: RejectReason) -> None:
    v = Verifier(allow(), audience="r1")
    with pytest.raises(ActionRejected) as info:
        v.verify(CASES[reason](), now_ns=NOW + 1)
    assert info.value.reason is reason and str(info.value).startswith(reason.value)
    assert v.rejected == {reason.value: 1} and v.accepted == 0


def test_the_forged_signature_of_a_stranger_is_a_bad_signature() -> None:
    with pytest.raises(ActionRejected, match="bad_signature"):
        Verifier(allow()).verify(_forged(), now_ns=NOW)


def test_an_actions_own_retry_policy_is_signed_with_it() -> None:
    """Giving a signed action more tries (or taking its policy away) breaks the signature."""
    v = Verifier(allow())
    a = signed(Action("navigate_to", {"x": 1}, retry=RetryPolicy(max_attempts=2)))
    assert v.verify(a, now_ns=NOW) == "ops"
    for changed in (RetryPolicy(max_attempts=50), None):
        with pytest.raises(ActionRejected, match="bad_signature"):
            v.verify(dataclasses.replace(a, retry=changed), now_ns=NOW)


def test_a_nonce_is_good_for_retries_of_its_action_but_never_for_another_or_after_completion(
    tmp_path: Path,
) -> None:
    v = Verifier(allow(), nonce_db=tmp_path / "nonces.db")
    a = signed()
    v.verify(a, now_ns=NOW)
    v.verify(a, now_ns=NOW + 10**9)  # a retry of the same action
    other = dataclasses.replace(a, id="f" * 32)  # same signature block moved onto another action id
    with pytest.raises(ActionRejected, match="bad_signature"):
        v.verify(other, now_ns=NOW)
    v.completed(a)
    # a restarted executor with the same nonce file still knows the action ran
    v2 = Verifier(allow(), nonce_db=tmp_path / "nonces.db")
    with pytest.raises(ActionRejected, match="replayed: this signed action already completed"):
        v2.verify(a, now_ns=NOW + 2 * 10**9)
    assert v2.rejected["replayed"] == 1


def test_a_rotated_out_key_is_refused_after_its_grace_period() -> None:
    v = Verifier(allow(not_after_ns=NOW + 5 * 10**9))
    v.verify(signed(), now_ns=NOW)
    with pytest.raises(ActionRejected, match="key_expired"):
        v.verify(signed(), now_ns=NOW + 6 * 10**9)


def test_allow_lists_round_trip_and_bad_entries_are_named(tmp_path: Path) -> None:
    path = tmp_path / "allow.yaml"
    save_allow_list(allow(), path)
    back = load_allow_list(path)
    assert back.keys == allow().keys
    path.write_text("keys:\n  ops: {public_key: 'bm90IGEga2V5', kinds: [dock]}\n")
    with pytest.raises(KeyFileError, match="not base64 of a 32-byte"):
        load_allow_list(path)
    path.write_text(f"keys:\n  ops: {{public_key: '{public_key_b64(PLANNER)}', kinds: []}}\n")
    with pytest.raises(KeyFileError, match=r"keys\.ops\.kinds"):
        load_allow_list(path)


def test_the_keys_command_generates_allows_rotates_and_revokes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d, al = str(tmp_path), str(tmp_path / "allow.yaml")
    assert cli_main(["keys", "generate", "ops", "--dir", d]) == 0
    first = json.loads(capsys.readouterr().out)
    assert (tmp_path / "ops.pem").stat().st_mode & 0o777 == 0o600
    assert cli_main(["keys", "allow", str(tmp_path / "ops.pub"), "--kinds", "dock", "--allow-list", al]) == 0
    assert cli_main(["keys", "rotate", "ops", "--dir", d, "--allow-list", al, "--grace", "30"]) == 0
    new_key = load_private_key(tmp_path / "ops.pem")
    entries = {k.key_id: k for k in load_allow_list(al).keys}
    assert entries[first["key_id"]].not_after_ns > time.time_ns()  # old key: grace period
    assert entries[Signer(new_key).key_id].not_after_ns == 0 and entries[Signer(new_key).key_id].kinds == {
        "dock"
    }
    assert cli_main(["keys", "generate", "ops", "--dir", d]) == 1  # never overwrites a private key
    assert cli_main(["keys", "revoke", first["key_id"], "--allow-list", al]) == 0
    assert [k.key_id for k in load_allow_list(al).keys] == [Signer(new_key).key_id]
    assert cli_main(["keys", "list", "--allow-list", al, "--json"]) == 0


async def test_executors_run_only_allowed_signed_actions_and_dead_letter_the_rest(tmp_path: Path) -> None:
    url_a, url_b = zenoh_urls()
    stop = asyncio.Event()
    ran: list[str] = []
    async with open_bus(url_a, namespace="r1") as svc_bus, open_bus(url_b, namespace="r1") as bus:
        ready = asyncio.Event()
        policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.05, max_backoff_s=0.1, jitter=0.0)
        service = QueueService(svc_bus, tmp_path / "q.db", policy)
        tasks = [asyncio.create_task(service.run(stop, ready))]
        await ready.wait()
        verifier = Verifier(allow(), audience="r1")

        async def handle(action: Action, ctx):  # type: ignore[no-untyped-def]
            ran.append(action.id)
            return {"done": action.payload}

        ex = Executor(bus, "ex-secure", verifier=verifier)
        ex.handler("navigate_to")(handle)
        ex.handler("e_stop")(handle)
        tasks.append(asyncio.create_task(ex.run(stop)))
        planner = Planner(bus, signer=Signer(PLANNER, audience="r1"))
        plain = Planner(bus)
        await wait_until(lambda: len(service.live_executors()) >= 1, 10, "executor announced")

        good = await planner.submit("navigate_to", {"x": 1})
        assert (await good.result(timeout_s=15)).result == {"done": {"x": 1}}

        now = time.time_ns()
        bad = {
            "unsigned": Action("navigate_to", {"x": 2}),
            "bad_signature": dataclasses.replace(
                Signer(PLANNER, audience="r1").sign(Action("navigate_to", {"x": 3})), payload={"x": 4}
            ),
            "unknown_key": Signer(STRANGER, audience="r1").sign(Action("navigate_to", {"x": 5})),
            "expired": Signer(PLANNER, ttl_s=-30, audience="r1").sign(
                Action("navigate_to", {"x": 6}), now_ns=now
            ),
            "not_allowed": Signer(PLANNER, audience="r1").sign(Action("e_stop")),
            "wrong_audience": Signer(PLANNER, audience="r2").sign(Action("navigate_to", {"x": 7})),
        }  # fmt: skip
        handles = dict(zip(bad, await plain.submit_many(list(bad.values())), strict=True))
        for reason, h in handles.items():
            final = await h.result(timeout_s=15)
            assert final.status is ActionStatus.DEAD, reason
            assert len(final.attempts) == 1 and reason in final.attempts[0].reason, final.attempts
        assert ran == [good.id]  # nothing rejected ever reached a handler
        assert dict(verifier.rejected) == {r: 1 for r in bad}

        # a captured signed action replayed into the same queue is refused at submit...
        captured = await planner.get(good.id)
        assert captured is not None and captured.auth is not None
        (again,) = await plain.submit_many([dataclasses.replace(captured, attempts=[], result=None)])
        assert again.duplicate and again.id == good.id  # the stored action answers: nothing runs
        # ...and one replayed through a fresh queue (wiped or foreign) is refused by the executor
        stop_svc = asyncio.Event()
        tasks[0].cancel()
        await asyncio.gather(tasks[0], return_exceptions=True)
        ready2 = asyncio.Event()
        service2 = QueueService(svc_bus, tmp_path / "fresh.db", policy)
        tasks.append(asyncio.create_task(service2.run(stop_svc, ready2)))
        await ready2.wait()
        replay = dataclasses.replace(captured, attempts=[], result=None, status=ActionStatus.QUEUED)
        (h,) = await plain.submit_many([replay])
        final = await h.result(timeout_s=20)
        # attempt 1 of it already ran in this executor process: that lease is refused outright
        # (and lapses); the next attempt reaches the verifier, whose nonce store knows it
        assert final.status is ActionStatus.DEAD and "replayed" in final.attempts[-1].reason
        assert ran == [good.id]
        stop_svc.set()
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_signer_signs_for_one_robot_unless_told_to_sign_for_every_robot() -> None:
    from embodied_bus.actions import MemoryQueue
    from embodied_bus.security import ANY_AUDIENCE, SecurityError

    with pytest.raises(SecurityError, match="no audience"):
        Signer(PLANNER).sign(Action("navigate_to", {"x": 1}))
    # a planner fills in its bus's namespace
    queue = MemoryQueue()
    async with open_bus("zenoh:", namespace="r7") as bus:
        planner = Planner(bus, queue=queue, signer=Signer(PLANNER))
        h = await planner.submit("navigate_to", {"x": 2})
        stored = await planner.get(h.id)
        assert stored is not None and stored.auth is not None and stored.auth["aud"] == "r7"
        await planner.close()
    anywhere = Signer(PLANNER, audience=ANY_AUDIENCE).sign(Action("navigate_to", {"x": 3}), now_ns=NOW)
    assert anywhere.auth is not None and anywhere.auth["aud"] is None
    with pytest.raises(ActionRejected, match="signed for every robot"):
        Verifier(allow(), audience="r1").verify(anywhere, now_ns=NOW + 1)
    lenient = Verifier(allow(), audience="r1", accept_any_audience=True)
    assert lenient.verify(anywhere, now_ns=NOW + 1) == "ops"
