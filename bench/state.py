"""Latest-value state: how fast a process that starts late loads a table, and how soon a watcher
sees a put, on both engines, each beside the raw engine in the same run.

* **Late joiner**: ``--updates`` writes (default 1,000,000) spread over ``--keys`` keys (default
  100,000), then a new bus opens the table and holds every key. Targets: <= 1 s on both engines.
  The raw floor: on Zenoh one request whose answer is as large as the table's (nothing decoded),
  on Pulsar a bare ``read_compacted`` reader reading the compacted topic (nothing decoded).
* **Watch latency** (Zenoh target p50 <= 5 ms): a put on one session until a watcher on another
  session has it; the floor is a raw Zenoh put to a raw subscriber on the same two sessions.

On Zenoh the state service runs as its own process (``embodied-bus state serve``). On Pulsar a
standalone broker is started (``embodied_bus.testing.pulsar``) and the table's topic gets a
compaction threshold policy; the late joiner is timed once the broker has compacted it.

    python bench/state.py [--quick] [--zenoh-only | --pulsar-only]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from embodied_bus import Bus, open_bus
from embodied_bus.state import StateOptions, StateTable, open_state
from embodied_bus.testing.ports import free_port

BATCH = 10_000
WATCH_PUTS = 500
WATCH_RATE_HZ = 200.0


async def fill(table: StateTable, keys: int, updates: int) -> float:
    """Write ``updates`` values over ``keys`` keys (rounds of every key); seconds taken."""
    t0 = time.perf_counter()
    done = 0
    round_ = 0
    while done < updates:
        for start in range(0, keys, BATCH):
            n = min(BATCH, keys - start, updates - done)
            if n <= 0:
                break
            await table.put_many(
                {f"robot/{i:06d}": {"round": round_, "x": i * 0.5} for i in range(start, start + n)}
            )
            done += n
        round_ += 1
    return time.perf_counter() - t0


async def late_join(url: str, ns: str, keys: int) -> float:
    async with open_bus(url, namespace=ns) as bus:
        t0 = time.perf_counter()
        table = await open_state(bus, "bench", StateOptions(request_timeout_s=30))
        elapsed = time.perf_counter() - t0
        assert len(table) == keys, f"late joiner holds {len(table)} keys, not {keys}"
        return elapsed


async def watch_latency(writer: Bus, reader_url: str, ns: str) -> dict[str, float]:
    """Put on the writer's session, watch on another; p50/p99 ms."""
    async with open_bus(reader_url, namespace=ns) as reader:
        watched = await open_state(reader, "latency")
        table = await open_state(writer, "latency")
        sent: dict[int, float] = {}
        lat: list[float] = []
        done = asyncio.Event()

        async def follow() -> None:
            async for change in watched.watch():
                lat.append(time.perf_counter() - sent[change.value])
                if len(lat) == WATCH_PUTS:
                    done.set()

        task = asyncio.create_task(follow())
        await asyncio.sleep(0.2)
        for i in range(WATCH_PUTS):
            sent[i] = time.perf_counter()
            await table.put("pose", i)
            await asyncio.sleep(1 / WATCH_RATE_HZ)
        await asyncio.wait_for(done.wait(), 30)
        task.cancel()
        ms = sorted(x * 1000 for x in lat)
        return {"p50_ms": round(statistics.median(ms), 3), "p99_ms": round(ms[int(len(ms) * 0.99) - 1], 3)}


async def raw_zenoh_latency(a: Bus, b: Bus) -> dict[str, float]:
    """A raw Zenoh notification from one session to a listener on the other; p50/p99 ms."""
    loop = asyncio.get_running_loop()
    lat: list[float] = []
    done = asyncio.Event()

    def got(_topic: str, payload: bytes) -> None:
        lat.append(time.perf_counter() - float(payload))
        if len(lat) == WATCH_PUTS:
            loop.call_soon_threadsafe(done.set)

    handle = b.engine.listen("rawbench", got)
    await asyncio.sleep(0.3)
    for _ in range(WATCH_PUTS):
        a.engine.notify("rawbench", repr(time.perf_counter()).encode(), block=True)
        await asyncio.sleep(1 / WATCH_RATE_HZ)
    await asyncio.wait_for(done.wait(), 30)
    handle.undeclare()
    ms = sorted(x * 1000 for x in lat)
    return {"p50_ms": round(statistics.median(ms), 3), "p99_ms": round(ms[int(len(ms) * 0.99) - 1], 3)}


async def raw_zenoh_load(a: Bus, b: Bus, size: int) -> float:
    """One request answered with ``size`` bytes held in memory; seconds."""
    blob = b"x" * size
    handle = a.engine.serve("rawbench", lambda _req: blob)
    try:
        await b.engine.request("rawbench", b"", 10.0)  # routed
        t0 = time.perf_counter()
        answer = await b.engine.request("rawbench", b"", 30.0)
        elapsed = time.perf_counter() - t0
        assert answer is not None and len(answer) == size
        return elapsed
    finally:
        handle.undeclare()


