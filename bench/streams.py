#!/usr/bin/env python3
"""Stream throughput and latency: embodied_bus against raw zenoh-python and raw pulsar-client,
measured in the same run. Prints one JSON document.

Usage: python bench/streams.py [--quick] [--engines zenoh,pulsar] [--pulsar-url URL]

Without --pulsar-url an Apache Pulsar standalone is started (and stopped) by the script.
Both sides use the same engine settings (Zenoh: reliable, congestion BLOCK; Pulsar: the
client's batching off, chunking on, block_if_queue_full), so ``ratio`` = ours / raw is the cost
(or gain) of the bus. On both engines a lossless publisher of ours batches small samples itself
while the engine is behind (Zenoh: the sender thread is busy; Pulsar: 64+ sends unconfirmed);
for reference, Pulsar's small sizes also report ``raw_client_batching``: raw pulsar-client
with its own batching on (not usable with chunking, so not what either side runs by default).
Zenoh moves large messages between processes of one host through a shared-memory pool;
embodied_bus configures a larger one than Zenoh's default (``DEFAULT_SHM_POOL_BYTES``), so
Zenoh's 1 MiB and 8 MiB sizes also report ``raw_same_shm_pool`` and ``ratio_same_shm_pool``:
raw zenoh-python given the same pool. An embodied_bus publisher also writes each payload of
64 KiB and more into a shared-memory pool of its own (one copy instead of zenoh-python's two);
``raw_shm_api`` / ``ratio_shm_api`` is raw zenoh-python doing that with its shared-memory API.

Each throughput figure also has ``cpu_us_per_msg``: CPU time of the benchmark process (every
thread, the engine's own included; not the Pulsar broker's) per message while it ran, and each
size has ``cpu_ratio`` = ours / raw of it, which a noisy machine disturbs less than throughput.

``ratio`` measures the per-sample API (one ``await publish`` and one ``async for`` step per
sample). The small sizes also report ``ours_batch_api`` and ``ratio_batch_api``: the same
samples (each with its own header, sequence number and bucket, every one checked for gaps)
through ``Publisher.publish_many`` in runs of 256 and ``Subscription.recv_many``, for
producers and consumers that have samples at hand in bursts (replay, drivers that read a
device buffer, high-rate IMUs). Raw zenoh-python and raw pulsar-client have no batch API; their
figures are the same in both ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import resource
import signal
import statistics
import struct
import sys
import threading
import time
from typing import Any

import numpy as np

SIZES = {"64B": 64, "1KiB": 1024, "1MiB": 1 << 20, "8MiB": 8 << 20}


def counts(quick: bool) -> dict[str, int]:
    """Samples per run. Every size runs long enough (about a second on Zenoh) that start-up
    does not decide the figure: for large sizes the first touches of fresh shared-memory pages
    (a pool of 32-64 MiB per publisher and per session), for small sizes the start of a stream
    (sessions matching, the first batches, threads waking), which costs embodied_bus more than
    raw zenoh-python in a short run."""
    if quick:
        return {"64B": 20000, "1KiB": 20000, "1MiB": 400, "8MiB": 48}
    return {"64B": 300_000, "1KiB": 300_000, "1MiB": 2000, "8MiB": 200}


def cpu_s() -> float:
    """CPU time of this process so far (all its threads, the engines' own included), seconds."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def result(n: int, size: int, seconds: float, cpu_seconds: float) -> dict[str, float]:
    return {
        "msgs_per_s": round(n / seconds, 1),
        "MB_per_s": round(n * size / seconds / 1e6, 2),
        "seconds": round(seconds, 4),
        "messages": n,
        "cpu_us_per_msg": round(cpu_seconds / n * 1e6, 2),
    }


# --------------------------------------------------------------------------- zenoh raw
def zenoh_pair(shm_pool_bytes: int | None = None) -> tuple[Any, Any]:
    """Two raw sessions on loopback with Zenoh's defaults (or this shared-memory pool size)."""
    import zenoh

    from embodied_bus.testing.ports import free_port

    zenoh.try_init_log_from_env()  # type: ignore[no-untyped-call]  # only with RUST_LOG, as embodied_bus
    port = free_port()

    def cfg(listen: bool) -> Any:
        c = zenoh.Config()
        c.insert_json5("scouting/multicast/enabled", "false")
        key = "listen/endpoints" if listen else "connect/endpoints"
        c.insert_json5(key, json.dumps([f"tcp/127.0.0.1:{port}"]))
        if shm_pool_bytes is not None:
            c.insert_json5("transport/shared_memory/transport_optimization/pool_size", str(shm_pool_bytes))
        return c

    a = zenoh.open(cfg(True))
    b = zenoh.open(cfg(False))
    return a, b


def raw_zenoh_throughput(
    size: int, n: int, shm_pool_bytes: int | None = None, *, shm_api: bool = False
) -> dict[str, float]:
    """Raw zenoh-python: ``put(bytes)``, or with ``shm_api`` each payload copied into a buffer
    of zenoh-python's shared-memory API first (what embodied_bus does for large payloads; pool
    sized as embodied_bus sizes it, allocation waits for a free buffer)."""
    import zenoh

    a, b = zenoh_pair(shm_pool_bytes)
    done = threading.Event()
    got = [0]

    def cb(s: Any) -> None:
        s.payload.to_bytes()
        got[0] += 1
        if got[0] == n:
            done.set()

    sub = b.declare_subscriber("bench/raw", cb)
    pub = a.declare_publisher(
        "bench/raw", congestion_control=zenoh.CongestionControl.BLOCK, reliability=zenoh.Reliability.RELIABLE
    )
    while not pub.matching_status.matching:
        time.sleep(0.005)
    payload = bytes(size)
    provider = None
    policy = zenoh.shm.BlockOn(zenoh.shm.GarbageCollect())
    if shm_api:
        from embodied_bus.engines.zenoh.shm import shm_pool_bytes

        provider = zenoh.shm.ShmProvider.default_backend(shm_pool_bytes(size) or 32 << 20)
    c0 = cpu_s()
    t0 = time.perf_counter()
    if provider is None:
        for _ in range(n):
            pub.put(payload)
    else:
        for _ in range(n):
            buf = provider.alloc(size, policy=policy)
            buf[0:size] = payload
            pub.put(buf)
    if not done.wait(120):
        raise RuntimeError(f"raw zenoh received {got[0]} of {n}")
    dt = time.perf_counter() - t0
    dc = cpu_s() - c0
    sub.undeclare()
    pub.undeclare()
    a.close()
    b.close()
    return result(n, size, dt, dc)


def raw_zenoh_latency(n: int) -> dict[str, float]:
    a, b = zenoh_pair()
    lat: list[int] = []
    done = threading.Event()

    def cb(s: Any) -> None:
        now = time.time_ns()
        (t,) = struct.unpack_from("<q", s.payload.to_bytes())
        lat.append(now - t)
        if len(lat) == n:
            done.set()

    sub = b.declare_subscriber("bench/lat", cb)
    pub = a.declare_publisher("bench/lat")
    while not pub.matching_status.matching:
        time.sleep(0.005)
    pad = bytes(1024 - 8)
    for _ in range(n):
        pub.put(struct.pack("<q", time.time_ns()) + pad)
        time.sleep(0.001)
    done.wait(30)
    sub.undeclare()
    pub.undeclare()
    a.close()
    b.close()
    return percentiles(lat)


def percentiles(lat_ns: list[int]) -> dict[str, float]:
    arr = np.asarray(lat_ns) / 1e6
    return {
        "p50_ms": round(float(np.percentile(arr, 50)), 4),
        "p99_ms": round(float(np.percentile(arr, 99)), 4),
        "samples": len(lat_ns),
    }


# --------------------------------------------------------------------------- pulsar raw
def raw_pulsar_throughput(url: str, size: int, n: int, client_batching: bool = False) -> dict[str, float]:
    import pulsar

    client = pulsar.Client(url, logger=_quiet_logger())
    topic = f"persistent://public/default/bench-raw-{time.time_ns()}"
    consumer = client.subscribe(topic, "bench", receiver_queue_size=1000, max_pending_chunked_message=64)
    producer = client.create_producer(
        topic,
        chunking_enabled=not client_batching,
        batching_enabled=client_batching,
        block_if_queue_full=True,
        send_timeout_millis=0,
    )
    done = threading.Event()

    def consume() -> None:
        for _ in range(n):
            m = consumer.receive(120_000)
            m.data()
            consumer.acknowledge(m)
        done.set()

    th = threading.Thread(target=consume)
    th.start()
    payload = bytes(size)
    c0 = cpu_s()
    t0 = time.perf_counter()
    for i in range(n):
        producer.send_async(payload, None, properties={"i": str(i)}, partition_key="1")
    producer.flush()
    done.wait(300)
    dt = time.perf_counter() - t0
    dc = cpu_s() - c0
    th.join()
    producer.close()
    consumer.unsubscribe()
    client.close()
    return result(n, size, dt, dc)


def raw_pulsar_latency(url: str, n: int) -> dict[str, float]:
    import pulsar

    client = pulsar.Client(url, logger=_quiet_logger())
    topic = f"persistent://public/default/bench-lat-{time.time_ns()}"
    consumer = client.subscribe(topic, "bench")
    producer = client.create_producer(topic, chunking_enabled=True, batching_enabled=False)
    lat: list[int] = []

    def consume() -> None:
        for _ in range(n):
            m = consumer.receive(60_000)
            (t,) = struct.unpack_from("<q", m.data())
            lat.append(time.time_ns() - t)
            consumer.acknowledge(m)

    th = threading.Thread(target=consume)
    th.start()
    pad = bytes(1024 - 8)
    for _ in range(n):
        producer.send_async(struct.pack("<q", time.time_ns()) + pad, None)
        time.sleep(0.001)
    th.join(120)
    producer.close()
    consumer.unsubscribe()
    client.close()
    return percentiles(lat)


def _quiet_logger() -> Any:
    """The client logger embodied_bus uses: native (C++), warnings and up.

    Not a Python ``logging.Logger``: the C++ client keeps the logger of the first client of a
    process for every later client, and a Python logger takes the GIL on every log-level check
    of the client's I/O threads, which slows the raw runs and every run of ours after them.
    """
    import pulsar

    return pulsar.ConsoleLogger(pulsar.LoggerLevel.Warn)


# --------------------------------------------------------------------------- ours
#: Samples per ``publish_many`` call in the batch-API runs.
BATCH_API_RUN = 256


async def ours_throughput(
    url_pub: str, url_sub: str, size: int, n: int, *, batch_api: bool = False
) -> dict[str, float]:
    """Ours, one ``publish`` and one ``async for`` step per sample, or with ``batch_api`` through
    ``publish_many`` (runs of :data:`BATCH_API_RUN`) and ``recv_many``: the same samples, each
    with its own header, sequence number and bucket."""
    from embodied_bus import Backpressure, PublisherOptions, SubscriptionOptions, open_bus

    ns = f"bench{time.time_ns()}"
    async with open_bus(url_pub, namespace=ns) as pb, open_bus(url_sub, namespace=ns) as sb:
        sub = await sb.subscribe(
            "s", options=SubscriptionOptions(capacity=1024, backpressure=Backpressure.BLOCK)
        )
        pub = await pb.publisher("s", options=PublisherOptions(backpressure=Backpressure.BLOCK))
        await pub.wait_for_subscribers(10)
        payload = bytes(size)

        async def consume() -> None:
            if batch_api:
                got = 0
                while got < n:
                    got += len(await sub.recv_many())
                return
            async for _ in sub:
                if sub.stats["s"].delivered == n:
                    return

        task = asyncio.create_task(consume())
        c0 = cpu_s()
        t0 = time.perf_counter()
        if batch_api:
            run = [payload] * BATCH_API_RUN
            for i in range(0, n, BATCH_API_RUN):
                k = min(BATCH_API_RUN, n - i)
                await pub.publish_many(run[:k], stamps_ns=range(1_000_000 + i, 1_000_000 + i + k))
        else:
            send = pub.publish
            for i in range(n):
                await send(payload, stamp_ns=1_000_000 + i)
        await pub.flush()
        await asyncio.wait_for(task, 300)
        dt = time.perf_counter() - t0
        dc = cpu_s() - c0
        assert sub.counters()["gaps"] == 0
    return result(n, size, dt, dc)


async def ours_latency(url_pub: str, url_sub: str, n: int) -> dict[str, float]:
    from embodied_bus import SubscriptionOptions, open_bus

    ns = f"benchlat{time.time_ns()}"
    async with open_bus(url_pub, namespace=ns) as pb, open_bus(url_sub, namespace=ns) as sb:
        sub = await sb.subscribe("s", options=SubscriptionOptions(capacity=4096))
        pub = await pb.publisher("s")
        await pub.wait_for_subscribers(10)
        payload = bytes(1024)
        lat: list[int] = []

        async def consume() -> None:
            while len(lat) < n:
                s = await sub.recv(30)
                lat.append(s.latency_ns)

        task = asyncio.create_task(consume())
        for i in range(n):
            pub.publish_nowait(payload, stamp_ns=1_000 + i)
            await asyncio.sleep(0.001)
        await asyncio.wait_for(task, 60)
    return percentiles(lat)


def ratio(ours: dict[str, float], raw: dict[str, float]) -> float:
    return round(ours["msgs_per_s"] / raw["msgs_per_s"], 3)


def best_of(fn: Any, reps: int) -> dict[str, float]:
    runs = [fn() for _ in range(reps)]
    return max(runs, key=lambda r: r["msgs_per_s"])


def bench_engine(engine: str, quick: bool, pulsar_url: str | None) -> dict[str, Any]:
    from embodied_bus.testing.ports import free_port

    out: dict[str, Any] = {}
    reps = 1 if quick else 3
    for label, size in SIZES.items():
        n = counts(quick)[label]
        if engine == "pulsar" and size >= 1 << 20:
            n = max(8, n // 4)
        elif engine == "pulsar":
            n = min(n, 60_000)  # raw pulsar-client sends ~30 k small messages a second
        if engine == "zenoh":

            def raw_fn(size: int = size, n: int = n) -> dict[str, float]:
                return raw_zenoh_throughput(size, n)

            def ours_fn(size: int = size, n: int = n, batch_api: bool = False) -> dict[str, float]:
                port = free_port()
                return asyncio.run(
                    ours_throughput(
                        f"zenoh:?listen=tcp/127.0.0.1:{port}",
                        f"zenoh://127.0.0.1:{port}",
                        size,
                        n,
                        batch_api=batch_api,
                    )
                )
        else:
            assert pulsar_url

            def raw_fn(size: int = size, n: int = n) -> dict[str, float]:
                return raw_pulsar_throughput(pulsar_url, size, n)

            def ours_fn(size: int = size, n: int = n, batch_api: bool = False) -> dict[str, float]:
                return asyncio.run(ours_throughput(pulsar_url, pulsar_url, size, n, batch_api=batch_api))

        # interleave raw and ours so drift on a noisy machine hits both
        small = size < 1 << 20
        raws, ourss, batched_api = [], [], []
        for _ in range(reps):
            raws.append(raw_fn())
            ourss.append(ours_fn())
            if small:
                batched_api.append(ours_fn(batch_api=True))
        raw = max(raws, key=lambda r: r["msgs_per_s"])
        ours = max(ourss, key=lambda r: r["msgs_per_s"])
        out[label] = {
            "raw": raw,
            "ours": ours,
            "ratio": ratio(ours, raw),
            # CPU of this process per message, ours / raw: steadier than throughput on a busy
            # machine (Pulsar: the client side only; the broker runs in its own process)
            "cpu_ratio": round(ours["cpu_us_per_msg"] / raw["cpu_us_per_msg"], 3),
        }
        if batched_api:
            # the same samples through publish_many / recv_many (small samples only)
            best = max(batched_api, key=lambda r: r["msgs_per_s"])
            out[label]["ours_batch_api"] = best
            out[label]["ratio_batch_api"] = ratio(best, raw)
        if engine == "pulsar" and size < 1 << 20:
            assert pulsar_url
            batched = raw_pulsar_throughput(pulsar_url, size, n, client_batching=True)
            out[label]["raw_client_batching"] = batched
        if engine == "zenoh" and size >= 1 << 20:
            # embodied_bus gives Zenoh a larger shared-memory pool for large messages than
            # Zenoh's default (DEFAULT_SHM_POOL_BYTES); raw zenoh-python with that pool too:
            from embodied_bus.engines.urls import DEFAULT_SHM_POOL_BYTES

            same = max(
                (raw_zenoh_throughput(size, n, DEFAULT_SHM_POOL_BYTES) for _ in range(reps)),
                key=lambda r: r["msgs_per_s"],
            )
            out[label]["raw_same_shm_pool"] = same
            out[label]["ratio_same_shm_pool"] = ratio(ours, same)
            # embodied_bus writes large payloads into a shared-memory pool of the publisher's
            # (one copy); raw zenoh-python doing the same with its shared-memory API:
            shm_api = max(
                (raw_zenoh_throughput(size, n, DEFAULT_SHM_POOL_BYTES, shm_api=True) for _ in range(reps)),
                key=lambda r: r["msgs_per_s"],
            )
            out[label]["raw_shm_api"] = shm_api
            out[label]["ratio_shm_api"] = ratio(ours, shm_api)
    n_lat = 500 if quick else 2000
    if engine == "zenoh":
        port = free_port()
        ours_l = asyncio.run(
            ours_latency(f"zenoh:?listen=tcp/127.0.0.1:{port}", f"zenoh://127.0.0.1:{port}", n_lat)
        )
        raw_l = raw_zenoh_latency(n_lat)
    else:
        assert pulsar_url
        ours_l = asyncio.run(ours_latency(pulsar_url, pulsar_url, n_lat))
        raw_l = raw_pulsar_latency(pulsar_url, n_lat)
    out["latency_1KiB"] = {"raw": raw_l, "ours": ours_l}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small counts, one repetition (< 60 s)")
    ap.add_argument("--engines", default="zenoh,pulsar")
    ap.add_argument("--pulsar-url", default=None)
    args = ap.parse_args()
    engines = [e for e in re.split(r"[, ]+", args.engines) if e]
    doc: dict[str, Any] = {"benchmark": "streams", "quick": args.quick, "python": sys.version.split()[0]}
    broker = None
    t0 = time.perf_counter()

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # so the broker below is stopped and its data deleted

    signal.signal(signal.SIGTERM, terminate)
    try:
        url = args.pulsar_url
        if "pulsar" in engines and url is None:
            from embodied_bus.testing.pulsar import PulsarStandalone

            broker = PulsarStandalone()
            broker.start()
            url = broker.url
        for engine in engines:
            doc[engine] = bench_engine(engine, args.quick, url)
    finally:
        if broker is not None:
            broker.cleanup()
    doc["elapsed_s"] = round(time.perf_counter() - t0, 1)
    doc["targets"] = {
        "zenoh_1KiB_ratio": ">= 0.6",
        "zenoh_1MiB_plus_ratio": ">= 0.9",
        "pulsar_ratio": ">= 0.8",
    }
    print(json.dumps(doc, indent=2))
    _ = statistics
    return 0


if __name__ == "__main__":
    sys.exit(main())
