"""Attacks from the LAN on a secured action queue, as processes on the wire.

The queue service and the executor run as ``embodied-bus`` processes with their own keys
(``--seal``) and the allow-list (``--trust``, ``--allow``); the planner seals its requests and
signs its actions. The attacker is a raw zenoh-python session on the same router port: it
sniffs, replays and forges queue messages, results and liveliness tokens. What must hold: a
signed action runs once per attempt the queue granted, results and acks come from the parties
that own them, and revoking a key reaches the running processes within seconds.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zenoh
from processes import CLI, ROOT, helper_env, wait_line

from embodied_bus import Bus, open_bus
from embodied_bus.actions import Action, ActionError, ActionStatus, Planner, ZenohQueueOptions
from embodied_bus.actions.model import encode_action
from embodied_bus.security import (
    AllowList,
    Role,
    Sealer,
    Signer,
    Trust,
    WatchedAllowList,
    generate_private_key,
    public_entry,
    save_allow_list,
    save_private_key,
)
from embodied_bus.testing.ports import free_port


@dataclass
class Site:
    """A secured queue: service and executor processes, a planner, and an attacker session."""

    tmp: Path
    ns: str
    port: int
    allow_path: Path
    keys: dict[str, Any]
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    bus: Bus | None = None
    planner: Planner | None = None
    attacker: Any = None

    @property
    def url(self) -> str:
        return f"zenoh://127.0.0.1:{self.port}"

    def runs(self, action_id: str) -> list[dict[str, Any]]:
        log = self.tmp / "runs.jsonl"
        if not log.exists():
            return []
        return [r for r in map(json.loads, log.read_text().splitlines()) if r["id"] == action_id]

    def executor_log(self) -> str:
        return (self.tmp / "executor.stderr").read_text()

    def sealed_by(self, name: str, channel: str, body: dict[str, Any] | bytes) -> bytes:
        """``body`` sealed by ``name``'s key, as its process would seal it."""
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return Sealer(self.keys[name]).seal(channel, raw)

    def key(self, name: str) -> Path:
        return self.tmp / f"{name}.pem"

    def put(self, topic: str, payload: bytes) -> None:
        self.attacker.put(f"eb/{self.ns}/@n/{topic}", payload)

    def ask(self, payload: bytes) -> bytes:
        """A raw request to the queue service: its reply."""
        replies = self.attacker.get(f"eb/{self.ns}/@svc/actions", payload=payload, timeout=5.0)
        for reply in replies:
            if reply.ok is not None:
                return bytes(reply.ok.payload.to_bytes())
        raise AssertionError("the queue service did not answer")