async def bench_zenoh(keys: int, updates: int) -> dict[str, Any]:
    port = free_port()
    listen, connect = f"zenoh:?listen=tcp/127.0.0.1:{port}", f"zenoh://127.0.0.1:{port}"
    ns = "b" + uuid.uuid4().hex[:8]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "embodied_bus.cli.main", "state", "serve", "--bus", listen, "--ns", ns]
        service = subprocess.Popen(
            [*cmd, "--db", str(Path(tmp) / "state.db")], stdout=subprocess.PIPE, text=True
        )
        try:
            assert service.stdout is not None and "serving" in service.stdout.readline()
            async with open_bus(connect, namespace=ns, wait_s=10) as writer:
                table = await open_state(writer, "bench", StateOptions(request_timeout_s=30))
                fill_s = await fill(table, keys, updates)
                await table.close()
                load_s = await late_join(connect, ns, keys)
                from embodied_bus.state.codec import encode_entries

                size = len(encode_entries(table.snapshot().values()) if len(table) else b"")
                async with open_bus(connect, namespace=ns) as other:
                    raw_load_s = await raw_zenoh_load(writer, other, size)
                    raw_watch = await raw_zenoh_latency(writer, other)
                watch = await watch_latency(writer, connect, ns)
        finally:
            service.terminate()
            service.wait(20)
    return {
        "updates": updates,
        "keys": keys,
        "fill_s": round(fill_s, 2),
        "fill_updates_per_s": round(updates / fill_s),
        "late_joiner_s": round(load_s, 3),
        "late_joiner_target_s": 1.0,
        "raw_answer_of_same_size_s": round(raw_load_s, 3),
        "late_joiner_ratio_to_raw": round(load_s / raw_load_s, 2),
        "watch": watch,
        "watch_p50_target_ms": 5.0,
        "raw_zenoh_put_to_subscriber": raw_watch,
    }


def raw_compacted_read(url: str, topic: str) -> tuple[int, float]:
    import pulsar

    client = pulsar.Client(url)
    try:
        t0 = time.perf_counter()
        reader = client.create_reader(
            topic, pulsar.MessageId.earliest, is_read_compacted=True, receiver_queue_size=10_000
        )
        n = 0
        while reader.has_message_available():
            reader.read_next(5000)
            n += 1
        return n, time.perf_counter() - t0
    finally:
        client.close()


async def bench_pulsar(keys: int, updates: int) -> dict[str, Any]:
    from embodied_bus.state.pulsar import state_topic
    from embodied_bus.testing.pulsar import PulsarStandalone

    ns = "b" + uuid.uuid4().hex[:8]
    with PulsarStandalone(extra_conf={"brokerServiceCompactionMonitorIntervalInSeconds": "2"}) as broker:
        async with open_bus(broker.url, namespace=ns) as writer:
            table = await open_state(writer, "bench", StateOptions(request_timeout_s=60))
            topic = state_topic(writer.engine, "bench")  # type: ignore[arg-type]
            path = "/admin/v2/" + topic.replace("://", "/")
            broker.admin("POST", f"{path}/compactionThreshold", 1024 * 1024)
            fill_s = await fill(table, keys, updates)
            await table.close()
            t0 = time.perf_counter()
            while True:  # until the broker's compaction (by the policy) has covered the writes
                read, raw_s = await asyncio.to_thread(raw_compacted_read, broker.url, topic)
                if read < keys * 1.2 or time.perf_counter() - t0 > 300:
                    break
                await asyncio.sleep(2)
            compact_wait_s = time.perf_counter() - t0
            load_s = await late_join(broker.url, ns, keys)
            watch = await watch_latency(writer, broker.url, ns)
    return {
        "updates": updates,
        "keys": keys,
        "fill_s": round(fill_s, 2),
        "fill_updates_per_s": round(updates / fill_s),
        "compaction_covered_after_s": round(compact_wait_s, 1),
        "messages_a_late_reader_reads": read,
        "late_joiner_s": round(load_s, 3),
        "late_joiner_target_s": 1.0,
        "raw_compacted_reader_s": round(raw_s, 3),
        "late_joiner_ratio_to_raw": round(load_s / raw_s, 2),
        "watch": watch,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="10,000 keys, 100,000 updates")
    p.add_argument("--keys", type=int, default=100_000)
    p.add_argument("--updates", type=int, default=1_000_000)
    engines = p.add_mutually_exclusive_group()
    engines.add_argument("--zenoh-only", action="store_true")
    engines.add_argument("--pulsar-only", action="store_true")
    args = p.parse_args()
    keys, updates = (10_000, 100_000) if args.quick else (args.keys, args.updates)
    out: dict[str, Any] = {"bench": "state"}
    if not args.pulsar_only:
        out["zenoh"] = asyncio.run(bench_zenoh(keys, updates))
    if not args.zenoh_only:
        out["pulsar"] = asyncio.run(bench_pulsar(keys, updates))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
