"""Executors as separate processes: kill -9 mid-action, CLI send / dlq."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest
from processes import CLI, helper_env, wait_line

from embodied_bus import open_bus
from embodied_bus.actions import ActionStatus, Planner, QueueService, RetryPolicy
from embodied_bus.testing.ports import free_port

from conftest import wait_until, zenoh_urls

# Timing-sensitive on a loaded 2-core CI machine (several processes start and discover each other): one rerun.
pytestmark = pytest.mark.flaky(reruns=1)


def executor(url: str, ns: str, name: str, *more: str) -> subprocess.Popen[str]:
    env = helper_env()
    return subprocess.Popen(
        [
            *CLI,
            "executor",
            "--bus",
            url,
            "--ns",
            ns,
            "--handlers",
            "action_handlers:HANDLERS",
            "--name",
            name,
            *more,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


async def test_an_executor_killed_mid_action_is_replaced_and_the_action_resumes_once(tmp_path: Path) -> None:
    url_a, url_b = zenoh_urls()
    ns = f"kill{os.getpid()}"
    stop = asyncio.Event()
    async with open_bus(url_a, namespace=ns) as svc_bus, open_bus(url_b, namespace=ns) as plan_bus:
        ready = asyncio.Event()
        service = QueueService(
            svc_bus, tmp_path / "q.db", RetryPolicy(max_attempts=3, initial_backoff_s=0.05)
        )
        task = asyncio.create_task(service.run(stop, ready))
        await ready.wait()
        planner = Planner(plan_bus)
        a = executor(url_b, ns, "A")
        b = None
        try:
            await wait_until(lambda: "A" in service.live_executors(), 30, "executor A announced")
            h = await planner.submit("navigate_to", {"hang_first": True})

            async def checkpointed() -> bool:
                got = await planner.get(h.id)
                return got is not None and got.checkpoint is not None

            for _ in range(300):
                if await checkpointed():
                    break
                await asyncio.sleep(0.05)
            a.send_signal(signal.SIGKILL)  # dies mid-action, after its checkpoint
            a.wait(10)
            b = executor(url_b, ns, "B")
            done = await h.result(timeout_s=60)
        finally:
            for p in (a, b):
                if p is not None and p.poll() is None:
                    p.send_signal(signal.SIGINT)
                    p.wait(20)
            stop.set()
            await task
    assert done.status is ActionStatus.SUCCEEDED
    assert done.result["attempt"] == 2 and done.result["resumed_from"]["waypoint"] == 3
    assert [x.executor for x in done.attempts] == ["A", "B"]
    assert done.attempts[0].outcome == "lost"


@pytest.mark.parametrize("engine", ["zenoh", "pulsar"])
def test_send_and_dlq_commands_show_results_and_dead_letters(
    engine: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    ns = f"cli{engine}{os.getpid()}"
    queue: subprocess.Popen[str] | None = None
    if engine == "zenoh":
        port_url_listen, port_url = zenoh_urls()
        queue_metrics = free_port()  # the queue service serves its backlog itself too
        queue = subprocess.Popen(
            [
                *CLI,
                "queue",
                "--bus",
                port_url_listen,
                "--ns",
                ns,
                "--db",
                str(tmp_path / "q.db"),
                "--metrics-port",
                str(queue_metrics),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    else:
        port_url = request.getfixturevalue("pulsar_url")
        no_service = subprocess.run(
            [*CLI, "queue", "--bus", port_url, "--ns", ns], capture_output=True, text=True, timeout=60
        )
        assert no_service.returncode != 0 and "no queue service is needed on Pulsar" in no_service.stderr
    ex_metrics = free_port()
    ex = executor(port_url, ns, "C", "--metrics-port", str(ex_metrics))
    try:
        if queue is not None:
            wait_line(queue, "action queue serving")
        wait_line(ex, "executor C running")
        ok = subprocess.run(
            [
                *CLI,
                "send",
                "navigate_to",
                "--bus",
                port_url,
                "--ns",
                ns,
                "--payload",
                '{"x": 1}',
                "--wait",
                "--timeout",
                "60",
            ],
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout)["status"] == "succeeded"
        bad = subprocess.run(  # its own policy: two tries, not the queue's five
            [
                *(*CLI, "send", "dock", "--bus", port_url, "--ns", ns, "--wait", "--timeout", "120"),
                *("--max-attempts", "2", "--backoff", "0.1"),
            ],
            capture_output=True,
            text=True,
            timeout=150,
        )
        assert bad.returncode == 1 and json.loads(bad.stdout)["status"] == "dead"
        assert len(json.loads(bad.stdout)["attempts"]) == 2, bad.stdout
        listing = subprocess.run(
            [*CLI, "dlq", "list", "--bus", port_url, "--ns", ns], capture_output=True, text=True, timeout=60
        )
        assert "dock" in listing.stdout and "charger not found" in listing.stdout
        mport = free_port()
        live = subprocess.Popen(
            [*CLI, "actions", "--bus", port_url, "--ns", ns, "--json", "--metrics-port", str(mport)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert live.stdout is not None
            first = json.loads(live.stdout.readline())
            second = json.loads(live.stdout.readline())  # a refresh later: with rates
            base = f"http://127.0.0.1:{mport}"
            served = json.loads(urllib.request.urlopen(f"{base}/backlog", timeout=10).read())
            metrics = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
        finally:
            live.send_signal(signal.SIGINT)
            live.wait(20)
        assert first["kinds"]["dock"]["dead"] == 1 and first["dead_letters"] == 1
        assert first["redeliveries"] >= 1  # dock failed on C, and C, the only executor, retried it
        assert first["totals"]["succeeded"] == 1 and first["rates"]["ended_per_s"] is None
        assert second["rates"]["ended_per_s"] == 0 and second["in_flight"] == 0
        assert served["kinds"]["dock"]["dead"] == 1  # what an autoscaler reads (KEDA metrics-api)
        assert 'embodied_bus_actions{kind="dock",priority="0",state="dead"} 1.0' in metrics
        assert 'embodied_bus_actions_kept{status="succeeded"} 1.0' in metrics
        own = urllib.request.urlopen(f"http://127.0.0.1:{ex_metrics}/metrics", timeout=10).read().decode()
        assert 'embodied_bus_executor_actions_total{executor="C",outcome="completed"} 1.0' in own, own
        assert 'embodied_bus_executor_running{executor="C"} 0.0' in own
        if queue is not None:
            wait_line(queue, "backlog JSON on")
            own_url = f"http://127.0.0.1:{queue_metrics}/backlog"
            own = json.loads(urllib.request.urlopen(own_url, timeout=10).read())
            assert own["kinds"]["dock"]["dead"] == 1 and own["totals"]["succeeded"] == 1
        junk = subprocess.run(
            [*CLI, "send", "pick", "--bus", port_url, "--ns", ns, "--payload", "{nope"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert junk.returncode == 1 and "not valid JSON" in junk.stderr
        ghost = subprocess.run(
            [*CLI, "send", "ghost_kind", "--bus", port_url, "--ns", ns, "--wait", "--timeout", "4"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert ghost.returncode != 0 and "no live executor runs 'ghost_kind'" in ghost.stderr
        doctor = subprocess.run(
            [*CLI, "doctor", "--bus", port_url, "--ns", ns, "--samples", "10", "--json"],
            capture_output=True,
            text=True,
            timeout=90,
        )
        checks = {c["name"]: c for c in json.loads(doctor.stdout)}
        live = checks["action executors"]
        assert live["status"] == "ok" and "1 live: C (dock, navigate_to)" in live["detail"], live
        if engine == "zenoh":  # the queue service's backlog: the ghost waits, with nobody to run it
            assert "1 queued, 0 in flight, 0 retrying, 1 dead letter(s)" in checks["action queue"]["detail"]
            orphans = checks["action kinds"]
            assert orphans["status"] == "warn" and "'ghost_kind'" in orphans["detail"], orphans
    finally:
        for p in (ex, queue):
            if p is not None:
                p.send_signal(signal.SIGINT)
                p.wait(20)


def queue_process(url: str, ns: str, db: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [*CLI, "queue", "--bus", url, "--ns", ns, "--db", str(db)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_line(proc, "action queue serving")
    return proc


async def test_a_queue_service_killed_between_submit_and_execution_loses_nothing(tmp_path: Path) -> None:
    url_a, url_b = zenoh_urls()
    ns = f"qkill{os.getpid()}"
    db = tmp_path / "q.db"
    svc = queue_process(url_a, ns, db)
    svc2 = None
    ex = None
    try:
        async with open_bus(url_b, namespace=ns) as plan_bus:
            planner = Planner(plan_bus)
            handles = [await planner.submit("navigate_to", {"n": i}, priority=i % 3) for i in range(5)]
            svc.send_signal(signal.SIGKILL)  # every submit above was acknowledged, so it is on disk
            svc.wait(10)
            svc2 = queue_process(url_a, ns, db)
            ex = executor(url_b, ns, "after-crash")
            results = [await h.result(timeout_s=60) for h in handles]
    finally:
        for p in (ex, svc2, svc):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGINT)
                p.wait(20)
    assert [r.status for r in results] == [ActionStatus.SUCCEEDED] * 5
    assert all(r.attempts[-1].executor == "after-crash" for r in results)


async def test_on_pulsar_an_executor_killed_mid_action_is_replaced_and_the_action_resumes_once(
    pulsar_url: str,
) -> None:
    ns = f"pkill{os.getpid()}"
    async with open_bus(pulsar_url, namespace=ns) as plan_bus, Planner(plan_bus) as planner:
        await planner.backlog()  # the queue's subscriptions exist before any submit
        a = executor(pulsar_url, ns, "A")
        b = None
        try:
            wait_line(a, "executor A running")
            h = await planner.submit("navigate_to", {"hang_first": True})
            for _ in range(600):
                got = await planner.get(h.id)
                if got is not None and got.checkpoint is not None:
                    break
                await asyncio.sleep(0.05)
            # B consumes the same Shared subscriptions before A dies: the broker redelivers
            # what A held to B when A's connection drops
            b = executor(pulsar_url, ns, "B")
            wait_line(b, "executor B running")
            a.send_signal(signal.SIGKILL)
            a.wait(10)
            done = await h.result(timeout_s=60)
        finally:
            for p in (a, b):
                if p is not None and p.poll() is None:
                    p.send_signal(signal.SIGINT)
                    p.wait(20)
    assert done.status is ActionStatus.SUCCEEDED
    assert done.result["attempt"] == 2 and done.result["resumed_from"]["waypoint"] == 3
    assert [x.executor for x in done.attempts] == ["A", "B"]
    assert done.attempts[0].outcome == "lost"


async def test_a_pulsar_broker_killed_between_submit_and_execution_loses_nothing(pulsar_broker) -> None:  # type: ignore[no-untyped-def]
    if pulsar_broker is None:
        pytest.skip("EMBODIED_BUS_PULSAR_URL points at a broker this test cannot restart")
    ns = f"pcrash{os.getpid()}"
    async with open_bus(pulsar_broker.url, namespace=ns) as plan_bus, Planner(plan_bus) as planner:
        handles = [await planner.submit("navigate_to", {"n": i}, priority=i % 3) for i in range(5)]
        await asyncio.to_thread(pulsar_broker.restart, crash=True)  # kill -9, then start again
        ex = executor(pulsar_broker.url, ns, "after-crash")
        try:
            results = [await h.result(timeout_s=90) for h in handles]
        finally:
            ex.send_signal(signal.SIGINT)
            ex.wait(20)
    assert [r.status for r in results] == [ActionStatus.SUCCEEDED] * 5
    assert all(r.attempts[-1].executor == "after-crash" for r in results)


async def test_an_executor_started_before_the_queue_waits_for_it_and_one_told_not_to_wait_fails(
    tmp_path: Path,
) -> None:
    """Nothing listens where the executor connects: it says it waits and keeps trying; once the
    queue service comes up there, it runs what is sent. With --connect-timeout it gives up and
    exits non-zero saying why."""
    url_a, url_b = zenoh_urls()
    ns = f"late{os.getpid()}"
    quick = subprocess.run(
        [
            *CLI,
            "executor",
            "--bus",
            url_b,
            "--ns",
            ns,
            "--handlers",
            "action_handlers:HANDLERS",
            *("--connect-timeout", "2"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=helper_env(),
    )
    assert quick.returncode != 0 and "cannot open Zenoh session" in quick.stderr, quick.stderr
    early = executor(url_b, ns, "early")
    svc = None
    try:
        assert early.stderr is not None
        line = await asyncio.to_thread(early.stderr.readline)
        assert "waiting for the bus" in line, line
        svc = queue_process(url_a, ns, tmp_path / "q.db")
        async with open_bus(url_b, namespace=ns) as bus, Planner(bus) as planner:
            h = await planner.submit("navigate_to", {"x": 1})
            done = await h.result(timeout_s=60)
        assert done.status is ActionStatus.SUCCEEDED and done.attempts[-1].executor == "early"
    finally:
        for p in (early, svc):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGINT)
                p.wait(20)
