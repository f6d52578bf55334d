"""Scale-out over a Zenoh ownership ring: three worker processes, one joining and one killed
mid-stream; every bucket is fused and published exactly once."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from embodied_bus import Backpressure, PublisherOptions, SubscriptionOptions, open_bus
from embodied_bus.fusion import decode_frame, load_spec
from embodied_bus.fusion.ownership import rendezvous_owner
from embodied_bus.fusion.worker import frames_stream
from embodied_bus.sim.scenario import Scenario, generate
from embodied_bus.testing.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "config" / "fusion.yaml"
SPEC = load_spec(CONFIG)


def test_rendezvous_ownership_moves_only_the_buckets_of_a_joining_member() -> None:
    two = {"a": None, "b": None}
    three = {**two, "c": 100}
    before = {b: rendezvous_owner(b, two) for b in range(0, 400)}
    after = {b: rendezvous_owner(b, three) for b in range(0, 400)}
    assert all(after[b] == before[b] for b in range(0, 100))  # c owns nothing before bucket 100
    moved = [b for b in range(100, 400) if after[b] != before[b]]
    assert moved and all(after[b] == "c" for b in moved)
    assert 0.2 < len(moved) / 300 < 0.5  # about a third
    assert {rendezvous_owner(b, {"a": None}) for b in range(50)} == {"a"}


def _worker(port: int, ns: str, wid: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "embodied_bus.cli.main",
            "fuse",
            "--config",
            str(CONFIG),
            "--bus",
            f"zenoh://127.0.0.1:{port}",
            "--ns",
            ns,
            "--ring",
            "--worker-id",
            wid,
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


async def test_three_ring_workers_publish_every_bucket_once_through_join_and_kill() -> None:
    port = free_port()
    ns = f"ring{os.getpid()}"
    samples = generate(Scenario(duration_s=8))
    async with open_bus(f"zenoh:?listen=tcp/127.0.0.1:{port}", namespace=ns) as hub:
        frames_sub = await hub.subscribe(
            frames_stream(SPEC), options=SubscriptionOptions(capacity=10_000, backpressure=Backpressure.BLOCK)
        )
        members: dict[str, str] = {}
        watch = await hub.engine.watch_group(
            SPEC.name, lambda m, v, j: members.update({m: v}) if j else members.pop(m, None)
        )
        w1, w2 = _worker(port, ns, "w1"), _worker(port, ns, "w2")
        w3 = None
        try:
            deadline = time.monotonic() + 30
            while len(members) < 1:
                assert time.monotonic() < deadline, "workers did not come up"
                await asyncio.sleep(0.05)
            pubs = {
                name: await hub.publisher(name, options=PublisherOptions(backpressure=Backpressure.BLOCK))
                for name in ("lidar/top", "camera/front", "gps", "imu")
            }
            for p in pubs.values():
                assert await p.wait_for_subscribers(20)
            await asyncio.sleep(1.0)  # let both cold-started workers settle
            t_wall = time.monotonic()
            t_first = samples[0].receive_ns
            for s in samples:  # 2x real time: 8 s of data in 4 s
                elapsed = time.monotonic() - t_wall
                if w3 is None and elapsed > 1.0:
                    w3 = _worker(port, ns, "w3")  # joins mid-stream
                if w2.poll() is None and elapsed > 2.5:
                    w2.send_signal(signal.SIGKILL)  # dies mid-stream
                delay = t_wall + (s.receive_ns - t_first) / 2e9 - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                await pubs[s.stream].publish(b"x", stamp_ns=s.stamp_ns)
            sweeps = sum(1 for s in samples if s.stream == "lidar/top")
            frames = []
            try:
                while sum(1 for f in frames if f.member("lidar/top")) < sweeps:
                    frames.append(decode_frame((await frames_sub.recv(timeout_s=10)).payload))
            except TimeoutError:
                pass
            owners_seen = set(members)
        finally:
            for w in (w1, w2, w3):
                if w is not None and w.poll() is None:
                    w.send_signal(signal.SIGINT)
            outs = [w.communicate(timeout=30) if w is not None else ("", "") for w in (w1, w2, w3)]
            await watch.leave()
    buckets = [f.bucket for f in frames]
    assert len(buckets) == len(set(buckets)), "a bucket was published twice"
    with_lidar = sorted(f.bucket for f in frames if f.member("lidar/top"))
    assert len(with_lidar) == sweeps, (
        f"lost buckets: {sweeps - len(with_lidar)}; stderr: {[o[1][-500:] for o in outs]}"
    )
    assert sum(f.complete for f in frames if f.member("lidar/top")) >= sweeps - 3
    assert "w3" in owners_seen or '"worker": "w3"' in outs[2][0]
