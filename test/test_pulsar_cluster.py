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
    for broker in cluster.brokers:  # back for the next test
        if not broker.alive():
            cluster.start_member(broker)
            cluster.wait_broker(broker, time.monotonic() + 120)


async def test_a_stream_rides_a_bookie_killed_and_restarted(cluster: PulsarCluster) -> None:
    def crash(_bus: object) -> None:
        bookie = cluster.bookies[0]
        cluster.kill(bookie)
        time.sleep(3.0)  # writes need both bookies (write quorum 2): they wait for it
        cluster.start_member(bookie)

    figures = await run_through(cluster, crash)
    print(json.dumps({"bookie_killed_for_s": 3.0, **figures}))
