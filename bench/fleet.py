"""A fleet on one machine: robots on their own Zenoh buses, each with an uplink into a real
Pulsar cluster (2 brokers, 2 bookies, token authentication, one namespace per robot), the
robots' links cut for 60 s, then a broker ``kill -9``ed.

Each robot is two processes: its sensors (lidar 10.03 Hz 1 MiB, IMU 200.4 Hz, GPS 5 Hz, fused
frames 9.98 Hz 50 KB, events 2 Hz, stamps with jitter) on its own Zenoh bus, and
``embodied-bus uplink`` with the robot's token, forwarding lidar at 1 Hz (none while degraded),
frames (2 Hz while degraded), IMU (10 Hz while degraded), GPS and events (every one, class 0)
through a link proxy in front of each broker's ``robots`` listener. This process is the fleet:
it reads every robot's namespace with the admin token.

Figures: the delivered ratio per stream (distinct samples that reached the fleet / what the
uplinks accepted: 1.0 means nothing accepted was lost; copies handed over again are counted
apart), the uplink's CPU per robot (share of one core), the rate
at which the backlog of a 60 s cut drains once the links are back, and the longest time a
robot's GPS stream (class 0) stood still after the broker that served it was killed.

    python bench/fleet.py [--robots 20] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embodied_bus import Backpressure, PublisherOptions, SubscriptionOptions, open_bus
from embodied_bus.engines.pulsar import stream_topic
from embodied_bus.engines.urls import parse_bus_url
from embodied_bus.testing.cluster import PulsarCluster
from embodied_bus.testing.linkproxy import LinkProxy
from embodied_bus.testing.ports import free_ports

#: stream -> (rate Hz, payload bytes, jitter ms)
SENSORS = {
    "lidar/top": (10.03, 1 << 20, 2.0),
    "imu": (200.4, 300, 0.3),
    "gps": (5.0, 64, 5.0),
    "frames/fused": (9.98, 50_000, 1.0),
    "events": (2.0, 200, 0.0),
}
#: the uplink's routes: NAME:CLASS:RATE_HZ:DOWN_RATE_HZ
ROUTES = ["events:0", "gps:0", "frames/fused:1::2", "imu:2::10", "lidar/top:3:1:0"]


# ---------------------------------------------------------------------------- one robot's sensors
async def robot_main(port: int, seconds: float) -> None:
    """Publish every sensor on a Zenoh peer listening on ``port``; print what was published."""
    async with open_bus(f"zenoh:?listen=tcp/127.0.0.1:{port}", namespace="robot") as bus:
        stop = asyncio.Event()
        sent: Counter[str] = Counter()

        async def sensor(stream: str, rate_hz: float, size: int, jitter_ms: float) -> None:
            opts = PublisherOptions(backpressure=Backpressure.BLOCK) if stream == "events" else None
            pub = await bus.publisher(stream, options=opts)
            await pub.wait_for_subscribers(60)
            rng, payload, start, n = random.Random(stream), bytes(size), time.monotonic(), 0
            while not stop.is_set():
                await pub.publish(payload, stamp_ns=time.time_ns() + int(rng.gauss(0, jitter_ms * 1e6)))
                n += 1
                sent[stream] = n
                delay = start + n / rate_hz - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)

        tasks = [asyncio.create_task(sensor(s, *spec)) for s, spec in SENSORS.items()]
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)
        stop.set()
        await asyncio.gather(*tasks)
        print(json.dumps(dict(sent)), flush=True)


# ---------------------------------------------------------------------------- the fleet side
@dataclass
class Robot:
    name: str
    port: int
    token: str
    sensors: asyncio.subprocess.Process | None = None
    uplink: asyncio.subprocess.Process | None = None
    report: dict[str, Any] = field(default_factory=dict)
    published: dict[str, int] = field(default_factory=dict)
    received: Counter[str] = field(default_factory=Counter)
    distinct: dict[str, set[int]] = field(default_factory=dict)
    gps_arrivals: list[float] = field(default_factory=list)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def follow(robot: Robot) -> None:
    """Keep the uplink's latest JSON figures."""
    assert robot.uplink is not None and robot.uplink.stdout is not None
    async for line in robot.uplink.stdout:
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if "streams" in doc:
            robot.report = doc


