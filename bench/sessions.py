"""Ordered sessions at scale: 100,000 open sessions of two steps each, on both engines, beside
the same number of independent actions in the same run.

For each engine: submit ``--sessions`` sessions (a first and a second step each, in batches of
5,000), then start 4 no-op executors and time how long the first ``--run`` steps take to end,
checking that no second step ended before its session's first. The same is done with the same
number of independent actions (no session): the ratio is what ordering costs. On Zenoh the queue
service runs in this process; on Pulsar a standalone broker is started.

    python bench/sessions.py [--quick] [--zenoh-only | --pulsar-only]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from embodied_bus import open_bus  # noqa: E402
from embodied_bus.actions import Action, Executor, Planner, QueueService  # noqa: E402
from embodied_bus.testing.ports import free_port  # noqa: E402

BATCH = 5_000
EXECUTORS = 4


async def one_run(url: str, ns: str, sessions: int, run: int, *, ordered: bool) -> dict[str, Any]:
    ended: list[tuple[str | None, int]] = []
    done = asyncio.Event()

    async def noop(action: Action, ctx: object) -> None:
        ended.append((action.session, action.payload))
        if len(ended) >= run:
            done.set()

    async with open_bus(url, namespace=ns) as bus, Planner(bus, connect_timeout_s=60) as planner:
        t0 = time.perf_counter()
        for start in range(0, sessions, BATCH):
            batch = []
            for step in (0, 1):
                for i in range(start, min(sessions, start + BATCH)):
                    batch.append(Action("noop", step, session=f"s{i}" if ordered else None))
            await planner.submit_many(batch)
        submit_s = time.perf_counter() - t0
        stop = asyncio.Event()
        executors = []
        for n in range(EXECUTORS):
            ex = Executor(bus, f"e{n}", concurrency=4)
            ex.handler("noop")(noop)
            executors.append(asyncio.create_task(ex.run(stop)))
        t0 = time.perf_counter()
        await asyncio.wait_for(done.wait(), 600)
        run_s = time.perf_counter() - t0
        stop.set()
        await asyncio.gather(*executors, return_exceptions=True)
        firsts = {s for s, step in ended if step == 0}
        early = sum(1 for s, step in ended if step == 1 and s is not None and s not in firsts)
        backlog = await planner.backlog()
    return {
        "actions": 2 * sessions,
        "open_sessions": sessions if ordered else 0,
        "submit_s": round(submit_s, 1),
        "submitted_per_s": round(2 * sessions / submit_s),
        "steps_ended": len(ended),
        "steps_per_s": round(len(ended) / run_s),
        "second_steps_before_their_first": early,
        "blocked_after": backlog.column_totals()["blocked"],
    }


async def bench(url: str, sessions: int, run: int) -> dict[str, Any]:
    ordered = await one_run(url, "bs" + uuid.uuid4().hex[:6], sessions, run, ordered=True)
    free = await one_run(url, "bf" + uuid.uuid4().hex[:6], sessions, run, ordered=False)
    return {
        "sessions": ordered,
        "independent": free,
        "steps_per_s_ratio_to_independent": round(ordered["steps_per_s"] / free["steps_per_s"], 2),
    }


async def bench_zenoh(sessions: int, run: int) -> dict[str, Any]:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out: dict[str, Any] = {}
        for name in ("sessions", "independent"):
            ns = "b" + uuid.uuid4().hex[:6]
            async with open_bus(f"zenoh:?listen=tcp/127.0.0.1:{port}", namespace=ns) as svc_bus:
                stop, ready = asyncio.Event(), asyncio.Event()
                service = QueueService(svc_bus, Path(tmp) / f"{ns}.db")
                task = asyncio.create_task(service.run(stop, ready))
                await ready.wait()
                out[name] = await one_run(
                    f"zenoh://127.0.0.1:{port}", ns, sessions, run, ordered=name == "sessions"
                )
                stop.set()
                await task
        out["steps_per_s_ratio_to_independent"] = round(
            out["sessions"]["steps_per_s"] / out["independent"]["steps_per_s"], 2
        )
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=100_000)
    p.add_argument("--run", type=int, default=4_000, help="steps to time once the executors start")
    p.add_argument("--quick", action="store_true", help="10,000 sessions, 1,000 steps")
    engines = p.add_mutually_exclusive_group()
    engines.add_argument("--zenoh-only", action="store_true")
    engines.add_argument("--pulsar-only", action="store_true")
    args = p.parse_args()
    sessions, run = (10_000, 1_000) if args.quick else (args.sessions, args.run)
    out: dict[str, Any] = {"bench": "sessions"}
    if not args.pulsar_only:
        out["zenoh"] = asyncio.run(bench_zenoh(sessions, run))
    if not args.zenoh_only:
        from embodied_bus.testing.pulsar import PulsarStandalone

        with PulsarStandalone() as broker:
            out["pulsar"] = asyncio.run(bench(broker.url, sessions, run))
    out["max_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
