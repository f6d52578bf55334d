"""The rclpy nodes for real, over Fast DDS (Jazzy's default middleware), each as its own process,
against rclpy peers: sensor topics of every type with their QoS into the bus, fused frames back
out to ROS with their original stamps and diagnostics, actions both ways, parameters and clean
shutdown. Skipped, saying why, where no ROS 2 Python is there (``embodied_bus.testing.ros2``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from ros2_peers import RosEnv, robot_yaml, ros_env

from embodied_bus import Backpressure, SubscriptionOptions, open_bus
from embodied_bus.fusion import decode_frame
from embodied_bus.model import HeaderFlags
from embodied_bus.testing.ports import free_port

pytestmark = pytest.mark.flaky(reruns=1)  # several ROS processes and DDS discovery on two cores

LOSSLESS = SubscriptionOptions(capacity=10_000, backpressure=Backpressure.BLOCK)
MIB = 1 << 20


@pytest.fixture
def ros() -> Iterator[RosEnv]:
    yield from ros_env()


#: (stream, topic, type, QoS in the robot YAML, QoS of the peer, count, rate Hz, size B). The
#: reliable publishers keep all their history (a keep-last writer drops what a busy reader has
#: not yet taken, even for a plain rclpy subscriber), so any loss would be the bridge's.
RELIABLE = [
    ("lidar/top", "/lidar/points", "sensor_msgs/msg/PointCloud2", "default", "reliable-all", 20, 5, 8 * MIB),
    (
        "camera/front",
        "/camera/image_raw",
        "sensor_msgs/msg/Image",
        "default",
        "reliable-all",
        30,
        15,
        900_000,
    ),
    ("gps", "/gps/fix", "sensor_msgs/msg/NavSatFix", "default", "reliable-all", 50, 20, 0),
    ("imu", "/imu/data", "sensor_msgs/msg/Imu", "default", "reliable-all", 200, 100, 0),
]
#: Best effort (sensor-data QoS). Fast DDS with its default transports loses most best-effort
#: messages of 512 KiB and more even between two rclpy nodes (UDP fragments), so these are
#: smaller; what the bridge gets is compared with a plain rclpy subscriber in the same run.
BEST_EFFORT = [
    (
        "lidar/low",
        "/lidar_low/points",
        "sensor_msgs/msg/PointCloud2",
        "sensor_data",
        "sensor",
        50,
        10,
        200_000,
    ),
    (
        "camera/jpeg",
        "/camera/image_raw/compressed",
        "sensor_msgs/msg/CompressedImage",
        "sensor_data",
        "sensor",
        60,
        30,
        60_000,
    ),
    ("scan", "/scan", "sensor_msgs/msg/LaserScan", "sensor_data", "sensor", 40, 10, 4_000),
    ("imu/raw", "/imu/raw", "sensor_msgs/msg/Imu", "sensor_data", "sensor", 200, 100, 0),
]


async def samples_until_quiet(sub: Any, streams: Any, quiet_s: float) -> dict[str, list[Any]]:
    """The samples of ``sub`` by stream, until none came for ``quiet_s`` seconds."""
    got: dict[str, list[Any]] = {s: [] for s in streams}
    try:
        while True:
            s = await sub.recv(timeout_s=quiet_s)
            got[s.stream].append(s)
    except TimeoutError:
        return got


def bridge_sensors(
    ros: RosEnv, tmp_path: Path, sensors: list[Any], latched: bool
) -> tuple[dict[str, list[Any]], dict[str, Any], dict[str, Any]]:
    """``sensors`` published by an rclpy peer through ``sensor_bridge`` into the bus (and, with
    ``latched``, a transient-local CameraInfo published before the node started): the samples
    per stream, the stamps published per topic, and the stamps a plain rclpy subscriber got."""
    port = free_port()
    ns = f"rclpy{port}"
    streams = {s: {"topic": t, "type": ty, "qos": q} for s, t, ty, q, *_ in sensors}
    if latched:
        streams["calib"] = {
            "topic": "/camera/camera_info",
            "type": "sensor_msgs/msg/CameraInfo",
            "qos": {"reliability": "reliable", "durability": "transient_local", "depth": 1},
        }
        before = ros.peer(
            *("pub", "--topic", "/camera/camera_info", "--type", "sensor_msgs/msg/CameraInfo"),
            *("--count", "1", "--qos", "latched", "--subscribers", "0", "--linger-s", "60"),
        )
        assert before.wait_for("ready", 60), before.output()
    cfg = robot_yaml(
        tmp_path / "robot.yaml", {"bus": f"zenoh://127.0.0.1:{port}", "namespace": ns, "streams": streams}
    )

    async def run() -> tuple[dict[str, list[Any]], dict[str, Any], dict[str, Any]]:
        async with open_bus(f"zenoh:?listen=tcp/127.0.0.1:{port}", namespace=ns) as bus:
            sub = await bus.subscribe(tuple(streams), options=LOSSLESS)
            node = ros.node("sensor_bridge", cfg)
            last = sorted(streams)[-1] if not latched else "calib"
            assert await asyncio.to_thread(node.wait_for, f"-> bus stream {last}", 60), node.output()
            # the floor: a plain rclpy subscriber of the same topics, in the same run
            topics = [{"topic": t, "type": ty, "qos": pq, "count": n} for _, t, ty, _, pq, n, *_ in sensors]
            floor = ros.peer("listens", "--plan", json.dumps(topics), "--idle-s", "3", "--timeout-s", "40")
            assert await asyncio.to_thread(floor.wait_for, "ready", 60), floor.output()
            plan = [
                {"topic": t, "type": ty, "count": n, "rate": hz, "qos": pq, "size": size}
                for _, t, ty, _, pq, n, hz, size in sensors
            ]
            # published once the bridge and the plain subscriber both matched
            peer = ros.peer("pubs", "--plan", json.dumps(plan), "--subscribers", "2", "--linger-s", "2")
            published = (await asyncio.to_thread(peer.result, 120))["published"]
            got = await samples_until_quiet(sub, streams, quiet_s=3)
            return got, published, (await asyncio.to_thread(floor.result, 60))["received"]

    return asyncio.run(run())


def check_bridged(got: dict[str, list[Any]], published: dict[str, Any], sensors: list[Any]) -> None:
    """Every bridged sample is a published message, with its stamp and frame, in order."""
    for stream, topic, *_ in sensors:
        stamps = [s.stamp_ns for s in got[stream]]
        assert set(stamps) <= set(published[topic]), f"{stream}: stamps not the messages' own"
        assert stamps == sorted(stamps), f"{stream}: out of order"
        assert all(s.header.frame_id.startswith(topic.strip("/").replace("/", "_")) for s in got[stream])


def test_sensor_bridge_carries_reliable_sensors_of_up_to_8_mib_completely_and_a_latched_topic(
    ros: RosEnv, tmp_path: Path
) -> None:
    """PointCloud2 of 8 MiB, Image, NavSatFix and Imu, reliable: every message arrives, in
    order, with its header stamp and frame. A latched (transient-local) topic published before
    the node started reaches the bus too."""
    got, published, _ = bridge_sensors(ros, tmp_path, RELIABLE, latched=True)
    check_bridged(got, published, RELIABLE)
    for stream, _, _, _, _, count, _, size in RELIABLE:
        assert len(got[stream]) == count, f"{stream}: {len(got[stream])} of {count} reliable messages"
        assert all(len(s.payload) > size for s in got[stream])
    assert len(got["calib"]) == 1, "the latched message published before the node started"


def test_sensor_bridge_takes_best_effort_sensors_as_a_plain_rclpy_subscriber_does(
    ros: RosEnv, tmp_path: Path
) -> None:
    """A 200 KB PointCloud2, CompressedImage, LaserScan and Imu with sensor-data QoS: the bridge
    gets 90 % or more of what a plain rclpy subscriber of the same topics gets in the same run."""
    got, published, floor = bridge_sensors(ros, tmp_path, BEST_EFFORT, latched=False)
    check_bridged(got, published, BEST_EFFORT)
    for stream, topic, _, _, _, count, _, _ in BEST_EFFORT:
        assert len(floor[topic]) > 0 and len(got[stream]) >= 0.9 * len(floor[topic]), (
            f"{stream}: {len(got[stream])} of {count}, a plain rclpy subscriber {len(floor[topic])}"
        )


def test_sensor_bridge_discovers_published_topics_by_pattern_with_their_types(
    ros: RosEnv, tmp_path: Path
) -> None:
    """``discover:`` instead of ``streams:``: topics rclpy nodes publish after the node started
    are bridged when allowed and not denied, with the type and reliability the graph shows."""
    port = free_port()
    ns = f"disc{port}"
    doc = {"allow": ["^/disc/"], "deny": ["secret"], "stream_prefix": "ros/"}
    cfg = robot_yaml(
        tmp_path / "robot.yaml", {"bus": f"zenoh://127.0.0.1:{port}", "namespace": ns, "discover": doc}
    )

    async def run() -> tuple[dict[str, list[Any]], dict[str, Any], str]:
        async with open_bus(f"zenoh:?listen=tcp/127.0.0.1:{port}", namespace=ns) as bus:
            streams = ("ros/disc/fix", "ros/disc/imu", "ros/disc/secret")
            sub = await bus.subscribe(streams, options=LOSSLESS)
            node = ros.node("sensor_bridge", cfg)
            assert await asyncio.to_thread(node.wait_for, "ready: 0 configured topics", 60), node.output()
            secret = ros.peer(
                *("pub", "--topic", "/disc/secret", "--type", "sensor_msgs/msg/NavSatFix"),
                *("--count", "20", "--rate", "20", "--subscribers", "0"),
            )
            plan = [
                {"topic": "/disc/fix", "type": "sensor_msgs/msg/NavSatFix", "count": 40, "rate": 20},
                {
                    "topic": "/disc/imu",
                    "type": "sensor_msgs/msg/Imu",
                    "count": 40,
                    "rate": 50,
                    "qos": "sensor",
                },
            ]
            # published once the bridge has discovered both and subscribed
            peer = ros.peer("pubs", "--plan", json.dumps(plan), "--subscribers", "1", "--linger-s", "1")
            published = (await asyncio.to_thread(peer.result, 60))["published"]
            await asyncio.to_thread(secret.result, 60)
            got = await samples_until_quiet(sub, streams, quiet_s=2)
            return got, published, node.output()

    got, published, log = asyncio.run(run())
    assert [s.stamp_ns for s in got["ros/disc/fix"]] == published["/disc/fix"]  # reliable: all
    assert got["ros/disc/fix"][0].header.encoding == "cdr:sensor_msgs/msg/NavSatFix"
    assert len(got["ros/disc/imu"]) >= 30 and got["ros/disc/imu"][0].header.modality.name == "IMU"
    assert got["ros/disc/secret"] == [], "a denied topic was bridged"
    assert "/disc/fix (sensor_msgs/msg/NavSatFix) -> bus stream ros/disc/fix" in log


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

    async def run() -> tuple[list[Any], dict[str, list[int]]]:
        async with open_bus(f"zenoh:?listen=tcp/127.0.0.1:{port}", namespace=ns) as bus:
            frames_sub = await bus.subscribe("frames/fused", options=LOSSLESS)
            fuse = ros.start(
                [*CLI, "fuse", "--config", str(cfg), "--bus", f"zenoh://127.0.0.1:{port}", "--ns", ns]
            )
            assert await asyncio.to_thread(fuse.wait_for, "fusing", 60), fuse.output()
            back = ros.node("frame_bridge", cfg)
            sensors = ros.node("sensor_bridge", cfg)
            assert await asyncio.to_thread(sensors.wait_for, "-> bus stream imu", 60), sensors.output()
            topics = [
                {"topic": "/fused/lidar/top", "type": "sensor_msgs/msg/PointCloud2", "qos": "reliable-all"},
                {"topic": "/fused/imu", "type": "sensor_msgs/msg/Imu", "qos": "reliable-all"},
                {
                    "topic": "/fused/diagnostics",
                    "type": "diagnostic_msgs/msg/DiagnosticArray",
                    "qos": "reliable-all",
                },
            ]
            listeners = ros.peer(  # ready once the bridge's publishers are matched
                *("listens", "--plan", json.dumps(topics), "--count", "100000", "--publishers", "1"),
                *("--idle-s", "7", "--timeout-s", "30", "--match-timeout-s", "60"),
            )
            assert await asyncio.to_thread(listeners.wait_for, "ready", 60), listeners.output()
            driver = ros.peer("sensors", "--duration-s", "4")
            await asyncio.to_thread(driver.result, 120)
            frames = []
            try:  # the worker flushes what is pending once its input stops
                while True:
                    frames.append(decode_frame((await frames_sub.recv(timeout_s=3)).payload))
            except TimeoutError:
                pass
            got = (await asyncio.to_thread(listeners.result, 60))["received"]
            assert back.popen.poll() is None, back.output()
            return frames, got

    frames, got = asyncio.run(run())
    swept = [f for f in frames if f.member("lidar/top")]
    assert len(swept) >= 30, f"{len(swept)} frames with a sweep of 40"
    # every fused member comes back to ROS once, with its original stamp; one diagnostic per frame
    assert sorted(got["/fused/lidar/top"]) == sorted(f.member("lidar/top").stamp_ns for f in swept)
    assert sorted(got["/fused/imu"]) == sorted(m.stamp_ns for f in frames for m in f.members.get("imu", ()))
    assert len(got["/fused/diagnostics"]) == len(frames)


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
            try:
                done = [await h.result(timeout_s=90) for h in (ok, retried)]
            except TimeoutError:
                raise AssertionError(
                    f"{await planner.get(retried.id)}\nbridge:\n{bridge.output()[-3000:]}\n"
                    f"server:\n{server.output()[-2000:]}"
                ) from None
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
    """``ros2 node list``, ``ros2 param list/get`` and ``ros2 topic list`` on a namespaced node
    with ``use_sim_time`` (a message without a header stamp gets the sim time of /clock,
    flagged); SIGINT ends it with exit code 0."""
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
    with ThreadPoolExecutor(5) as pool:  # each ros2 command is a Python start and a discovery
        asked = [
            pool.submit(ros.ros2_until, *argv, want=want)
            for argv, want in [
                (("node", "list", "--spin-time", "2"), "/robot1/sensor_bridge"),
                (("param", "list", "/robot1/sensor_bridge"), "  use_sim_time"),
                (("param", "get", "/robot1/sensor_bridge", "config"), str(cfg)),
                (("param", "get", "/robot1/sensor_bridge", "use_sim_time"), "True"),
                (("topic", "list", "--spin-time", "2"), "/robot1/gps/fix"),
            ]
        ]
        nodes, params, config, sim_time, topics = (a.result() for a in asked)
    assert "/robot1/sensor_bridge" in nodes.splitlines(), nodes
    assert {"config", "bus", "bus_namespace", "use_sim_time"} <= set(params.split()), params
    assert str(cfg) in config, config
    assert "Boolean value is: True" in sim_time, sim_time
    assert "/robot1/gps/fix" in topics.splitlines(), topics  # a relative topic, namespaced

    async def zero_stamped() -> list[Any]:  # stamped with the node's clock: sim time from /clock
        async with open_bus(f"zenoh://127.0.0.1:{port}", namespace="r1") as bus:
            sub = await bus.subscribe("gps", options=LOSSLESS)
            clock = ros.peer("clock-pub", "--start-ns", "1000000000000", "--rate", "100", "--count", "3000")
            assert await asyncio.to_thread(clock.wait_for, "ready", 60), clock.output()
            fix = ros.peer(
                *("pub", "--topic", "/robot1/gps/fix", "--type", "sensor_msgs/msg/NavSatFix"),
                *("--count", "30", "--rate", "15", "--zero-stamp"),
            )
            got = []
            while len(got) < 30:  # once /clock reached the node, its stamps are sim time
                got.append(await sub.recv(timeout_s=20))
            await asyncio.to_thread(fix.result, 60)
            return got

    samples = asyncio.run(zero_stamped())
    assert all(s.header.flags & HeaderFlags.STAMP_FALLBACK for s in samples)  # no header stamp: flagged
    sim = [s.stamp_ns for s in samples if s.stamp_ns < 1_100_000_000_000]
    assert len(sim) >= 15 and samples[-1].stamp_ns in sim, [s.stamp_ns for s in samples]
    assert sim == sorted(sim) and all(s >= 1_000_000_000_000 for s in sim)  # the sim clock
    assert node.interrupt() == 0, node.output()