async def receive(url: str, robot: Robot) -> None:
    opts = SubscriptionOptions(backpressure=Backpressure.BLOCK, capacity=100_000)
    async with open_bus(url, namespace=robot.name, connect_timeout_s=60) as bus:
        sub = await bus.subscribe(list(SENSORS), options=opts)
        while True:
            for s in await sub.recv_many(1000):
                robot.received[s.stream] += 1
                robot.distinct.setdefault(s.stream, set()).add((s.header.publisher_id << 32) | s.header.seq)
                if s.stream == "gps":
                    robot.gps_arrivals.append(time.monotonic())


async def fleet_main(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="eb-fleet-bench-"))
    cluster = PulsarCluster(brokers=2, bookies=2, auth=True, listener="robots")
    t0 = time.monotonic()
    await asyncio.to_thread(cluster.start)
    started_s = time.monotonic() - t0
    links = [
        LinkProxy(("127.0.0.1", b.ports["listener"]), ("127.0.0.1", b.ports["service"])).start()
        for b in cluster.brokers
    ]
    ports = free_ports(args.robots)
    robots = [Robot(f"r{i:02d}", ports[i], cluster.add_robot(f"r{i:02d}")) for i in range(args.robots)]
    fleet_url = cluster.client_url(tenant="fleet")
    total_s = 3600.0  # the robots publish until told to stop
    receivers = []
    try:
        for r in robots:
            receivers.append(asyncio.create_task(receive(fleet_url + f"&pulsar_namespace={r.name}", r)))
        for r in robots:
            r.sensors = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "robot", "--port", str(r.port), "--seconds", str(total_s),
                stdout=asyncio.subprocess.PIPE,
            )  # fmt: skip
            to = cluster.listener_url(f"robot-{r.name}", tenant="fleet", pulsar_namespace=r.name)
            cmd = [
                sys.executable,
                "-m",
                "embodied_bus.cli.main",
                "uplink",
                "--ns",
                "robot",
                "--from",
                f"zenoh://127.0.0.1:{r.port}",
                "--to",
                to,
                "--robot",
                r.name,
                "--spool",
                str(tmp / f"{r.name}.db"),
                "--stats-every",
                "1",
            ]
            cmd += [a for route in ROUTES for a in ("--stream", route)]
            log = open(tmp / f"{r.name}-uplink.log", "wb")  # noqa: SIM115 - the child's
            r.uplink = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=log)
            log.close()
        followers = [asyncio.create_task(follow(r)) for r in robots]
        await asyncio.sleep(args.warmup_s)
        cpu0 = {r.name: cpu_s(r.uplink.pid) for r in robots if r.uplink}
        await asyncio.sleep(args.steady_s)
        cpu = {r.name: (cpu_s(r.uplink.pid) - cpu0[r.name]) / args.steady_s for r in robots if r.uplink}
        # every robot's link cut at once
        for link in links:
            link.cut()
        await asyncio.sleep(args.cut_s)
        backlog = sum(r.report.get("backlog_items", 0) for r in robots)
        backlog_bytes = sum(r.report.get("backlog_bytes", 0) for r in robots)
        sent_before = sum(sum(s["sent"] for s in r.report.get("streams", {}).values()) for r in robots)
        for link in links:
            link.heal()
        healed = time.monotonic()
        while time.monotonic() - healed < 180:
            await asyncio.sleep(0.5)
            sent_now = sum(sum(s["sent"] for s in r.report.get("streams", {}).values()) for r in robots)
            if sent_now >= sent_before + backlog:
                break
        drain_s = time.monotonic() - healed
        # every uplink back to normal (its backlog of every class sent), then a steady spell
        while time.monotonic() - healed < 300 and any(r.report.get("degraded", True) for r in robots):
            await asyncio.sleep(0.5)
        recovered_s = time.monotonic() - healed
        await asyncio.sleep(args.after_s)
        # the broker that serves r00's GPS (class 0: never behind a backlog), killed
        settings = parse_bus_url(fleet_url + "&pulsar_namespace=r00", namespace="r00")
        victim = cluster.owner(stream_topic(settings, "gps"))  # type: ignore[arg-type]
        on_victim = [r for r in robots if cluster.owner(stream_topic(
            parse_bus_url(fleet_url + f"&pulsar_namespace={r.name}", namespace=r.name), "gps"  # type: ignore[arg-type]
        )) is victim]  # fmt: skip
        await asyncio.to_thread(cluster.kill, victim)
        killed = time.monotonic()
        await asyncio.sleep(args.kill_s)
        pauses = []
        for r in on_victim:
            after = [killed, *(t for t in r.gps_arrivals if t > killed)]
            pauses.append(max(b - a for a, b in itertools.pairwise(after)) if len(after) > 1 else None)
        for r in robots:
            assert r.sensors is not None and r.sensors.stdout is not None
            r.sensors.terminate()
            r.published = json.loads((await r.sensors.stdout.readline()) or b"{}")
            await r.sensors.wait()
        await asyncio.sleep(10)  # what the uplinks still hold
        for r in robots:
            if r.uplink:
                r.uplink.terminate()
                await r.uplink.wait()
        await asyncio.wait(followers, timeout=30)  # their last figures, printed as they stop
    finally:
        for r in robots:
            for proc in (r.sensors, r.uplink):
                if proc is not None and proc.returncode is None:
                    proc.kill()
        for t in receivers:
            t.cancel()
        await asyncio.gather(*receivers, return_exceptions=True)
        for link in links:
            link.stop()
        await asyncio.to_thread(cluster.cleanup)
    for r in robots:
        if not r.report:
            tail = (tmp / f"{r.name}-uplink.log").read_text(errors="replace").splitlines()[-20:]
            print(f"{r.name}: its uplink reported nothing:\n" + "\n".join(tail), file=sys.stderr)
    return summarize(args, robots, cpu, backlog, backlog_bytes, (drain_s, recovered_s), pauses, started_s)