@pytest.fixture
async def site(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Site]:
    """Sealed unless a test is marked ``@pytest.mark.parametrize("site", [False], indirect=True)``
    (signed actions only, the queue protocol in the clear: what replays alone cannot do)."""
    sealed = getattr(request, "param", True)
    keys = {name: generate_private_key() for name in ("queue", "arm", "arm2", "ops", "ctl", "evil")}
    for name, key in keys.items():
        save_private_key(key, tmp_path / f"{name}.pem")
    allow = tmp_path / "allow.yaml"
    save_allow_list(
        AllowList(
            [
                public_entry("queue", keys["queue"], roles=(Role.QUEUE,)),
                public_entry("arm", keys["arm"], roles=(Role.EXECUTOR,)),
                public_entry("arm2", keys["arm2"], roles=(Role.EXECUTOR,)),  # another robot's executor
                public_entry("ops", keys["ops"], ["move"]),  # signs actions, seals requests
                public_entry("ctl", keys["ctl"], ["*"]),  # seals requests only, in some tests
            ]
        ),
        allow,
    )
    s = Site(tmp_path, "sec" + uuid.uuid4().hex[:8], free_port(), allow, keys)
    env = helper_env(EB_ATTACK_LOG=str(tmp_path / "runs.jsonl"))
    queue = subprocess.Popen(
        [
            *CLI,
            "queue",
            "--bus",
            f"zenoh:?listen=tcp/127.0.0.1:{s.port}",
            "--ns",
            s.ns,
            "--db",
            str(tmp_path / "q.db"),
            *(["--seal", str(s.key("queue")), "--trust", str(allow)] if sealed else []),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    s.procs.append(queue)
    wait_line(queue, "action queue serving")
    with open(tmp_path / "executor.stderr", "w") as err:
        ex = subprocess.Popen(
            [
                *CLI,
                "executor",
                "--bus",
                s.url,
                "--ns",
                s.ns,
                "--name",
                "arm",
                "--handlers",
                "attack_handlers:HANDLERS",
                "--concurrency",
                "2",
                *(["--seal", str(s.key("arm")), "--trust", str(allow)] if sealed else []),
                "--allow",
                str(allow),
                "--nonce-db",
                str(tmp_path / "nonces.db"),
            ],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
        )
    s.procs.append(ex)
    wait_line(ex, "executor arm running")
    conf = zenoh.Config()
    conf.insert_json5("connect/endpoints", json.dumps([f"tcp/127.0.0.1:{s.port}"]))
    conf.insert_json5("scouting/multicast/enabled", "false")
    s.attacker = zenoh.open(conf)
    s.bus = await open_bus(s.url, namespace=s.ns)
    s.planner = Planner(
        s.bus,
        signer=Signer(keys["ops"]),
        backend=ZenohQueueOptions(Sealer(keys["ops"]), Trust(WatchedAllowList(allow))) if sealed else None,
    )
    try:
        yield s
    finally:
        await s.planner.close()
        await s.bus.close()
        s.attacker.close()
        for p in s.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
                p.wait(20)


async def running(s: Site, action_id: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not s.runs(action_id):
        assert time.monotonic() < deadline, f"action {action_id} never started"
        await asyncio.sleep(0.02)


async def test_captured_and_forged_pushes_never_run_an_action_again(site: Site) -> None:
    captured: list[bytes] = []
    sniffer = site.attacker.declare_subscriber(
        f"eb/{site.ns}/@n/actions/assign/**", lambda sample: captured.append(bytes(sample.payload.to_bytes()))
    )
    assert site.planner is not None
    await site.planner.backlog()  # the executor is up and idle: the next action is pushed to it
    await asyncio.sleep(1.0)
    h = await site.planner.submit("move", {"to": "bin"})
    done = await h.result(timeout_s=20)
    assert done.status is ActionStatus.SUCCEEDED and done.attempt_count == 1
    assert captured, "the queue pushed the action to the idle executor"
    genuine = captured[0]
    for _ in range(10):  # the sniffed push, again and again
        site.put("actions/assign/arm", genuine)
    envelope = msgspec.json.decode(genuine)["m"][0] if genuine.startswith(b'{"by"') else None
    assert envelope is not None, "pushes of a queue with a key are sealed"
    forged = dict(envelope, checkpoint={"step": 99})
    forged["attempts"] = [dict(envelope["attempts"][0], number=2)]
    site.put("actions/assign/arm", json.dumps([forged]).encode())  # unsealed
    evil = Sealer(site.keys["evil"]).seal("actions/assign/arm", json.dumps([forged]).encode())
    site.put("actions/assign/arm", evil)  # sealed by a key nobody trusts
    other = Sealer(site.keys["queue"]).seal("actions/assign/other", json.dumps([forged]).encode())
    site.put("actions/assign/arm", other)  # a genuine seal, moved to another executor's channel
    await asyncio.sleep(2.0)
    assert len(site.runs(h.id)) == 1
    log = site.executor_log()
    assert log.count("attempt 1 already ran here") >= 1, log
    assert "unsealed" in log and "unknown_key" in log and "bad_signature" in log, log
    sniffer.undeclare()


@pytest.mark.parametrize("site", [False], indirect=True)
async def test_without_seals_a_replayed_push_or_one_holding_copies_still_runs_the_action_once(
    site: Site,
) -> None:
    captured: list[bytes] = []
    sniffer = site.attacker.declare_subscriber(
        f"eb/{site.ns}/@n/actions/assign/**", lambda sample: captured.append(bytes(sample.payload.to_bytes()))
    )
    assert site.planner is not None
    await site.planner.backlog()
    await asyncio.sleep(1.0)  # the executor's take came back empty: it is idle
    h = await site.planner.submit("move", {"to": "bin", "hold_s": 1.0})
    await running(site, h.id)
    assert captured, "the queue pushed the action to the idle executor"
    (lease,) = msgspec.json.decode(captured[0])
    site.put("actions/assign/arm", json.dumps([lease] * 10).encode())  # ten copies at once
    done = await h.result(timeout_s=20)
    assert done.status is ActionStatus.SUCCEEDED
    for _ in range(10):  # the sniffed push again, after the action ended
        site.put("actions/assign/arm", captured[0])
    stolen = dict(lease, attempts=[dict(lease["attempts"][0], executor="evil", session="evil")])
    site.put("actions/assign/arm", json.dumps([stolen]).encode())  # granted to another party
    await wait_for_log(site, "granted to 'evil'")
    assert len(site.runs(h.id)) == 1
    log = site.executor_log()
    assert "already ran here" in log and "not sealed" in log, log  # and it was told why to seal
    sniffer.undeclare()


async def wait_for_log(s: Site, text: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in s.executor_log():
        assert time.monotonic() < deadline, f"the executor never logged {text!r}: {s.executor_log()}"
        await asyncio.sleep(0.05)


async def test_forged_acks_results_and_requests_are_refused_and_the_real_outcome_stands(site: Site) -> None:
    assert site.planner is not None
    h = await site.planner.submit("move", {"to": "dock", "hold_s": 2.0})
    await running(site, h.id)
    result = asyncio.ensure_future(h.result(timeout_s=30))
    ack = {"op": "report", "executor": {"name": "arm"}, "reports": [{"id": h.id, "attempt": 1, "ok": True,
                                                                     "result": "evil"}]}  # fmt: skip
    reply = json.loads(site.ask(json.dumps(ack).encode()))
    assert "refused" in reply["m"]["error"]  # the service seals even its refusals
    sealed = Sealer(site.keys["evil"]).seal("request", json.dumps(ack).encode())
    assert "unknown_key" in json.loads(site.ask(sealed))["m"]["error"]
    # a planner's key making an executor's request
    as_planner = Sealer(site.keys["ctl"]).seal("request", json.dumps(ack).encode())
    assert "may not act as executor" in json.loads(site.ask(as_planner))["m"]["error"]
    fake = Action("move", {"to": "dock"}, id=h.id, status=ActionStatus.SUCCEEDED, result="evil")
    site.put(f"actions/result/{h.id}", encode_action(fake))
    site.put(
        f"actions/result/{h.id}",
        Sealer(site.keys["evil"]).seal(f"actions/result/{h.id}", encode_action(fake)),
    )
    cancel = json.dumps({"op": "cancel", "id": h.id}).encode()
    assert "refused" in json.loads(site.ask(cancel))["m"]["error"]
    await asyncio.sleep(0.5)
    assert not result.done()  # no forged result was believed
    done = await result
    assert done.status is ActionStatus.SUCCEEDED and done.result == {"moved": "dock"}
    assert [t.outcome for t in done.attempts] == ["ok"] and len(site.runs(h.id)) == 1


async def test_a_fake_executor_token_neither_takes_a_lease_away_nor_counts_as_an_executor(site: Site) -> None:
    assert site.planner is not None
    h = await site.planner.submit("move", {"to": "shelf", "hold_s": 2.0})
    await running(site, h.id)
    group = f"eb/{site.ns}/@group/actions-executors"
    real = [str(r.ok.key_expr) for r in site.attacker.liveliness().get(f"{group}/**") if r.ok is not None]
    assert any("/arm/" in k for k in real), real
    # a token with the executor's name and another session, then the real one's own key, copied
    fake = site.attacker.liveliness().declare_token(f"{group}/arm/" + '{"kinds":["move"],"session":"evil"}')
    copied = site.attacker.liveliness().declare_token(next(k for k in real if "/arm/" in k))
    await asyncio.sleep(0.5)
    fake.undeclare()
    copied.undeclare()
    done = await h.result(timeout_s=30)
    assert done.status is ActionStatus.SUCCEEDED and [t.outcome for t in done.attempts] == ["ok"]
    assert len(site.runs(h.id)) == 1


async def test_a_revoked_key_stops_working_in_running_processes_within_seconds(site: Site) -> None:
    assert site.planner is not None and site.bus is not None
    # requests sealed by ctl, actions signed by ops: the executor checks the signature
    planner = Planner(
        site.bus,
        signer=Signer(site.keys["ops"]),
        backend=ZenohQueueOptions(Sealer(site.keys["ctl"]), Trust(WatchedAllowList(site.allow_path))),
    )
    try:
        before = await (await planner.submit("move", {"to": "a"})).result(timeout_s=20)
        assert before.status is ActionStatus.SUCCEEDED
        revoke = subprocess.run(
            [*CLI, "keys", "revoke", "ops", "--allow-list", str(site.allow_path)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert revoke.returncode == 0, revoke.stderr
        t0 = time.monotonic()
        await asyncio.sleep(1.5)  # the processes look at the file every second
        after = await (await planner.submit("move", {"to": "b"})).result(timeout_s=20)
        assert after.status is ActionStatus.DEAD and "unknown_key" in after.attempts[-1].reason
        assert not site.runs(after.id)
        with pytest.raises(ActionError, match="unknown_key"):
            await site.planner.submit("move", {"to": "c"})  # its requests were sealed by ops
        assert time.monotonic() - t0 < 10
    finally:
        await planner.close()


# -- the sealed protocol's last gaps ---------------------------------------------------------------


async def test_a_captured_take_sent_again_leases_nothing(site: Site) -> None:
    """A take sealed by the executor's key, captured and sent again within the seal's window
    (while an action waits), is refused as replayed: the action runs on the real executor."""
    assert site.planner is not None
    take = {"op": "take", "executor": {"name": "arm", "session": "captured"}, "kinds": ["move"],
            "labels": {}, "max": 4, "push": False}  # fmt: skip
    captured = site.sealed_by("arm", "request", take)
    first = json.loads(site.ask(captured))["m"]
    assert first["r"] == "leases", first  # the executor's own request, answered once
    busy = [await site.planner.submit("move", {"to": f"busy{i}", "hold_s": 2.0}) for i in range(2)]
    for h in busy:
        await running(site, h.id)  # both of the executor's slots are taken: the next one waits
    waiting = await site.planner.submit("move", {"to": "shelf"})
    replies = [json.loads(site.ask(captured))["m"] for _ in range(5)]
    assert all("replayed" in r.get("error", "") for r in replies), replies
    done = await waiting.result(timeout_s=30)
    assert done.status is ActionStatus.SUCCEEDED and [t.executor for t in done.attempts] == ["arm"]
    assert len(site.runs(waiting.id)) == 1


async def test_feedback_is_believed_only_from_the_executor_holding_the_action(site: Site) -> None:
    """Feedback sealed by another executor's key (in its own name or the holder's), or in the
    clear, never reaches the planner; the holder's does."""
    assert site.planner is not None
    h = await site.planner.submit("move", {"to": "bin", "hold_s": 2.0, "feedback": 4})
    got: list[Any] = []

    async def watch() -> None:
        async for fb in h.feedback():
            got.append(fb)

    watching = asyncio.create_task(watch())
    await running(site, h.id)
    topic = f"actions/fb/{h.id}"
    for executor in ("arm2", "arm"):  # another executor's key, claiming itself or the holder
        envelope = {"executor": executor, "attempt": 1, "data": {"step": 99}}
        site.put(topic, site.sealed_by("arm2", topic, envelope))
    site.put(topic, json.dumps({"executor": "arm", "attempt": 1, "data": {"step": 98}}).encode())
    done = await h.result(timeout_s=30)
    await asyncio.sleep(0.2)
    watching.cancel()
    assert done.status is ActionStatus.SUCCEEDED
    assert got and all(fb["step"] < 4 for fb in got), got  # the holder's steps 0..3 only


async def test_a_keyless_stand_in_for_the_queue_diverts_no_request(site: Site) -> None:
    """A session that declares the queue's endpoint (before and after the queue restarts)
    answering in its own name: every request still reaches the real queue and is answered by
    it; the stand-in's answers are refused and what it sees it can neither alter nor replay."""
    assert site.planner is not None
    seen: list[bytes] = []

    def stand_in(query: zenoh.Query) -> None:
        seen.append(bytes(query.payload.to_bytes()) if query.payload is not None else b"")
        query.reply(query.key_expr, json.dumps({"r": "submitted", "actions": []}).encode())

    fake = site.attacker.declare_queryable(f"eb/{site.ns}/@svc/actions", stand_in, complete=True)
    try:
        done = [
            await (await site.planner.submit("move", {"to": f"p{i}"})).result(timeout_s=20) for i in range(3)
        ]
        assert all(d.status is ActionStatus.SUCCEEDED for d in done)
        restart_queue(site)
        after = await (await site.planner.submit("move", {"to": "after-restart"})).result(timeout_s=30)
        assert after.status is ActionStatus.SUCCEEDED
    finally:
        fake.undeclare()
    assert seen and all(raw.startswith(b'{"by"') for raw in seen)  # sealed: nothing to forge
    replayed = json.loads(site.ask(seen[0]))["m"]
    assert "replayed" in replayed["error"], replayed
    withdrawn = await (await site.planner.submit("move", {"to": "withdrawn"})).result(timeout_s=20)
    assert withdrawn.status is ActionStatus.SUCCEEDED


def restart_queue(site: Site) -> None:
    """Kill the queue service and start it again on its database."""
    old = site.procs[0]
    old.kill()
    old.wait(10)
    queue = subprocess.Popen(
        [
            *CLI, "queue", "--bus", f"zenoh:?listen=tcp/127.0.0.1:{site.port}", "--ns", site.ns,
            "--db", str(site.tmp / "q.db"), "--seal", str(site.key("queue")), "--trust", str(site.allow_path),
        ],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    site.procs[0] = queue
    wait_line(queue, "action queue serving")


async def test_a_copied_queue_token_withdrawn_leaves_every_executor_owning_its_action(site: Site) -> None:
    """The queue's liveliness token, copied by another session and withdrawn while an action
    runs: the executor still sees the queue (``still_owner()`` stays true) and the action
    succeeds once."""
    assert site.planner is not None
    group = f"eb/{site.ns}/@group/actions-queue"
    real = [str(r.ok.key_expr) for r in site.attacker.liveliness().get(f"{group}/**") if r.ok is not None]
    assert real, "the queue announces itself"
    h = await site.planner.submit("move", {"to": "dock", "hold_s": 2.0, "report_owner": True})
    await running(site, h.id)
    for _ in range(3):
        copy = site.attacker.liveliness().declare_token(real[0])
        await asyncio.sleep(0.1)
        copy.undeclare()
    done = await h.result(timeout_s=30)
    assert done.status is ActionStatus.SUCCEEDED and done.result == {"moved": "dock", "owner": True}
    assert len(site.runs(h.id)) == 1


async def test_a_deadline_beyond_int64_is_refused_by_name_and_the_queue_serves_on(site: Site) -> None:
    assert site.planner is not None
    for deadline in (10**30, 2**63):
        submit = {"op": "submit", "actions": [{"kind": "move", "payload": {}, "deadline_ns": deadline}]}
        reply = json.loads(site.ask(site.sealed_by("ops", "request", submit)))["m"]
        assert "deadline_ns must be an integer 0..9223372036854775807 (int64)" in reply["error"], reply
    done = await (await site.planner.submit("move", {"to": "next"})).result(timeout_s=20)
    assert done.status is ActionStatus.SUCCEEDED


async def test_a_revoked_executor_exits_saying_why_without_a_traceback(site: Site) -> None:
    assert site.planner is not None
    h = await site.planner.submit("move", {"to": "x", "hold_s": 2.0})
    await running(site, h.id)
    revoke = subprocess.run(
        [*CLI, "keys", "revoke", "arm", "--allow-list", str(site.allow_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert revoke.returncode == 0, revoke.stderr
    executor = site.procs[1]
    assert await asyncio.to_thread(executor.wait, 30) != 0
    log = site.executor_log()
    assert "refused: unknown_key" in log and "Traceback" not in log, log


async def test_a_sample_stamped_at_int64_max_leaves_fuse_serving(tmp_path: Path) -> None:
    """One camera sample stamped INT64_MAX - 1 among real ones, into ``embodied-bus fuse`` of a
    spec with a bucket offset: it is reported as a clock jump, and the process fuses every sweep
    before and after it and exits 0."""
    from fusion_workers import last_json

    from embodied_bus.fusion import load_spec

    spec_path = ROOT / "config" / "fusion.yaml"
    port, ns, frames_out = free_port(), "stamps" + uuid.uuid4().hex[:6], tmp_path / "frames.jsonl"
    fuse = subprocess.Popen(
        [*CLI, "fuse", "--config", str(spec_path), "--bus", f"zenoh:?listen=tcp/127.0.0.1:{port}",
         "--ns", ns, "--frames-out", str(frames_out), "--duration", "7", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    clock = load_spec(spec_path).clock
    sweeps: list[int] = []
    async with open_bus(f"zenoh://127.0.0.1:{port}", namespace=ns) as bus:
        lidar = await bus.publisher("lidar/top", clock=clock)
        camera = await bus.publisher("camera/front", clock=clock)
        assert await lidar.wait_for_subscribers(30) and await camera.wait_for_subscribers(30)
        t0 = time.time_ns()
        for i in range(90):  # 3 s of a 30 Hz camera and a 10 Hz lidar, at their pace
            now = t0 + i * 33_333_333
            await camera.publish(b"jpeg", stamp_ns=now)
            if i == 45:
                await camera.publish(b"jpeg", stamp_ns=(1 << 63) - 2)
            if i % 3 == 0:
                await lidar.publish(b"cloud", stamp_ns=now)
                sweeps.append(now)
            await asyncio.sleep(max(0.0, (now + 33_333_333 - time.time_ns()) / 1e9))
    out, err = await asyncio.to_thread(fuse.communicate, timeout=60)
    assert fuse.returncode == 0 and "Traceback" not in err, err[-3000:]
    summary = last_json(out)
    assert summary["stamp_jumps"] >= 1, summary
    fused = [json.loads(line)["reference_stamp_ns"] for line in frames_out.read_text().splitlines()]
    assert set(sweeps) <= set(fused), f"{len(set(sweeps) - set(fused))} sweeps of {len(sweeps)} not fused"
