"""A real multi-process Apache Pulsar cluster (ZooKeeper, 2 bookies, 2 brokers, token
authentication) with members killed for real: the broker that serves a lossless stream, then
a bookie, then the broker of the action queue's state log; nothing is lost or run twice at once,
and the time each stood still is measured. Robots with their own namespace and token cannot
reach each other's streams or executors."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import time
import urllib.error
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from fusion_workers import (
    assert_one_workers_frames,
    drifting_recording,
    frames_killing_one,
    fusion_log,
    last_json,
    one_worker_frames,
    ready_line,
    recorded_samples,
    replayed,
    start_replay,
    stop_all,
    worker,
)

from embodied_bus import Backpressure, PublisherOptions, SubscriptionOptions, open_bus
from embodied_bus.actions import Action, ActionStatus, Executor, Planner, QueueService, RetryPolicy
from embodied_bus.actions.pulsar.topics import ActionTopics
from embodied_bus.engines.pulsar import stream_topic
from embodied_bus.errors import BusConnectionError
from embodied_bus.fusion import load_spec
from embodied_bus.fusion.offline import digest, frame_record
from embodied_bus.fusion.worker import frames_stream
from embodied_bus.testing.cluster import PulsarCluster
from embodied_bus.uplink import Uplink, uplink_config_from_dict
from embodied_bus.uplink.down import run_down

from conftest import wait_until, zenoh_urls

RATE_HZ = 100.0
FUSION_CONFIG = Path(__file__).resolve().parents[2] / "config" / "fusion.yaml"


@pytest.fixture(autouse=True)
def _whole_again(cluster: PulsarCluster) -> Iterator[None]:
    """Every member running again after each test, also one that failed midway."""
    yield
    cluster.restore()


@pytest.fixture(scope="module")
def cluster() -> Iterator[PulsarCluster]:
    """One cluster for the module (the test command keeps a module's tests on one worker)."""
    c = PulsarCluster(brokers=2, bookies=2, auth=True)
    try:
        c.start()
        yield c
    finally:
        c.cleanup()


async def run_through(cluster: PulsarCluster, crash: object, count: int = 1200) -> dict[str, float]:
    """Publish ``count`` lossless samples at :data:`RATE_HZ` while ``crash()`` runs after 2 s;
    return what the subscriber saw: every sample, in order, and the longest pause (s)."""
    ns = "cl" + uuid.uuid4().hex[:8]
    lossless = SubscriptionOptions(backpressure=Backpressure.BLOCK, capacity=10_000)
    async with open_bus(cluster.client_url(), namespace=ns, connect_timeout_s=30) as bus:
        sub = await bus.subscribe("orders", options=lossless)
        pub = await bus.publisher("orders", options=PublisherOptions(backpressure=Backpressure.BLOCK))
        got: list[tuple[float, int]] = []

        async def receive() -> None:
            while len(got) < count:
                sample = await sub.recv(timeout_s=120)
                got.append((time.monotonic(), sample.seq))

        receiver = asyncio.create_task(receive())
        crasher = asyncio.get_running_loop().call_later(
            2.0, lambda: asyncio.ensure_future(asyncio.to_thread(crash, bus))
        )  # type: ignore[operator]
        for _ in range(count):
            await pub.publish(b"order", stamp_ns=time.time_ns())
            await asyncio.sleep(1 / RATE_HZ)
        await asyncio.wait_for(receiver, 180)
        crasher.cancel()
    seqs = [seq for _, seq in got]
    assert seqs == list(range(1, count + 1)), f"lost or out of order: {len(seqs)} received"
    pauses = [b - a for (a, _), (b, _) in itertools.pairwise(got)]
    return {"samples": count, "longest_pause_s": round(max(pauses), 2)}


async def test_a_stream_rides_the_death_of_the_broker_that_serves_it(cluster: PulsarCluster) -> None:
    killed: list[str] = []

    def crash(bus: object) -> None:
        topic = stream_topic(bus.engine.settings, "orders")  # type: ignore[attr-defined]
        owner = cluster.owner(topic)
        killed.append(owner.name)
        cluster.kill(owner)

    figures = await run_through(cluster, crash)
    print(json.dumps({"broker_killed": killed, **figures}))
    assert killed
    cluster.restore()  # back for the next test


async def test_a_sensor_stream_reports_the_gap_the_death_of_its_broker_left(cluster: PulsarCluster) -> None:
    """An IMU-like stream (200 Hz, newest wins, a sample given up after 2 s unsent) through the
    ``kill -9`` of its broker: what arrives is in order and never twice, and the subscriber's
    counters name every sample that did not arrive."""
    ns = "cl" + uuid.uuid4().hex[:8]
    rate_hz, seconds = 200.0, 25.0
    async with open_bus(cluster.client_url(), namespace=ns, connect_timeout_s=30) as bus:
        sub = await bus.subscribe("imu", options=SubscriptionOptions(capacity=50_000))
        pub = await bus.publisher("imu", options=PublisherOptions(send_timeout_s=2.0))
        got: list[int] = []
        start = time.monotonic()
        n = 0
        killed = False
        while time.monotonic() - start < seconds:
            if not killed and time.monotonic() - start > 3:
                owner = cluster.owner(stream_topic(bus.engine.settings, "imu"))  # type: ignore[arg-type]
                await asyncio.to_thread(cluster.kill, owner)
                killed = True
            await pub.publish(b"imu", stamp_ns=time.time_ns())
            n += 1
            got.extend(s.header.seq for s in sub.recv_many_nowait(10_000))
            delay = start + n / rate_hz - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        await pub.flush()
        deadline = time.monotonic() + 30
        while (not got or got[-1] < pub.seq) and time.monotonic() < deadline:
            try:
                got.extend(s.header.seq for s in await sub.recv_many(10_000, timeout_s=1))
            except TimeoutError:
                pass
        counters = sub.counters()
    assert got == sorted(set(got)), "out of order or twice"
    assert got[-1] == pub.seq, "the last sample never came"
    assert counters["missing"] == pub.seq - len(got)
    print(json.dumps({"published": pub.seq, "received": len(got), "reported_missing": counters["missing"]}))
    cluster.restore()


# under load the broker has once failed the writes of the bookie's outage ("not enough non-faulty
# bookies") and the stream then stood still past the test's 120 s; one rerun on a restored cluster
@pytest.mark.flaky(reruns=1)
async def test_a_stream_rides_a_bookie_killed_and_restarted(cluster: PulsarCluster) -> None:
    def crash(_bus: object) -> None:
        bookie = cluster.bookies[0]
        cluster.kill(bookie)
        time.sleep(3.0)  # writes need both bookies (write quorum 2): they wait for it
        cluster.start_member(bookie)
        cluster.wait_member(bookie, 90.0)  # raises with its log if it does not come back

    figures = await run_through(cluster, crash)
    print(json.dumps({"bookie_killed_for_s": 3.0, **figures}))


async def test_the_action_queue_rides_the_death_of_the_broker_of_its_state_log(
    cluster: PulsarCluster,
) -> None:
    """300 actions on two executors (each its own Pulsar client) while the broker that serves
    the queue's state log is ``kill -9``ed: every action succeeds, none ever runs twice at once,
    and the longest time no action ended is measured."""
    ns = "cl" + uuid.uuid4().hex[:8]
    running: set[str] = set()
    concurrent: list[str] = []
    runs: dict[str, int] = {}
    ended_mono: list[float] = []

    async def work(action: Action, _ctx: object) -> int:
        if action.id in running:
            concurrent.append(action.id)
        running.add(action.id)
        runs[action.id] = runs.get(action.id, 0) + 1
        try:
            await asyncio.sleep(0.05)
            return int(action.payload)  # type: ignore[call-overload]
        finally:
            running.discard(action.id)
            ended_mono.append(time.monotonic())

    url = cluster.client_url()
    policy = RetryPolicy(max_attempts=20, initial_backoff_s=0.05, max_backoff_s=1.0)
    async with (
        open_bus(url, namespace=ns, connect_timeout_s=30) as bus,
        open_bus(url, namespace=ns, connect_timeout_s=30) as ex_bus0,
        open_bus(url, namespace=ns, connect_timeout_s=30) as ex_bus1,
    ):
        stop = asyncio.Event()
        tasks = []
        for name, ex_bus in (("e0", ex_bus0), ("e1", ex_bus1)):
            ex = Executor(ex_bus, name, concurrency=4, connect_timeout_s=120)
            ex.handler("work")(work)
            tasks.append(asyncio.create_task(ex.run(stop)))
        async with Planner(bus, connect_timeout_s=120) as planner:
            await planner.set_policy(policy)
            handles = [await planner.submit("work", i) for i in range(100)]
            owner = cluster.owner(ActionTopics.of(bus.engine.settings).state)  # type: ignore[arg-type]
            await asyncio.to_thread(cluster.kill, owner)
            killed_mono = time.monotonic()
            handles += [await planner.submit("work", i) for i in range(100, 300)]
            results = []
            for h in handles:
                try:
                    results.append(await h.result(timeout_s=120))
                except TimeoutError:
                    a = await planner.get(h.id)
                    raise AssertionError(f"{h.id} never ended: {a!r} (runs: {runs.get(h.id)})") from None
            all_done_s = time.monotonic() - killed_mono
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    after = [killed_mono, *sorted(t for t in ended_mono if t > killed_mono)]
    figures = {
        "broker_killed": owner.name,
        "actions": len(results),
        "all_done_after_kill_s": round(all_done_s, 1),
        "longest_time_no_action_ended_s": round(max(b - a for a, b in itertools.pairwise(after)), 1),
        "runs_beyond_one": sum(n - 1 for n in runs.values()),
    }
    print(json.dumps(figures))
    assert all(a.status is ActionStatus.SUCCEEDED for a in results)
    assert sorted(a.result for a in results) == list(range(300))  # type: ignore[type-var]
    assert not concurrent, f"actions run twice at once: {concurrent[:5]}"
    cluster.restore()


async def test_robots_are_kept_apart_by_their_tokens_and_an_uplink_needs_only_its_own(
    cluster: PulsarCluster, tmp_path: Path
) -> None:
    """Robots ``ra`` and ``rb``, each with its own Pulsar namespace and token: ``ra`` can neither
    read ``rb``'s streams nor submit to ``rb``'s executors; an uplink holding ``ra``'s token
    forwards ``ra``'s streams and runs the fleet's actions for ``ra``."""
    tokens = {robot: cluster.add_robot(robot) for robot in ("ra", "rb")}

    def robot_url(token_of: str, robot: str) -> str:
        return (
            cluster.service_url
            + f"?token={tokens[token_of]}&tenant=fleet&pulsar_namespace={robot}&timeout=10"
        )

    fleet_url = cluster.client_url(tenant="fleet", pulsar_namespace="rb")
    ran: list[object] = []

    async def move(action: Action, _ctx: object) -> str:
        ran.append(action.payload)
        return "moved"

    stop = asyncio.Event()
    async with (
        open_bus(robot_url("rb", "rb"), namespace="rb") as b,
        open_bus(fleet_url, namespace="rb") as fleet,
    ):
        executor = Executor(b, "rb-arm")
        executor.handler("move")(move)
        serving = asyncio.create_task(executor.run(stop))
        async with Planner(fleet, connect_timeout_s=30) as planner:  # the fleet may command rb
            done = await (await planner.submit("move", "from the fleet")).result(timeout_s=60)
            assert done.status is ActionStatus.SUCCEEDED
        pub = await b.publisher("lidar/top")
        await pub.publish(b"rb's scan", stamp_ns=time.time_ns())
        # ra's token on rb's namespace: refused at once (no stream, no publisher, no action)
        with pytest.raises(BusConnectionError, match="not authorized on namespace fleet/rb"):
            async with open_bus(robot_url("ra", "rb"), namespace="rb") as intruder:
                await intruder.subscribe("lidar/top")
        async with open_bus(
            robot_url("ra", "ra"), namespace="rb"
        ) as own:  # rb's topic names, in ra's namespace
            await own.subscribe("lidar/top")
            async with Planner(own, connect_timeout_s=30) as planner:
                other = await planner.submit("move", "from robot ra")  # lands in ra's own queue
                await asyncio.sleep(2.0)  # rb's executor would have taken it by now
                assert (await planner.get(other.id)).status is ActionStatus.QUEUED  # type: ignore[union-attr]
        stop.set()
        await serving
    assert ran == ["from the fleet"], "rb's executor ran what ra sent"
    await _uplink_with_its_own_token(cluster, robot_url("ra", "ra"), tmp_path)


async def _uplink_with_its_own_token(cluster: PulsarCluster, url: str, tmp_path: Path) -> None:
    cfg = uplink_config_from_dict(
        {"robot": "ra", "streams": {"events": {"class": 0}}, "actions_down": ["dock"]},
        spool=str(tmp_path / "ra.db"),
    )
    listen, connect = zenoh_urls()
    stop = asyncio.Event()
    docked: list[object] = []

    async def dock(action: Action, _ctx: object) -> str:
        docked.append(action.payload)
        return "docked"

    fleet_url = cluster.client_url(tenant="fleet", pulsar_namespace="ra")
    async with (
        open_bus(listen, namespace="robot") as robot,
        open_bus(connect, namespace="robot") as robot_side,
        open_bus(url, namespace="ra") as uplink_bus,
        open_bus(fleet_url, namespace="ra") as fleet,
    ):
        ready = asyncio.Event()
        tasks = [asyncio.create_task(QueueService(robot, tmp_path / "q.db").run(stop, ready))]
        await ready.wait()
        arm = Executor(robot_side, "ra-arm")
        arm.handler("dock")(dock)
        tasks.append(asyncio.create_task(arm.run(stop)))
        sub = await fleet.subscribe("events", options=SubscriptionOptions(backpressure=Backpressure.BLOCK))
        uplink = Uplink(robot, uplink_bus, cfg)
        tasks += [
            asyncio.create_task(uplink.run(stop)),
            asyncio.create_task(run_down(robot, uplink_bus, cfg, stop)),
        ]
        events = await robot_side.publisher(
            "events", options=PublisherOptions(backpressure=Backpressure.BLOCK)
        )
        assert await events.wait_for_subscribers(15)
        for i in range(10):
            await events.publish(b"event", stamp_ns=time.time_ns() + i)
        assert [(await sub.recv(timeout_s=30)).header.seq for _ in range(10)] == list(range(1, 11))
        async with Planner(fleet, connect_timeout_s=30) as planner:
            done = await (await planner.submit("dock", "station 2")).result(timeout_s=60)
        assert done.status is ActionStatus.SUCCEEDED and done.result == "docked"
        assert docked == ["station 2"]
        stop.set()
        await asyncio.gather(*tasks)


@pytest.mark.flaky(reruns=1)  # a broker's failover under five JVMs and the other test worker
async def test_key_shared_fusion_workers_give_the_offline_frames_through_the_death_of_a_broker(
    cluster: PulsarCluster, tmp_path: Path
) -> None:
    """40 s of a drifting 10.03 Hz lidar and a jittering 29.97 Hz camera replayed at recorded
    speed into two Key_Shared workers; the broker serving the lidar is ``kill -9``ed 10 s in.
    Frames that need a stream whose subscription reconnects wait for it: every frame comes once,
    with the members computed offline. The spec is the shipped one with two changes for one
    replay process: a lateness bound for two cores loaded by a cluster, and the GPS waited for
    (with its ``max_delay_ms`` a fix stuck behind the replay's other topics is not waited for)."""
    path = tmp_path / "drift.mcap"
    topics = drifting_recording(path, 40, seed=11)
    doc = yaml.safe_load(FUSION_CONFIG.read_text())
    doc["fusion"]["lateness_ms"] = 1000
    del doc["fusion"]["streams"]["gps"]["max_delay_ms"]
    spec_path = tmp_path / "fusion.yaml"
    spec_path.write_text(yaml.safe_dump(doc))
    spec = load_spec(spec_path)
    expected = one_worker_frames(spec, recorded_samples(path, topics, spec, 40.0))
    ns = "clf" + uuid.uuid4().hex[:8]
    url = cluster.client_url()
    workers = [worker(url, ns, f"w{i}", "key-shared", spec_path, json_summary=False) for i in (1, 2)]
    replay: subprocess.Popen[str] | None = None
    killed: list[str] = []
    try:
        async with open_bus(url, namespace=ns, connect_timeout_s=30) as hub:
            frames_sub = await hub.subscribe(
                frames_stream(spec),
                options=SubscriptionOptions(capacity=100_000, backpressure=Backpressure.BLOCK),
            )
            for w in workers:
                line = await asyncio.to_thread(ready_line, w, 90)
                assert line.startswith("fusing"), f"a worker did not start: {line!r}"
            topic = stream_topic(hub.engine.settings, spec.reference.name)  # type: ignore[arg-type]
            await wait_until(
                lambda: _consumers(cluster, topic, f"eb-fusion-{spec.name}") == 2,
                60,
                "both Key_Shared consumers",
            )
            replay = start_replay(url, ns, path, spec_path, topics, 40, fast=False)

            def crash() -> None:
                owner = cluster.owner(topic)
                killed.append(owner.name)
                cluster.kill(owner)

            killer = asyncio.get_running_loop().call_later(
                10.0, lambda: asyncio.ensure_future(asyncio.to_thread(crash))
            )
            frames, _ = await frames_killing_one(frames_sub, expected, None, None, quiet_s=45.0)
            killer.cancel()
    finally:
        outs = stop_all(workers)
        replayed(replay)
    assert killed, "the broker was not killed"
    summaries = [last_json(o) for o in outs]
    assert_one_workers_frames(frames, expected, summaries, fusion_log(workers))
    assert digest(frame_record(f) for f in frames) == digest(expected.values())
    print(json.dumps({"broker_killed": killed, "frames": len(frames), "workers": summaries}))
    cluster.restore()


def _consumers(cluster: PulsarCluster, topic: str, subscription: str) -> int:
    try:
        stats = cluster.admin("GET", "/admin/v2/" + topic.replace("://", "/") + "/stats")
    except urllib.error.HTTPError as err:
        if err.code == 404:
            return 0
        raise
    return len(stats.get("subscriptions", {}).get(subscription, {}).get("consumers", []))  # type: ignore[union-attr]
