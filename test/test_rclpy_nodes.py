"""The rclpy nodes for real, over Fast DDS (Jazzy's default middleware), each as its own process,
against rclpy peers: sensor topics of every type with their QoS into the bus, fused frames back
out to ROS with their original stamps and diagnostics, actions both ways, parameters and clean
shutdown. Skipped, saying why, where no ROS 2 Python is there (``embodied_bus.testing.ros2``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ros2_peers import RosEnv, robot_yaml, ros_env

from embodied_bus import Backpressure, SubscriptionOptions, open_bus
from embodied_bus.testing.ports import free_port

pytestmark = pytest.mark.flaky(reruns=1)  # several ROS processes and DDS discovery on two cores

LOSSLESS = SubscriptionOptions(capacity=10_000, backpressure=Backpressure.BLOCK)
MIB = 1 << 20


@pytest.fixture
def ros() -> Iterator[RosEnv]:
    yield from ros_env()


#: (stream, topic, type, QoS in the robot YAML, QoS of the peer, count, rate Hz, size B)
SENSORS = [
    ("lidar/top", "/lidar/points", "sensor_msgs/msg/PointCloud2", "sensor_data", "sensor", 20, 5, 8 * MIB),
    ("camera/front", "/camera/image_raw", "sensor_msgs/msg/Image", "sensor_data", "sensor", 30, 15, 900_000),
    (
        "camera/jpeg",
        "/camera/image_raw/compressed",
        "sensor_msgs/msg/CompressedImage",
        "sensor_data",
        "sensor",
        30,
        15,
        60_000,
    ),
    ("gps", "/gps/fix", "sensor_msgs/msg/NavSatFix", "default", "reliable", 50, 20, 0),
    ("imu", "/imu/data", "sensor_msgs/msg/Imu", "default", "reliable", 200, 100, 0),
    ("scan", "/scan", "sensor_msgs/msg/LaserScan", "sensor_data", "sensor", 30, 10, 4_000),
]


def test_sensor_bridge_carries_every_sensor_type_with_its_qos_and_a_latched_topic(
    ros: RosEnv, tmp_path: Path
) -> None:
    """PointCloud2 of 8 MiB, Image, CompressedImage and LaserScan best effort; NavSatFix and Imu
    reliable: every reliable message arrives, in order, with its header stamp and frame;
    best-effort ones at 90 % or more. A latched (transient-local) topic published before the
    node started reaches the bus too."""
    port = free_port()
    ns = f"rclpy{port}"
    streams = {s: {"topic": t, "type": ty, "qos": q} for s, t, ty, q, *_ in SENSORS}
    streams["calib"] = {
        "topic": "/camera/camera_info",
        "type": "sensor_msgs/msg/CameraInfo",
        "qos": {"reliability": "reliable", "durability": "transient_local", "depth": 1},
    }
    cfg = robot_yaml(
        tmp_path / "robot.yaml", {"bus": f"zenoh://127.0.0.1:{port}", "namespace": ns, "streams": streams}
    )
    latched = ros.peer(
        "pub",
        "--topic",
        "/camera/camera_info",
        "--type",
        "sensor_msgs/msg/CameraInfo",
        "--count",
        "1",
        "--qos",
        "latched",
        "--subscribers",
        "0",
        "--linger-s",
        "60",
    )
    assert latched.wait_for("ready", 60), latched.output()

    async def run() -> dict[str, list[Any]]:
        async with open_bus(f"zenoh:?listen=tcp/127.0.0.1:{port}", namespace=ns) as bus:
            sub = await bus.subscribe(tuple(streams), options=LOSSLESS)
            node = ros.node("sensor_bridge", cfg)
            assert await asyncio.to_thread(node.wait_for, "-> bus stream calib", 60), node.output()
            plan = [
                {"topic": t, "type": ty, "count": n, "rate": hz, "qos": pq, "size": size}
                for _, t, ty, _, pq, n, hz, size in SENSORS
            ]
            peer = ros.peer("pubs", "--plan", json.dumps(plan), "--linger-s", "2")
            published = (await asyncio.to_thread(peer.result, 120))["published"]
            got: dict[str, list[Any]] = {s: [] for s in streams}
            try:
                while True:
                    s = await sub.recv(timeout_s=5)
                    got[s.stream].append(s)
            except TimeoutError:
                pass
            got["_published"] = [published]
            return got

    got = asyncio.run(run())
    published = got.pop("_published")[0]
    for stream, topic, _, _, peer_qos, count, _, size in SENSORS:
        samples = got[stream]
        stamps = [s.stamp_ns for s in samples]
        assert set(stamps) <= set(published[topic]), f"{stream}: stamps not the messages' own"
        assert stamps == sorted(stamps), f"{stream}: out of order"
        assert all(s.header.frame_id.startswith(topic.strip("/").replace("/", "_")) for s in samples)
        if peer_qos == "reliable":
            assert len(samples) == count, f"{stream}: {len(samples)} of {count} reliable messages"
        else:
            assert len(samples) >= 0.9 * count, f"{stream}: {len(samples)} of {count}"
        if size >= MIB:
            assert all(len(s.payload) > size for s in samples)
    assert len(got["calib"]) == 1, "the latched message published before the node started"


FUSION = {
    "name": "fused",
    "bucket_width_ms": 100,
    "bucket_offset_ms": 50,
    "lateness_ms": 500,
    "streams": {
        "lidar/top": {"role": "reference", "expected_period_ms": 100},
        "camera/front": {"role": "required", "pick": "nearest", "max_skew_ms": 40},
        "gps": {"role": "optional", "pick": "hold_last", "max_age_ms": 500},
        "imu": {"role": "optional", "pick": "all", "window": "around"},
    },
}


def test_ros_sensors_fused_on_the_bus_come_back_to_ros_with_their_original_stamps(
    ros: RosEnv, tmp_path: Path
) -> None:
    """An rclpy driver → sensor_bridge → bus → a fusion worker → frame_bridge → rclpy
    subscribers: each fused member comes back on /fused/<stream> with its original stamp, and a
    DiagnosticArray per frame."""
    from fusion_workers import CLI

    port = free_port()
    ns = f"rclpyfuse{port}"
    cfg = robot_yaml(
        tmp_path / "robot.yaml",
        {
            "bus": f"zenoh://127.0.0.1:{port}",
            "namespace": ns,
            "streams": {
                "lidar/top": {"topic": "/lidar/points", "type": "sensor_msgs/msg/PointCloud2"},
                "camera/front": {
                    "topic": "/camera/image_raw/compressed",
                    "type": "sensor_msgs/msg/CompressedImage",
                },
                "gps": {"topic": "/gps/fix", "type": "sensor_msgs/msg/NavSatFix", "qos": "default"},
                "imu": {"topic": "/imu/data", "type": "sensor_msgs/msg/Imu", "qos": "default"},
            },
            "fusion": FUSION,
            "publish": {
                "frames": [
                    {"stream": "frames/fused", "namespace": "/fused", "diagnostics": "/fused/diagnostics"}
                ]
            },
        },
    )

    async def run() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], list[Any]]:
        async with open_bus(f"zenoh:?listen=tcp/127.0.0.1:{port}", namespace=ns) as bus:
            inputs = await bus.subscribe(("lidar/top", "camera/front", "gps", "imu"), options=LOSSLESS)
            fuse = ros.start(
                [*CLI, "fuse", "--config", str(cfg), "--bus", f"zenoh://127.0.0.1:{port}", "--ns", ns]
            )
            assert await asyncio.to_thread(fuse.wait_for, "fusing", 60), fuse.output()
            frames = ros.node("frame_bridge", cfg)
            sensors = ros.node("sensor_bridge", cfg)
            assert await asyncio.to_thread(sensors.wait_for, "-> bus stream imu", 60), sensors.output()
            lidar = ros.peer(
                "listen",
                "--topic",
                "/fused/lidar/top",
                "--type",
                "sensor_msgs/msg/PointCloud2",
                "--count",
                "25",
                "--timeout-s",
                "60",
            )
            imu = ros.peer(
                "listen",
                "--topic",
                "/fused/imu",
                "--type",
                "sensor_msgs/msg/Imu",
                "--count",
                "200",
                "--timeout-s",
                "60",
            )
            diag = ros.peer(
                "listen",
                "--topic",
                "/fused/diagnostics",
                "--type",
                "diagnostic_msgs/msg/DiagnosticArray",
                "--count",
                "25",
                "--timeout-s",
                "60",
            )
            for p in (lidar, imu, diag):
                assert await asyncio.to_thread(p.wait_for, "ready", 60), p.output()
            driver = ros.peer("sensors", "--duration-s", "4")
            await asyncio.to_thread(driver.result, 120)
            got = [await asyncio.to_thread(p.result, 90) for p in (lidar, imu, diag)]
            sent = []
            while (s := inputs.recv_nowait()) is not None:
                sent.append(s)
            assert frames.popen.poll() is None, frames.output()
            return got[0], got[1], got[2], sent

    lidar, imu, diag, sent = asyncio.run(run())
    sent_stamps = {s.stream: {x.stamp_ns for x in sent if x.stream == s.stream} for s in sent}
    assert lidar["received"] >= 25 and imu["received"] >= 200 and diag["received"] >= 25
    assert {m["stamp"] for m in lidar["messages"]} <= sent_stamps["lidar/top"], (
        "fused sweeps with their own stamps"
    )
    assert {m["stamp"] for m in imu["messages"]} <= sent_stamps["imu"]


@pytest.mark.parametrize("rclpy_server", [True])
def test_actions_go_both_ways_between_the_queue_and_rclpy(
    ros: RosEnv, tmp_path: Path, rclpy_server: bool
) -> None:
    """Queue actions of a routed kind run on an rclpy Fibonacci action server (feedback, result;
    an aborted goal is retried), ROS-side JSON submissions reach the queue, and an offered kind
    serves an rclpy action client (feedback and result)."""
    from fusion_workers import CLI

    port = free_port()
    ns = f"rclpyact{port}"
    db = tmp_path / "actions.db"
    cfg = robot_yaml(
        tmp_path / "robot.yaml",
        {
            "bus": f"zenoh://127.0.0.1:{port}",
            "namespace": ns,
            "actions": {
                "routes": {
                    "fib": {
                        "action": "/fibonacci",
                        "type": "example_interfaces/action/Fibonacci",
                        "timeout_s": 60,
                    }
                },
                "offer": {"count": {"action": "/count_up", "type": "example_interfaces/action/Fibonacci"}},
            },
        },
    )

    async def run() -> dict[str, Any]:
        from embodied_bus.actions import Executor, Planner

        async with open_bus(f"zenoh:?listen=tcp/127.0.0.1:{port}", namespace=ns) as bus:
            queue = ros.start(
                [*CLI, "queue", "--bus", f"zenoh://127.0.0.1:{port}", "--ns", ns, "--db", str(db)]
            )
            assert await asyncio.to_thread(queue.wait_for, "action queue serving", 60), queue.output()
            server = ros.peer(
                "fibonacci-server",
                "--action",
                "/fibonacci",
                "--abort-orders",
                "6",
                "--goals",
                "3",
                "--timeout-s",
                "90",
            )
            assert await asyncio.to_thread(server.wait_for, "ready", 60), server.output()
            bridge = ros.node("action_bridge", cfg)
            assert await asyncio.to_thread(bridge.wait_for, "-> queue 'count'", 60), bridge.output()
            # the offered kind, run by an executor of ours, for an rclpy action client
            stop = asyncio.Event()
            ex = Executor(bus, "counter")

            @ex.handler("count")
            async def count(action: Any, ctx: Any) -> Any:
                seq = [0, 1]
                for _ in range(action.payload["order"] - 1):
                    seq.append(seq[-1] + seq[-2])
                    ctx.feedback({"sequence": seq})
                    await asyncio.sleep(0.05)
                return {"sequence": seq}

            ex_task = asyncio.create_task(ex.run(stop))
            client = ros.peer(
                "fibonacci-client", "--action", "/count_up", "--order", "7", "--timeout-s", "60"
            )
            planner = Planner(bus)
            ok = await planner.submit("fib", {"order": 5})
            retried = await planner.submit("fib", {"order": 6})
            done = [await h.result(timeout_s=90) for h in (ok, retried)]
            offered = await asyncio.to_thread(client.result, 90)
            stop.set()
            await ex_task
            return {"done": done, "offered": offered, "server": await asyncio.to_thread(server.result, 90)}

    out = asyncio.run(run())
    ok, retried = out["done"]
    assert ok.status.name == "SUCCEEDED" and ok.result["sequence"] == [0, 1, 1, 2, 3, 5]
    assert retried.status.name == "SUCCEEDED" and len(retried.attempts) == 2  # aborted once, retried
    assert {"aborted": 6} in out["server"]["events"]
    assert out["offered"]["status"] == 4 and out["offered"]["sequence"] == [0, 1, 1, 2, 3, 5, 8, 13]
    assert out["offered"]["feedback"] >= 3


def test_nodes_show_their_parameters_to_the_ros2_tools_and_stop_cleanly_on_sigint(
    ros: RosEnv, tmp_path: Path
) -> None:
    """``ros2 node list``, ``ros2 param list/get`` on a namespaced node with ``use_sim_time``;
    SIGINT ends it with exit code 0."""
    port = free_port()
    cfg = robot_yaml(
        tmp_path / "robot.yaml",
        {
            "bus": f"zenoh:?listen=tcp/127.0.0.1:{port}",
            "namespace": "r1",
            "streams": {"gps": {"topic": "gps/fix", "type": "sensor_msgs/msg/NavSatFix", "qos": "default"}},
        },
    )
    node = ros.start(
        [
            str(ros.ros.python),
            *("-m", "embodied_bus.ros.nodes.sensor_bridge", "--ros-args"),
            *("-r", "__ns:=/robot1", "-p", f"config:={cfg}", "-p", "use_sim_time:=true"),
        ]
    )
    assert node.wait_for("-> bus stream gps", 60), node.output()
    nodes = ros.ros2("node", "list", "--no-daemon", "--spin-time", "3")
    assert "/robot1/sensor_bridge" in nodes.stdout.split(), nodes.stdout + nodes.stderr
    params = ros.ros2("param", "list", "/robot1/sensor_bridge", "--no-daemon")
    assert {"config", "bus", "bus_namespace", "use_sim_time"} <= set(params.stdout.split()), params.stdout
    got = ros.ros2("param", "get", "/robot1/sensor_bridge", "config", "--no-daemon")
    assert str(cfg) in got.stdout, got.stdout + got.stderr
    topics = ros.ros2("topic", "list", "--no-daemon", "--spin-time", "3")
    assert "/robot1/gps/fix" in topics.stdout.split(), topics.stdout  # a relative topic, namespaced
    assert node.interrupt() == 0, node.output()
