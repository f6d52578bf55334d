"""A real multi-process Apache Pulsar cluster (ZooKeeper, 2 bookies, 2 brokers) with members
killed for real: the broker that serves a lossless stream is ``kill -9``ed mid-run, then a
bookie; the stream loses nothing, stays in order, and the time it stood still is measured."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections.abc import Iterator

import pytest

from embodied_bus import Backpressure, PublisherOptions, SubscriptionOptions, open_bus
from embodied_bus.actions import Action, ActionStatus, Executor, Planner, RetryPolicy
from embodied_bus.actions.pulsar.topics import ActionTopics
from embodied_bus.engines.pulsar import stream_topic
from embodied_bus.testing.cluster import PulsarCluster

RATE_HZ = 100.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[PulsarCluster]:
    c = PulsarCluster(brokers=2, bookies=2)
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
    async with open_bus(cluster.service_url, namespace=ns, connect_timeout_s=30) as bus:
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


async def test_a_stream_rides_a_bookie_killed_and_restarted(cluster: PulsarCluster) -> None:
    def crash(_bus: object) -> None:
        bookie = cluster.bookies[0]
        cluster.kill(bookie)
        time.sleep(3.0)  # writes need both bookies (write quorum 2): they wait for it
        cluster.start_member(bookie)

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

    url = cluster.service_url
    policy = RetryPolicy(max_attempts=20, initial_backoff_s=0.05, max_backoff_s=1.0)
    async with (
        open_bus(url, namespace=ns, connect_timeout_s=30) as bus,
        open_bus(url, namespace=ns, connect_timeout_s=30) as ex_bus0,
        open_bus(url, namespace=ns, connect_timeout_s=30) as ex_bus1,
    ):
        stop = asyncio.Event()
        tasks = []
        for name, ex_bus in (("e0", ex_bus0), ("e1", ex_bus1)):
            ex = Executor(ex_bus, name, policy=policy, concurrency=4, connect_timeout_s=120)
            ex.handler("work")(work)
            tasks.append(asyncio.create_task(ex.run(stop)))
        async with Planner(bus, policy=policy, connect_timeout_s=120) as planner:
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
