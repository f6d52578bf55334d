"""Replay into ROS 2 (``embodied-bus replay BAG --ros --clock``) received by ros-z, an independent
ROS 2 implementation; and pausing a replay, which holds its clock."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import sys
import time
from pathlib import Path

import pytest

from embodied_bus import open_bus
from embodied_bus.replay import RecordedMessage, ReplayOptions, read_recording, replay
from embodied_bus.replay.targets import ReplayControl
from embodied_bus.ros.config import RosLink
from embodied_bus.ros.rmw_bridge import open_rmw_session
from embodied_bus.ros.rmw_node import RmwNode
from embodied_bus.ros.rmw_replay import RosReplayTarget
from embodied_bus.rosmsg.interfaces import Interfaces
from embodied_bus.testing.ports import free_port

from conftest import zenoh_urls
from recordings import recording
from ros_z import peer_command, peer_env

SICK = recording("sick_rms_lms_radar_lidar", "rms_1xxx_lms_1xx_movement_off.bag")


def _cloud_log_times() -> list[int]:
    return [
        m.log_time_ns
        for m in read_recording([SICK], topics=("/cloud",), decode=False)
        if isinstance(m, RecordedMessage)
    ]


async def _peer(*argv: str, env: dict[str, str]) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        *peer_command(*argv), env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    ready = await asyncio.wait_for(proc.stdout.readline(), 30)  # subscribed
    assert json.loads(ready) == {"ready": True}
    return proc


async def _answer(proc: asyncio.subprocess.Process) -> dict:  # type: ignore[type-arg]
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()[-2000:]
    return json.loads(out.decode().strip().splitlines()[-1])  # type: ignore[no-any-return]


async def test_replay_ros_delivers_every_message_to_a_ros_z_subscriber_and_publishes_clock(
    tmp_path: Path,
) -> None:
    env = peer_env()  # skips where ros-z is absent
    endpoint = f"tcp/127.0.0.1:{free_port()}"
    log_times = _cloud_log_times()
    assert len(log_times) == 89
    # the player hosts the router, so the peers connect once it is up: start it, then them
    player = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "embodied_bus.cli.main", "replay", str(SICK), "--ros", "--clock", "50",
        "--host-router", endpoint, "--json", "--start-paused",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert player.stderr is not None
        async with asyncio.timeout(30):  # the router is up once the node is
            while b"ROS 2 node embodied_bus_player" not in (line := await player.stderr.readline()):
                assert line, "the player ended before its ROS node was up"
        listener = await _peer(
            "listen", "--connect", endpoint, "--topic", "/cloud", "--type", "sensor_msgs/msg/PointCloud2",
            "--count", "89", "--timeout-s", "20", env=env,
        )  # fmt: skip
        clock = await _peer("clock", "--connect", endpoint, "--count", "100000", "--timeout-s", "6", env=env)
        await asyncio.sleep(0.5)  # discovery of the peers' subscriptions: nothing is published yet
        player.send_signal(signal.SIGUSR1)  # resume: the replay starts now
        heard = await _answer(listener)
        ticks = await _answer(clock)
        out, err = await asyncio.wait_for(player.communicate(), 30)
        assert player.returncode == 0, err.decode()[-2000:]
    finally:
        if player.returncode is None:
            player.kill()
    summary = json.loads(out)
    assert summary["messages"]["/cloud"] == 89 and heard["received"] == 89
    assert "/radar" in summary["skipped"] and "no ROS 2 definition" in summary["skipped"]["/radar"]
    assert summary["timing_error_p50_ms"] < 5
    times = ticks["clock_ns"]
    # /clock: the recording's time at ~50 Hz, never backwards, within the recording
    assert len(times) >= 50, len(times)
    assert times == sorted(times)
    assert log_times[0] - 100_000_000 <= times[0] and times[-1] <= log_times[-1] + 100_000_000
    assert times[-1] - times[0] > 1_500_000_000  # it advanced with the 1.9 s recording


async def test_a_paused_replay_holds_its_clock_and_resumes_where_it_stopped() -> None:
    url, _ = zenoh_urls()
    control = ReplayControl()
    arrivals: list[float] = []
    async with open_bus(url, namespace="pause1") as bus:
        sub = await bus.subscribe("cloud")

        async def receive() -> None:
            async for _ in sub:
                arrivals.append(time.monotonic())

        receiving = asyncio.create_task(receive())
        await asyncio.sleep(0.3)

        def progress(_frac: float, n: int) -> None:
            if n == 30 and control.paused_s == 0 and not control.paused:
                control.pause()
                asyncio.get_running_loop().call_later(1.0, control.resume)

        summary = await replay(
            bus, [SICK], ReplayOptions(topics=("/cloud",)), progress=progress, control=control
        )
        async with asyncio.timeout(5):
            while len(arrivals) < 89:
                await asyncio.sleep(0.02)
        receiving.cancel()
    doc = summary.as_dict()
    assert doc["total"] == 89
    assert 0.95 <= control.paused_s < 1.5
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert max(gaps) >= 0.9  # nothing was published while paused
    assert doc["wall_s"] >= doc["recording_s"] - 0.1 + 0.95
    assert doc["timing_error_p50_ms"] < 5  # the schedule moved on by the pause, not behind it


async def test_the_ros_clock_holds_while_paused() -> None:
    port = free_port()
    session = await open_rmw_session(RosLink(host_router=f"tcp/127.0.0.1:{port}"))
    try:
        control = ReplayControl()
        target = RosReplayTarget(
            RmwNode(session, RosLink(), Interfaces()), clock_hz=10, rate=2.0, control=control
        )
        assert target.now_ns() is None and not target.tick()
        target.played(1_000_000_000)
        await asyncio.sleep(0.2)
        now = target.now_ns()
        assert now is not None and 1_300_000_000 < now < 1_700_000_000  # 0.2 s at rate 2
        control.pause()
        assert target.tick()
        held = target.now_ns()
        await asyncio.sleep(0.2)
        assert target.now_ns() == held  # paused: the recording's time stands still
        control.resume()
        assert target.tick() and target.now_ns() is not None
    finally:
        await asyncio.to_thread(session.close)


def test_clock_without_ros_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from embodied_bus.cli.main import main

    assert main(["replay", str(SICK), "--clock"]) == 1
    assert "--clock publishes ROS 2 /clock: use it with --ros" in capsys.readouterr().err