def summarize(
    args: argparse.Namespace,
    robots: list[Robot],
    cpu: dict[str, float],
    backlog: int,
    backlog_bytes: int,
    drain: tuple[float, float],
    pauses: list[float | None],
    started_s: float,
) -> dict[str, Any]:
    delivered: dict[str, Any] = {}
    for stream in SENSORS:
        got = sum(len(r.distinct.get(stream, ())) for r in robots)
        copies = sum(r.received[stream] for r in robots) - got
        spooled = sum(r.report.get("streams", {}).get(stream, {}).get("spooled", 0) for r in robots)
        published = sum(r.published.get(stream, 0) for r in robots)
        dropped = sum(
            r.report.get("streams", {}).get(stream, {}).get("dropped_spool_full", 0) for r in robots
        )
        delivered[stream] = {
            "published": published,
            "accepted_by_uplinks": spooled,
            "at_the_fleet": got,
            "copies_at_the_fleet": copies,
            "delivered_ratio": round(got / spooled, 4) if spooled else None,
            "dropped_spool_full": dropped,
        }
    cpus = sorted(cpu.values())
    known = [p for p in pauses if p is not None]
    return {
        "robots": args.robots,
        "cluster_start_s": round(started_s, 1),
        "delivered": delivered,
        "uplink_cpu_share_of_one_core": {
            "median": round(cpus[len(cpus) // 2], 3) if cpus else None,
            "max": round(cpus[-1], 3) if cpus else None,
            "all_uplinks_cores": round(sum(cpus), 2),
            "machine_cores": os.cpu_count(),
        },
        "cut": {
            "seconds": args.cut_s,
            "backlog_items_at_heal": backlog,
            "backlog_mb_at_heal": round(backlog_bytes / 2**20, 1),
            "backlog_sent_s": round(drain[0], 1),
            "drain_items_per_s": round(backlog / drain[0]) if drain[0] else None,
            "drain_mb_per_s": round(backlog_bytes / 2**20 / drain[0], 1) if drain[0] else None,
            "every_uplink_back_to_normal_s": round(drain[1], 1),
        },
        "broker_failover": {
            "robots_on_the_killed_broker": len(pauses),
            "longest_gps_pause_s": round(max(known), 1) if known else None,
            "median_gps_pause_s": round(sorted(known)[len(known) // 2], 1) if known else None,
            "robots_never_back": len(pauses) - len(known),
        },
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("role", nargs="?", default="fleet", choices=["fleet", "robot"])
    p.add_argument("--robots", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="4 robots, a 20 s cut, shorter phases")
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "robot":
        asyncio.run(robot_main(args.port, args.seconds))
        return 0
    args.warmup_s, args.steady_s, args.cut_s, args.after_s, args.kill_s = 20.0, 30.0, 60.0, 40.0, 45.0
    if args.quick:
        args.robots = min(args.robots, 4)
        args.warmup_s, args.steady_s, args.cut_s, args.after_s, args.kill_s = 10.0, 10.0, 20.0, 20.0, 30.0
    print(json.dumps(asyncio.run(fleet_main(args))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
