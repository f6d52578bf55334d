"""The robot uplink: store-and-forward spool, classes, rates, and the link cut for real.

A robot's Zenoh bus is forwarded to the session's Pulsar broker through a
:class:`~embodied_bus.testing.linkproxy.LinkProxy` (the broker's ``robots`` listener), which
the test cuts (nothing forwarded, no connection reset) for 5 s and for 60 s while sensors with
drifting, jittering clocks publish."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from embodied_bus import Backpressure, PublisherOptions, SubscriptionOptions, open_bus
from embodied_bus.actions import Action, ActionContext, ActionStatus, Executor, Planner, QueueService
from embodied_bus.engines.pulsar.tuning import GROUP_EXPIRY_S
from embodied_bus.errors import BusConfigError
from embodied_bus.state import StateService, open_state
from embodied_bus.testing.linkproxy import LinkProxy
from embodied_bus.testing.pulsar import PulsarStandalone
from embodied_bus.uplink import RateGate, Route, Spool, SpoolFullError, Uplink
from embodied_bus.uplink import uplink_config_from_dict as config_from
from embodied_bus.uplink.down import run_down

from conftest import wait_until, zenoh_urls


# ---------------------------------------------------------------------------- the spool alone
def test_the_spool_gives_class_order_then_arrival_order_and_survives_a_reopen(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s.db", 10_000)
    spool.put_many([(2, "imu", b"h", b"i1"), (0, "events", b"h", b"e1"), (2, "imu", b"h", b"i2")])
    spool.put_many([(0, "events", b"h", b"e2"), (1, "gps", b"h", b"g1")])
    first = spool.take(10, 10_000)  # one class at a time
    assert [s.payload for s in first] == [b"e1", b"e2"]
    spool.put_many([(0, "events", b"h", b"e3")])
    assert [s.payload for s in spool.take(10, 10_000)] == [b"e3"]
    assert [s.payload for s in spool.take(10, 10_000)] == [b"g1"]
    assert [s.payload for s in spool.take(10, 10_000)] == [b"i1", b"i2"]
    spool.remove(first)
    spool.close()
    again = Spool(tmp_path / "s.db", 10_000)  # taken but not removed: sent again after a crash
    assert [s.payload for s in again.take(10, 10_000)] == [b"e3"]
    assert len(again) == 4 and again.size_bytes == 4 * 3


def test_a_full_spool_drops_the_oldest_of_the_lowest_class_and_counts_them(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s.db", 1000)
    spool.put_many([(0, "events", b"", b"e" * 100) for _ in range(3)])
    spool.put_many([(3, "lidar", b"", bytes([i]) * 100) for i in range(5)])
    spool.put_many([(2, "imu", b"", b"i" * 100) for _ in range(2)])
    assert spool.size_bytes == 1000 and not spool.dropped
    in_flight = spool.take(1, 1)  # an event being sent: on top of the limit, never dropped
    spool.put_many([(0, "events", b"", b"E" * 100) for _ in range(4)])
    assert spool.dropped == {"lidar": 3}  # the oldest lidar, nothing else
    rest = spool.take(100, 10**6) + spool.take(100, 10**6) + spool.take(100, 10**6)
    assert [s.stream for s in rest] == ["events"] * 6 + ["imu"] * 2 + ["lidar"] * 2
    assert [s.payload[0] for s in rest[-2:]] == [3, 4]  # the newest lidar is what is left
    spool.put_many([(0, "events", b"", b"x" * 100) for _ in range(2)])  # 200 bytes wait: fits
    assert spool.dropped == {"lidar": 3}
    spool.give_back([*in_flight, *rest])
    spool.put_many([(0, "events", b"", b"y" * 100)])
    assert spool.dropped == {"lidar": 5, "imu": 2}  # 1400 bytes: lidar, then imu, not the events
    with pytest.raises(SpoolFullError, match="larger than the whole spool"):
        spool.put_many([(0, "events", b"", b"z" * 2000)])


def test_a_rate_gate_keeps_the_average_rate_of_a_drifting_jittering_sensor() -> None:
    rng = random.Random(7)
    for source_hz, target_hz in ((10.03, 2.0), (29.97, 10.0), (200.4, 50.0)):
        gate, down = RateGate(target_hz, down_rate_hz=0.5), RateGate(target_hz, down_rate_hz=0)
        stamp, kept, kept_down, n = 0, 0, 0, int(source_hz * 120)
        for _ in range(n):
            stamp += int(1e9 / source_hz + rng.gauss(0, 2e6))
            kept += gate.keep(stamp)
            kept_down += down.keep(stamp, degraded=True)
        assert abs(kept / 120 - target_hz) < 0.02 * target_hz, (source_hz, kept)
        assert kept_down == 0
    slow = RateGate(5.0)  # a source slower than the target: every sample
    assert all(slow.keep(i * 250_000_000) for i in range(20))


def test_uplink_config_errors_name_the_key(tmp_path: Path) -> None:
    cfg = config_from(
        {"robot": "r1", "streams": {"events": {"class": 0}, "lidar/top": {"class": 3, "rate_hz": 2}}},
        spool=str(tmp_path / "u.db"),
    )
    assert cfg.route("lidar/top") == Route("lidar/top", 3, 2.0)
    for doc, msg in (
        ({"robot": "r1", "streams": {"imu": {"klass": 1}}}, "uplink.streams.imu: unknown key 'klass'"),
        ({"robot": "r1", "streams": {"imu": {"rate_hz": -1}}}, r"uplink.streams.imu.rate_hz: must be a rate"),
        ({"robot": "r1", "streams": {"imu": {"rate_hz": 0}}}, "0 would forward nothing"),
        ({"robot": "r1", "streams": {"bad name": {}}}, "invalid stream name"),
        ({"streams": {}}, "uplink.robot: missing"),
        ({"robot": "r1", "spool_limit_mb": 0}, "spool_limit_mb: must be positive"),
    ):
        with pytest.raises(BusConfigError, match=msg):
            config_from(doc)


# ---------------------------------------------------------------------------- the link cut for real
@dataclass(frozen=True)
class Sensor:
    stream: str
    rate_hz: float  # nominal; the clock runs this fast (drift included)
    jitter_ms: float
    size: int


@dataclass
class Seen:
    arrivals: list[tuple[str, int, int]] = field(default_factory=list)  # stream, seq, stamp_ns


SENSORS = (
    Sensor("events", 10.0, 1.0, 200),  # class 0: an operator's events, every one
    Sensor("imu", 200.4, 0.3, 300),  # class 2: every one, 5 Hz while degraded
    Sensor("lidar/top", 10.03, 2.0, 100_000),  # class 3: 2 Hz, nothing while degraded
)


@pytest.fixture
def link(pulsar_broker: PulsarStandalone | None) -> Iterator[LinkProxy]:
    if pulsar_broker is None or not pulsar_broker.listener:
        pytest.skip("needs the session's Pulsar standalone with its robots listener")
    with LinkProxy(
        ("127.0.0.1", pulsar_broker.listener_port), ("127.0.0.1", pulsar_broker.broker_port)
    ) as proxy:
        yield proxy


async def _publish(bus: object, sensor: Sensor, stop: asyncio.Event, sent: dict[str, int]) -> None:
    """Publish on an absolute schedule with a drifting, jittering stamp clock."""
    rng = random.Random(sensor.stream)
    options = PublisherOptions(backpressure=Backpressure.BLOCK)
    pub = await bus.publisher(sensor.stream, options=options)  # type: ignore[attr-defined]
    assert await pub.wait_for_subscribers(10.0), f"the uplink never subscribed to {sensor.stream}"
    period_s, start, n = 1 / sensor.rate_hz, time.monotonic(), 0
    payload = bytes(sensor.size)
    while not stop.is_set():
        jitter_ns = int(rng.gauss(0, sensor.jitter_ms * 1e6))
        await pub.publish(payload, stamp_ns=time.time_ns() + jitter_ns)
        n += 1
        sent[sensor.stream] = n
        delay = start + n * period_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)


async def _run_cut(
    pulsar_broker: PulsarStandalone,
    pulsar_url: str,
    link: LinkProxy,
    tmp_path: Path,
    *,
    cut_s: float,
    spool_limit_mb: float,
) -> dict[str, object]:
    robot_id = "r" + uuid.uuid4().hex[:8]
    routes = {
        "events": {"class": 0},
        "imu": {"class": 2, "down_rate_hz": 5},
        "lidar/top": {"class": 3, "rate_hz": 2, "down_rate_hz": 0, "lossless": False},
    }
    cfg = config_from(
        {"robot": robot_id, "streams": routes, "spool_limit_mb": spool_limit_mb, "degraded_after_s": 1.0},
        spool=str(tmp_path / "uplink.db"),
    )
    listen, connect = zenoh_urls()
    seen = Seen()
    sent: dict[str, int] = {}
    lossless = SubscriptionOptions(backpressure=Backpressure.BLOCK, capacity=100_000)
    async with (
        open_bus(listen, namespace="robot") as robot,
        open_bus(connect, namespace="robot") as sensors,
        open_bus(pulsar_broker.listener_url, namespace=robot_id, connect_timeout_s=30) as uplink_bus,
        open_bus(pulsar_url, namespace=robot_id) as fleet,
    ):
        fleet_sub = await fleet.subscribe([s.stream for s in SENSORS], options=lossless)

        async def watch() -> None:
            while True:
                s = await fleet_sub.recv()
                seen.arrivals.append((s.header.stream, s.header.seq, s.header.stamp_ns))

        watcher = asyncio.create_task(watch())
        uplink = Uplink(robot, uplink_bus, cfg)
        stop_uplink, stop_sensors = asyncio.Event(), asyncio.Event()
        runner = asyncio.create_task(uplink.run(stop_uplink))
        publishers = [asyncio.create_task(_publish(sensors, s, stop_sensors, sent)) for s in SENSORS]
        await wait_until(lambda: uplink.stats.sent["imu"] > 200, 20, "the uplink forwarding")
        link.cut()
        cut_ns = time.time_ns()
        await asyncio.sleep(cut_s)
        healed_ns = time.time_ns()
        backlog_at_heal = len(uplink.spool)
        sent_at_heal = sum(uplink.stats.sent.values())
        link.heal()
        healed_mono = time.monotonic()
        await wait_until(
            lambda: sum(uplink.stats.sent.values()) >= sent_at_heal + backlog_at_heal, 120, "the backlog sent"
        )
        drained_s = time.monotonic() - healed_mono
        await asyncio.sleep(1.0)  # samples after the cut, on a link that is back
        stop_sensors.set()
        await asyncio.gather(*publishers)
        await wait_until(lambda: not uplink.degraded and len(uplink.spool) == 0, 60, "the spool empty")
        wanted = sent["events"] + uplink.stats.sent["imu"]
        await wait_until(
            lambda: sum(1 for a in seen.arrivals if a[0] in ("events", "imu")) >= wanted,
            60,
            "the fleet got all",
        )
        stop_uplink.set()
        await runner
        watcher.cancel()
        report = uplink.report()
    by_stream: dict[str, list[tuple[int, int]]] = {}
    for stream, seq, stamp in seen.arrivals:
        by_stream.setdefault(stream, []).append((seq, stamp))
    events = [seq for seq, _ in by_stream["events"]]
    assert events == list(range(1, sent["events"] + 1)), "events lost, repeated or out of order"
    imu = [seq for seq, _ in by_stream["imu"]]
    assert imu == sorted(set(imu)), "imu repeated or out of order"
    imu_stats = report["streams"]["imu"]  # type: ignore[index]
    assert len(imu) + imu_stats["skipped_by_rate"] + imu_stats["dropped_spool_full"] == sent["imu"]
    lidar_cut = [s for _, s in by_stream.get("lidar/top", []) if cut_ns + 1.5e9 < s < healed_ns]
    assert not lidar_cut, f"lidar forwarded while the link was cut: {len(lidar_cut)}"
    # priorities on reconnect: of what waited out the cut (stamped after the batch then in flight),
    # every event arrived before any imu sample
    waited = [(i, a[0]) for i, a in enumerate(seen.arrivals) if cut_ns + 1.5e9 < a[2] < healed_ns]
    last_event = max(i for i, s in waited if s == "events")
    first_imu = min(i for i, s in waited if s == "imu")
    assert last_event < first_imu, "imu samples crossed before the events that waited with them"
    return {
        "cut_s": cut_s,
        "backlog_items_at_heal": backlog_at_heal,
        "backlog_sent_after_heal_s": round(drained_s, 2),
        "sent": sent,
        "uplink": report,
    }


async def test_a_five_second_cut_loses_no_lossless_sample_and_events_go_first(
    pulsar_broker: PulsarStandalone | None, pulsar_url: str, link: LinkProxy, tmp_path: Path
) -> None:
    assert pulsar_broker is not None
    figures = await _run_cut(pulsar_broker, pulsar_url, link, tmp_path, cut_s=5.0, spool_limit_mb=64)
    print(json.dumps(figures))
    assert figures["uplink"]["streams"]["imu"]["dropped_spool_full"] == 0  # type: ignore[index]


async def test_a_minute_long_cut_fills_the_spool_and_drops_the_lowest_class_first(
    pulsar_broker: PulsarStandalone | None, pulsar_url: str, link: LinkProxy, tmp_path: Path
) -> None:
    assert pulsar_broker is not None
    figures = await _run_cut(pulsar_broker, pulsar_url, link, tmp_path, cut_s=60.0, spool_limit_mb=0.25)
    print(json.dumps(figures))
    streams = figures["uplink"]["streams"]  # type: ignore[index]
    assert streams["imu"]["dropped_spool_full"] > 0
    assert streams["events"]["dropped_spool_full"] == 0


# ---------------------------------------------------------------------------- what comes down
async def test_state_and_actions_come_down_and_a_cut_link_never_runs_an_action_twice(
    pulsar_broker: PulsarStandalone | None, pulsar_url: str, link: LinkProxy, tmp_path: Path
) -> None:
    """A fleet table is mirrored on the robot, also what changed while the link was cut; fleet
    actions run on the robot's own queue with feedback and cancel; an action running while
    the link is cut for longer than the fleet's liveness window is retried by the fleet, and
    the retry waits for the robot's run instead of starting a second one."""
    assert pulsar_broker is not None
    robot_id = "r" + uuid.uuid4().hex[:8]
    cfg = config_from(
        {
            "robot": robot_id,
            "streams": {"events": {}},
            "state_down": ["mission"],
            "actions_down": ["move", "hold"],
        },
        spool=str(tmp_path / "uplink.db"),
    )
    listen, connect = zenoh_urls()
    runs: dict[str, int] = {}
    hold_s = {"value": 0.0}
    stop = asyncio.Event()

    async def move(action: Action, ctx: ActionContext) -> int:
        runs[str(action.payload)] = runs.get(str(action.payload), 0) + 1
        ctx.feedback({"progress": 0.5})
        await asyncio.sleep(hold_s["value"] if action.kind == "move" else 0)
        return int(action.payload) * 2  # type: ignore[call-overload]

    holding = asyncio.Event()

    async def hold(action: Action, ctx: ActionContext) -> None:
        holding.set()
        await ctx.cancelled.wait()

    async with (
        open_bus(listen, namespace="robot") as robot,
        open_bus(connect, namespace="robot") as robot_side,
        open_bus(pulsar_broker.listener_url, namespace=robot_id, connect_timeout_s=30) as uplink_bus,
        open_bus(pulsar_url, namespace=robot_id) as fleet,
    ):
        ready = [asyncio.Event(), asyncio.Event()]
        services = [
            asyncio.create_task(QueueService(robot, tmp_path / "q.db").run(stop, ready[0])),
            asyncio.create_task(StateService(robot, tmp_path / "state.db").run(stop, ready[1])),
        ]
        await asyncio.gather(*(r.wait() for r in ready))
        robot_exec = Executor(robot_side, "robot-arm", concurrency=8)
        robot_exec.handler("move")(move)
        robot_exec.handler("hold")(hold)
        tasks = [asyncio.create_task(robot_exec.run(stop))]
        down = asyncio.create_task(run_down(robot, uplink_bus, cfg, stop))
        mission = await open_state(fleet, "mission")
        mirror = await open_state(robot_side, "mission")
        await mission.put_many({"goal": {"x": 3.0}, "speed": 0.5, "old": "gone soon"})
        await mission.delete("old")
        await wait_until(lambda: mirror.snapshot().keys() == {"goal", "speed"}, 30, "the mirror")
        async with Planner(fleet, connect_timeout_s=30) as planner:
            handles = [await planner.submit("move", i) for i in range(20)]
            got = [await h.result(timeout_s=60) for h in handles]
            assert [a.result for a in got] == [2 * i for i in range(20)]
            held = await planner.submit("hold")
            await asyncio.wait_for(holding.wait(), 30)
            await held.cancel()
            assert (await held.result(timeout_s=30)).status is ActionStatus.CANCELED
            # the link cut while a move runs, longer than the fleet's liveness window; then the
            # uplink stops and a new one starts: the fleet retries the move on the new uplink
            hold_s["value"] = 20.0
            long_move = await planner.submit("move", 100)
            await wait_until(lambda: runs.get("100") == 1, 30, "the long move started")
            link.cut()
            await mission.put("speed", 0.8)
            await asyncio.sleep(GROUP_EXPIRY_S + 3)
            link.heal()
            await wait_until(
                lambda: mirror.snapshot()["speed"].value == 0.8, 30, "the change made during the cut"
            )
            down.cancel()
            await asyncio.gather(down, return_exceptions=True)
            down = asyncio.create_task(run_down(robot, uplink_bus, cfg, stop))
            done = await long_move.result(timeout_s=90)
        assert done.status is ActionStatus.SUCCEEDED and done.result == 200
        assert runs["100"] == 1, "the robot ran the action twice"
        assert len(done.attempts) >= 2, "the fleet never retried the move"
        print(json.dumps({"long_move_attempts_on_the_fleet": len(done.attempts)}))
        stop.set()
        await asyncio.gather(down, *tasks, *services)
        await mission.close()
        await mirror.close()


