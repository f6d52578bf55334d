#!/usr/bin/env python3
"""What a Foxglove viewer costs the bus: throughput of a publisher → subscriber pair on
embedded Zenoh with nothing else attached, with a bare raw zenoh-python subscriber attached
(the floor: what any extra reader of the stream costs), and with ``embodied-bus view`` plus a
viewer process subscribed to the stream's channel, measured in the same run at 1 KiB and
1 MiB. Prints one JSON document.

Usage: python bench/view.py [--quick]

``ratio_view`` = msgs/s with the viewer / msgs/s alone (target ≥ 0.9); ``ratio_floor`` the
same for the bare subscriber; ``view_cpu_us_per_forwarded`` is the view process's CPU time
per message it forwarded to the viewer; ``forwarded``/``dropped`` are the view's counts
(dropped: replaced by newer samples while the view was behind, by design).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"1KiB": 1024, "1MiB": 1 << 20}
RAW_SUBSCRIBER = """
import os, signal, sys, threading, zenoh
c = zenoh.Config()
c.insert_json5("scouting/multicast/enabled", "false")
c.insert_json5("connect/endpoints", '["tcp/127.0.0.1:%s"]' % sys.argv[1])
s = zenoh.open(c)
n = [0]
def on(sample): n[0] += 1
sub = s.declare_subscriber("**", on)
print("ready", flush=True)
done = threading.Event()
signal.signal(signal.SIGTERM, lambda *a: done.set())
while not done.wait(0.1):
    pass
print(n[0], flush=True)
os._exit(0)  # without waiting for the session's threads
"""


def cpu_ticks(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT
    )


def stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    return out


async def run_once(size: int, n: int, attach: str) -> dict[str, Any]:
    """One timed run of ``n`` samples; ``attach``: none, raw or view."""
    from embodied_bus import Backpressure, PublisherOptions, SubscriptionOptions, open_bus
    from embodied_bus.testing.ports import free_port

    port, view_port = free_port(), free_port()
    ns = f"bench{time.time_ns()}"
    lossless = Backpressure.BLOCK
    procs: list[subprocess.Popen[str]] = []
    async with (
        open_bus(f"zenoh:?listen=tcp/127.0.0.1:{port}", namespace=ns) as pb,
        open_bus(f"zenoh://127.0.0.1:{port}", namespace=ns) as sb,
    ):
        sub = await sb.subscribe("s", options=SubscriptionOptions(capacity=1024, backpressure=lossless))
        pub = await pb.publisher("s", options=PublisherOptions(backpressure=lossless))
        await pub.wait_for_subscribers(10)
        payload = bytes(size)
        view: subprocess.Popen[str] | None = None
        if attach == "raw":
            procs.append(spawn("-c", RAW_SUBSCRIBER, str(port)))
            procs[-1].stdout.readline()  # type: ignore[union-attr]
        elif attach == "view":
            view = spawn(
                "-m", "embodied_bus.cli.main", "view", "--bus", f"zenoh://127.0.0.1:{port}", "--ns", ns,
                "--port", str(view_port), "--no-actions", "--json",
            )  # fmt: skip
            procs.append(view)
            client = spawn(
                "-m",
                "embodied_bus.testing.viewer",
                f"ws://127.0.0.1:{view_port}",
                "/s",
            )
            procs.append(client)
            ready = asyncio.create_task(asyncio.to_thread(client.stdout.readline))  # type: ignore[union-attr]
            while not ready.done():  # the channel appears with the first sample the view sees
                await pub.publish(payload, stamp_ns=time.time_ns())
                await sub.recv(timeout_s=10)
                await asyncio.sleep(0.05)
        got = 0

        async def consume() -> None:
            nonlocal got
            while got < n:
                got += len(await sub.recv_many())

        task = asyncio.create_task(consume())
        view_cpu0 = cpu_ticks(view.pid) if view is not None else 0.0
        t0 = time.perf_counter()
        for _ in range(n):
            await pub.publish(payload, stamp_ns=time.time_ns())
        await pub.flush()
        await asyncio.wait_for(task, 300)
        seconds = time.perf_counter() - t0
        out: dict[str, Any] = {"msgs_per_s": round(n / seconds, 1)}
        if view is not None:
            await asyncio.sleep(0.5)  # what the view still had in hand goes out
            view_cpu = cpu_ticks(view.pid) - view_cpu0
            received = json.loads(stop(procs[1]).strip().splitlines()[-1])["received"]
            stats = json.loads(stop(view).strip().splitlines()[-1])
            counts = stats["channels"].get("/s", {})
            out.update(
                viewer_received=received,
                forwarded=counts.get("forwarded", 0),
                dropped=counts.get("dropped", 0),
                view_cpu_us_per_forwarded=round(1e6 * view_cpu / max(1, counts.get("forwarded", 0)), 1),
                view_cpu_us_per_bus_msg=round(1e6 * view_cpu / n, 2),
            )
        for p in procs:
            if p.poll() is None:
                stop(p)
    return out


async def bench(quick: bool) -> dict[str, Any]:
    counts = {"1KiB": 40_000 if quick else 200_000, "1MiB": 600 if quick else 3_000}
    reps = 1 if quick else 3
    results: dict[str, Any] = {}
    for name, size in SIZES.items():
        runs: dict[str, list[dict[str, Any]]] = {"none": [], "raw": [], "view": []}
        for _ in range(reps):  # alternating, so a slow phase of the machine hits every variant
            for attach in runs:
                runs[attach].append(await run_once(size, counts[name], attach))

        none, raw, view = (
            statistics.median(r["msgs_per_s"] for r in runs[a]) for a in ("none", "raw", "view")
        )
        best_view = max(runs["view"], key=lambda r: r["msgs_per_s"])
        results[name] = {
            "alone_msgs_per_s": none,
            "raw_subscriber_msgs_per_s": raw,
            "view_msgs_per_s": view,
            "ratio_floor": round(raw / none, 3),
            "ratio_view": round(view / none, 3),
            "view_vs_floor": round(view / raw, 3),
            "target_ratio_view": 0.9,
            "view": {k: v for k, v in best_view.items() if k != "msgs_per_s"},
            "runs": {k: [r["msgs_per_s"] for r in v] for k, v in runs.items()},
        }
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer samples, one run per variant")
    args = ap.parse_args()
    doc = {"engine": "zenoh", "cores": os.cpu_count(), "sizes": asyncio.run(bench(args.quick))}
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
