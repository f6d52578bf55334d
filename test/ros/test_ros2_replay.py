"""Replay into real ROS 2 (``embodied-bus replay BAG --ros --clock``): through rclpy over Fast DDS
where the replaying Python has rclpy, received by rclpy subscribers on ``use_sim_time`` that count
every message and read the recording's time from ``/clock``."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from ros2_peers import RosEnv, ros_env

from embodied_bus.replay import RecordedMessage, read_recording

from recordings import recording

pytestmark = pytest.mark.flaky(reruns=1)  # ROS processes and DDS discovery on two cores

SICK = recording("sick_rms_lms_radar_lidar", "rms_1xxx_lms_1xx_movement_off.bag")
CLOUDS = ["/cloud", "/cloud_radar_rawtarget", "/cloud_radar_track"]


@pytest.fixture
def ros() -> Iterator[RosEnv]:
    yield from ros_env()


def recorded() -> tuple[dict[str, list[int]], list[int]]:
    """The header stamps of each cloud topic, and every log time, of the recording."""
    stamps: dict[str, list[int]] = {t: [] for t in CLOUDS}
    log_times: list[int] = []
    for m in read_recording([SICK], topics=tuple(CLOUDS)):
        if isinstance(m, RecordedMessage):
            stamps[m.topic].append(m.stamp_ns)
            log_times.append(m.log_time_ns)
    return stamps, log_times


def assert_sim_time_followed_the_recording(node_clock_ns: list[int], log_times: list[int]) -> None:
    """What a ``use_sim_time`` node's clock read as each message came: ROS time from ``/clock``
    (zero only before the first tick), never backwards, inside the recording, advancing with it."""
    ticking = [t for t in node_clock_ns if t > 0]
    assert len(ticking) >= 0.9 * len(node_clock_ns), node_clock_ns[:20]
    assert ticking == sorted(ticking)
    assert log_times[0] - 100_000_000 <= ticking[0] and ticking[-1] <= log_times[-1] + 100_000_000
    assert ticking[-1] - ticking[0] > 1_500_000_000  # the 1.9 s recording's time, not wall time


def test_replay_through_rclpy_over_fast_dds_delivers_every_message_and_the_clock(ros: RosEnv) -> None:
    stamps, log_times = recorded()
    assert [len(stamps[t]) for t in CLOUDS] == [89, 139, 108]
    plan = [
        {"topic": t, "type": "sensor_msgs/msg/PointCloud2", "qos": "reliable-all", "count": len(stamps[t])}
        for t in CLOUDS
    ]
    listener = ros.peer("listens", "--plan", json.dumps(plan), "--timeout-s", "60", "--use-sim-time")
    assert listener.wait_for("ready", 60), listener.output()
    player = ros.start(
        [
            str(ros.ros.python), "-m", "embodied_bus.cli.main", "replay", str(SICK),
            "--topics", *CLOUDS, "/radar", "--ros", "--clock", "50", "--wait-subscribers", "30", "--json",
        ]
    )  # fmt: skip
    summary = player.result(90)
    assert player.popen.returncode == 0, player.output()[-3000:]
    assert "through rclpy" in player.output()
    heard = listener.result(60)
    assert {t: summary["messages"][t] for t in CLOUDS} == {t: len(stamps[t]) for t in CLOUDS}
    assert summary["no_subscriber"] == []
    assert "/radar" in summary["skipped"] and "not installed" in summary["skipped"]["/radar"]
    for t in CLOUDS:  # every message, in order, with its recorded stamp
        assert heard["received"][t] == stamps[t], t
    assert summary["timing_error_p50_ms"] < 5
    assert_sim_time_followed_the_recording(heard["node_clock_ns"], log_times)