async def test_the_uplink_command_forwards_and_reports_then_stops_on_sigterm(
    pulsar_url: str, tmp_path: Path
) -> None:
    """``embodied-bus uplink`` as a process: a robot YAML's ``uplink:`` section plus ``--stream``;
    the fleet gets the samples with the robot's stamps and sequence numbers; SIGTERM ends it with
    its figures."""
    robot_id = "r" + uuid.uuid4().hex[:8]
    listen, connect = zenoh_urls()
    yaml_path = tmp_path / "robot.yaml"
    yaml_path.write_text(
        f"namespace: robot\nuplink:\n  robot: {robot_id}\n  spool: {tmp_path / 'u.db'}\n"
        "  streams:\n    events: {class: 0}\n"
    )
    lossless = SubscriptionOptions(backpressure=Backpressure.BLOCK, capacity=10_000)
    async with (
        open_bus(listen, namespace="robot") as robot,
        open_bus(pulsar_url, namespace=robot_id) as fleet,
    ):
        sub = await fleet.subscribe(["events", "gps"], options=lossless)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "embodied_bus.cli.main", "uplink", "--from", connect, "--to", pulsar_url,
            "--config", str(yaml_path), "--stream", "gps:1:2", "--stats-every", "0.5",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            first = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
            assert first["uplink"] == robot_id
            events = await robot.publisher(
                "events", options=PublisherOptions(backpressure=Backpressure.BLOCK)
            )
            gps = await robot.publisher("gps")
            assert await events.wait_for_subscribers(15) and await gps.wait_for_subscribers(15)
            stamps = [time.time_ns() - 10**9 + i * 50_000_000 for i in range(20)]  # 20 Hz
            for stamp in stamps:
                await events.publish(b"e", stamp_ns=stamp)
                await gps.publish(b"g", stamp_ns=stamp)
            got = [await sub.recv(timeout_s=30) for _ in range(20 + 2)]  # gps at 2 Hz: 2 of 20
            assert [(s.header.seq, s.header.stamp_ns) for s in got if s.stream == "events"] == [
                (i + 1, stamp) for i, stamp in enumerate(stamps)
            ]
            assert [s.header.publisher_id for s in got if s.stream == "events"] == [events.publisher_id] * 20
            assert [s.header.stamp_ns for s in got if s.stream == "gps"] == [stamps[0], stamps[10]]
        finally:
            proc.terminate()
            out, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err.decode()[-2000:]
        last = json.loads(out.decode().strip().splitlines()[-1])
        assert last["streams"]["events"]["sent"] == 20
        assert last["streams"]["gps"] == {
            "received": 20, "spooled": 2, "sent": 2, "skipped_by_rate": 18, "dropped_spool_full": 0
        }  # fmt: skip
