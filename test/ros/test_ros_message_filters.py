"""``embodied_bus.ros.message_filters`` beside the real message_filters: the same node
(``examples/message_filters_node.py``), once with ``import message_filters`` and once with the
bus's, on the same rclpy topics over Fast DDS — a 10.03 Hz lidar and a 29.97 Hz camera whose
clocks jitter, the camera out for half a second. The bus gives a set for every sweep that has a
camera image within the slop, the image nearest the sweep, and names every other sweep as a drop
with its reason; message_filters' sets are counted beside it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ros2_peers import ROOT, Proc, RosEnv, robot_yaml, ros_env

from embodied_bus import open_bus
from embodied_bus.testing.ports import free_port

pytestmark = pytest.mark.flaky(reruns=1)  # ROS processes and DDS discovery on two cores

EXAMPLE = ROOT / "examples" / "message_filters_node.py"
SLOP_S = 0.05
LIDAR = {
    "topic": "/lidar/points", "type": "sensor_msgs/msg/PointCloud2", "count": 60, "rate": 10.03,
    "size": 64_000, "jitter_ms": 1.0, "qos": "reliable",
}  # fmt: skip
CAMERA = {
    "topic": "/camera/image_raw", "type": "sensor_msgs/msg/Image", "count": 180, "rate": 29.97,
    "size": 100_000, "jitter_ms": 3.0, "qos": "reliable", "skip_s": [2.0, 2.5],
}  # fmt: skip


@pytest.fixture
def ros() -> Iterator[RosEnv]:
    yield from ros_env()


def pairing_node(ros: RosEnv, *, bus: bool, config: Path) -> Proc:
    argv = [str(ros.ros.python), str(EXAMPLE), "--slop", str(SLOP_S), "--idle-s", "4"]
    env = dict(ros.env, EMBODIED_BUS_CONFIG=str(config))
    return ros.start([*argv, "--bus"] if bus else argv, env=env)


def test_the_bus_synchronizer_sets_every_sweep_or_says_why_beside_message_filters(
    ros: RosEnv, tmp_path: Path
) -> None:
    from fusion_workers import CLI

    port = free_port()
    ns = f"mf{port}"
    url = f"zenoh://127.0.0.1:{port}"
    cfg = robot_yaml(
        tmp_path / "robot.yaml",
        {
            "bus": url,
            "namespace": ns,
            "streams": {
                "lidar/top": {"topic": LIDAR["topic"], "type": LIDAR["type"], "qos": "default"},
                "camera/front": {"topic": CAMERA["topic"], "type": CAMERA["type"], "qos": "default"},
            },
            "fusion": {
                "name": "fused",
                "bucket_width_ms": 100,
                "lateness_ms": 300,
                "streams": {
                    "lidar/top": {"role": "reference", "expected_period_ms": 100},
                    "camera/front": {"role": "required", "pick": "nearest", "max_skew_ms": SLOP_S * 1000},
                },
            },
        },
    )

    async def run() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        async with open_bus(f"zenoh:?listen=tcp/127.0.0.1:{port}", namespace=ns):
            fuse = ros.start([*CLI, "fuse", "--config", str(cfg), "--bus", url, "--ns", ns])
            assert await asyncio.to_thread(fuse.wait_for, "fusing", 60), fuse.output()
            bridge = ros.node("sensor_bridge", cfg)
            assert await asyncio.to_thread(bridge.wait_for, "-> bus stream lidar/top", 60), bridge.output()
            ours = pairing_node(ros, bus=True, config=cfg)
            theirs = pairing_node(ros, bus=False, config=cfg)
            for p in (ours, theirs):
                assert await asyncio.to_thread(p.wait_for, "ready", 60), p.output()
            # published once the bridge and message_filters' subscribers both matched
            driver = ros.peer("pubs", "--plan", json.dumps([LIDAR, CAMERA]), "--subscribers", "2")
            published = (await asyncio.to_thread(driver.result, 120))["published"]
            return (
                published,
                await asyncio.to_thread(ours.result, 90),
                await asyncio.to_thread(theirs.result, 90),
            )

    published, ours, theirs = asyncio.run(run())
    sweeps, images = published[LIDAR["topic"]], published[CAMERA["topic"]]
    assert len(sweeps) == 60 and 150 <= len(images) < 180  # the outage skipped some images

    def nearest(t: int) -> int:
        return min(images, key=lambda c: (abs(c - t), c))

    within = {t for t in sweeps if abs(nearest(t) - t) <= SLOP_S * 1e9}
    # every sweep with an image within the slop has its set, with that image
    assert {s[0] for s in ours["sets"]} == within
    assert all(s[1] == nearest(s[0]) for s in ours["sets"])
    # every other sweep is a drop with its reason, none silent
    dropped = [d for d in ours["drops"] if d["reason"] == "missing"]
    assert {d["stamp_ns"] for d in dropped} == set(sweeps) - within
    assert all(d["detail"] == "camera/front" for d in dropped)
    assert len(dropped) >= 3  # the half-second outage
    assert ours["stats"]["delivered"] == len(ours["sets"])
    assert ours["stats"]["dropped"]["missing"] == len(dropped)
    # message_filters on the same topics: its sets are real pairs within the slop, fewer of them,
    # and the sweeps it left out are nowhere to be seen
    assert theirs["sets"] and all(abs(a - b) <= SLOP_S * 1e9 for a, b in theirs["sets"])
    assert len(ours["sets"]) >= len(theirs["sets"])
    print(
        json.dumps(
            {
                "sweeps": len(sweeps),
                "bus_sets": len(ours["sets"]),
                "bus_drops_named": len(dropped),
                "message_filters_sets": len(theirs["sets"]),
                "message_filters_silent": len(sweeps) - len(theirs["sets"]),
                "message_filters_image_not_nearest": sum(b != nearest(a) for a, b in theirs["sets"]),
            }
        )
    )
