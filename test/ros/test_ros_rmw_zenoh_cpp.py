"""The rclpy-free ``embodied-bus ros-bridge`` and ``replay --ros`` against the reference ROS 2
middleware on Zenoh: rclpy nodes on ``rmw_zenoh_cpp`` (preloaded, as a robot on rmw_zenoh runs
them), reached through ``rmw_zenohd``, through the router ``ros-bridge --host-router`` hosts, and
through ``embodied-bus router``. Sensor topics both ways with their QoS, latched topics, fused
members, the ``ros2`` tools seeing the bridge, ROS 2 actions both ways, and ``/clock`` for
``use_sim_time`` nodes. Skipped, saying why, where no ROS 2 Python is there."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fusion_workers import CLI
from ros2_peers import Proc, RosEnv, robot_yaml, ros2, ros_env
from test_ros2_replay import CLOUDS, SICK, assert_sim_time_followed_the_recording, recorded

from embodied_bus import open_bus
from embodied_bus.actions import Executor, Planner
from embodied_bus.ros.bridge_core import string_cdr
from embodied_bus.testing.ports import free_ports

pytestmark = pytest.mark.flaky(reruns=1)  # several ROS processes and Zenoh discovery on two cores

FIBONACCI = "example_interfaces/action/Fibonacci"
CANCELED, SUCCEEDED = 5, 4  # action_msgs/GoalStatus


def rmw_zenoh_env(port: int) -> Iterator[RosEnv]:
    """A :class:`RosEnv` whose rclpy nodes run on rmw_zenoh_cpp through the router on ``port``."""
    return ros_env(zenoh=f'connect/endpoints=["tcp/127.0.0.1:{port}"];listen/endpoints=["tcp/127.0.0.1:0"]')


@contextmanager
def rmw_zenohd(ros: RosEnv, port: int) -> Iterator[Proc]:
    """The reference router, ``rmw_zenohd``, listening on ``port``."""
    prefix = ros.ros.prefix
    env = {
        **os.environ,
        "AMENT_PREFIX_PATH": str(prefix),
        "LD_LIBRARY_PATH": str(prefix / "lib"),
        "ZENOH_CONFIG_OVERRIDE": f'listen/endpoints=["tcp/127.0.0.1:{port}"]',
    }
    router = ros.start([str(prefix / "lib" / "rmw_zenoh_cpp" / "rmw_zenohd")], env=env)
    try:
        assert router.wait_for("Started Zenoh router", 30), router.output()
        yield router
    finally:
        router.interrupt()


def bus_router(ros: RosEnv, port: int) -> Proc:
    """``embodied-bus router`` on ``port``."""
    router = ros.start([*CLI, "router", "--listen", f"tcp/127.0.0.1:{port}"], env=dict(os.environ))
    assert router.wait_for("zenoh router listening", 30), router.output()
    return router


def bridge(ros: RosEnv, cfg: Path, *argv: str) -> Proc:
    """``embodied-bus ros-bridge`` in the test's Python (no rclpy), finding the ROS install's
    interface definitions (``example_interfaces``) through ``AMENT_PREFIX_PATH`` as a shell that
    sourced it would."""
    env = {**os.environ, "AMENT_PREFIX_PATH": str(ros.ros.prefix)}
    proc = ros.start([*CLI, "ros-bridge", "--config", str(cfg), *argv], env=env)
    assert proc.wait_for("ros-bridge: node", 60), proc.output()
    return proc


# -- sensors, latched topics, fused members and the ros2 tools, through rmw_zenohd ------------------

SENSORS = [
    {"topic": "/lidar/points", "type": "sensor_msgs/msg/PointCloud2", "count": 50, "rate": 10.03,
     "qos": "sensor", "size": 64_000, "jitter_ms": 2.0},
    {"topic": "/gps/fix", "type": "sensor_msgs/msg/NavSatFix", "count": 50, "rate": 10.0,
     "qos": "reliable-all"},
]  # fmt: skip


def sensor_robot(path: Path, domain: int, port: int) -> Path:
    reliable_latched = {"reliability": "reliable", "durability": "transient_local", "depth": 1}
    keep_all = {"reliability": "reliable", "history": "keep_all"}  # lossless on rmw_zenoh (BLOCK)
    return robot_yaml(
        path,
        {
            "bus": f"zenoh://127.0.0.1:{port}",
            "namespace": f"rz{port}",
            "ros": {"domain_id": domain, "node_name": "eb_bridge", "connect": [f"tcp/127.0.0.1:{port}"]},
            "streams": {
                "lidar/top": {"topic": "/lidar/points", "type": "sensor_msgs/msg/PointCloud2"},
                "gps": {"topic": "/gps/fix", "type": "sensor_msgs/msg/NavSatFix", "qos": keep_all},
                "camera_info": {
                    "topic": "/camera/camera_info",
                    "type": "sensor_msgs/msg/CameraInfo",
                    "qos": reliable_latched,
                },
            },
            "fusion": {
                "name": "fused",
                "bucket_width_ms": 100,
                "bucket_offset_ms": 50,
                "lateness_ms": 300,
                "streams": {
                    "lidar/top": {"role": "reference", "expected_period_ms": 100},
                    "gps": {"role": "optional", "pick": "hold_last", "max_age_ms": 500},
                },
            },
            "publish": {
                "frames": [{"stream": "frames/fused", "namespace": "/fused"}],
                "streams": [
                    {"stream": "lidar/top", "topic": "/bus/lidar", "type": "sensor_msgs/msg/PointCloud2"},
                    {
                        "stream": "gps",
                        "topic": "/bus/gps",
                        "type": "sensor_msgs/msg/NavSatFix",
                        "qos": keep_all,
                    },
                    {
                        "stream": "map_meta",
                        "topic": "/bus/map",
                        "type": "std_msgs/msg/String",
                        "qos": reliable_latched,
                    },
                ],
            },
        },
    )


@pytest.fixture
def zenohd_ros() -> Iterator[tuple[RosEnv, int]]:
    ros2()
    (port,) = free_ports(1)
    gen = rmw_zenoh_env(port)
    ros = next(gen)
    try:
        with rmw_zenohd(ros, port):
            yield ros, port
    finally:
        gen.close()


def test_rclpy_on_rmw_zenoh_cpp_and_the_bridge_exchange_sensors_latched_topics_and_fused_frames(
    zenohd_ros: tuple[RosEnv, int], tmp_path: Path
) -> None:
    """Through ``rmw_zenohd``: a lidar (sensor QoS, 10.03 Hz, jittered stamps) and a GPS (reliable)
    from rclpy reach the bus in order and go back out to rclpy subscribers with their QoS; a
    CameraInfo latched before the bridge started reaches the bus; a latched bus stream reaches
    an rclpy subscriber that joins late; fused sweeps come back; the ``ros2`` tools show the
    bridge's node, topics, endpoints and QoS, and echo its latched topic."""
    ros, port = zenohd_ros
    cfg = sensor_robot(tmp_path / "robot.yaml", ros.domain, port)
    ns = f"rz{port}"
    latched_info = ros.peer(
        *("pub", "--topic", "/camera/camera_info", "--type", "sensor_msgs/msg/CameraInfo"),
        *("--count", "1", "--qos", "latched", "--subscribers", "0", "--linger-s", "120"),
    )
    assert latched_info.wait_for("ready", 60), latched_info.output()

    async def run() -> dict[str, Any]:
        async with open_bus(f"zenoh://127.0.0.1:{port}", namespace=ns) as bus:
            subs = {s: await bus.subscribe(s) for s in ("lidar/top", "gps", "camera_info")}
            proc = bridge(ros, cfg, "--fuse", "--domain-id", str(ros.domain))
            plan = [
                {"topic": "/bus/lidar", "type": "sensor_msgs/msg/PointCloud2", "qos": "sensor", "count": 50},
                {"topic": "/bus/gps", "type": "sensor_msgs/msg/NavSatFix", "qos": "reliable-all",
                 "count": 50},
                {"topic": "/fused/lidar/top", "type": "sensor_msgs/msg/PointCloud2", "qos": "reliable-all",
                 "count": 45},
            ]  # fmt: skip
            listener = ros.peer("listens", "--plan", json.dumps(plan), "--timeout-s", "40")
            assert await asyncio.to_thread(listener.wait_for, "ready", 60), listener.output()
            driver = ros.peer("pubs", "--plan", json.dumps(SENSORS), "--subscribers", "1")
            got: dict[str, list[int]] = {s: [] for s in subs}

            async def drain(stream: str) -> None:
                async for sample in subs[stream]:
                    got[stream].append(sample.header.stamp_ns)

            drains = [asyncio.create_task(drain(s)) for s in subs]
            sent = await asyncio.to_thread(driver.result, 90)
            # a latched bus stream, then an rclpy subscriber that joins after it was published
            meta = await bus.publisher("map_meta", encoding="cdr:std_msgs/msg/String")
            assert await meta.wait_for_subscribers(10)
            await meta.publish(string_cdr("map v7"), stamp_ns=1)
            heard = await asyncio.to_thread(listener.result, 60)
            late = ros.peer(
                *("listen", "--topic", "/bus/map", "--type", "std_msgs/msg/String", "--qos", "latched"),
                *("--count", "1", "--timeout-s", "20"),
            )
            tools = await asyncio.to_thread(ros2_tools, ros)
            late_heard = await asyncio.to_thread(late.result, 60)
            for t in drains:
                t.cancel()
            return {
                "sent": sent,
                "bus": got,
                "heard": heard,
                "late": late_heard,
                "tools": tools,
                "bridge": proc,
            }

    out = asyncio.run(run())
    lidar_sent, gps_sent = (out["sent"]["published"][t] for t in ("/lidar/points", "/gps/fix"))
    bus, heard = out["bus"], out["heard"]["received"]
    assert bus["gps"] == gps_sent  # reliable: every fix, in order, with its stamp
    assert len(bus["lidar/top"]) >= 45 and bus["lidar/top"] == sorted(bus["lidar/top"])
    assert set(bus["lidar/top"]) <= set(lidar_sent)
    assert len(bus["camera_info"]) == 1  # latched before the bridge existed
    assert heard["/bus/gps"] == gps_sent
    assert len(heard["/bus/lidar"]) >= 45 and set(heard["/bus/lidar"]) <= set(lidar_sent)
    assert len(heard["/fused/lidar/top"]) >= 45 and set(heard["/fused/lidar/top"]) <= set(lidar_sent)
    assert out["late"]["received"] == 1
    tools = out["tools"]
    assert "/eb_bridge" in tools["nodes"].split(), tools["nodes"]
    for topic in ("/bus/gps", "/bus/map", "/fused/lidar/top", "/lidar/points", "/camera/camera_info"):
        assert topic in tools["topics"].split(), tools["topics"]
    info = tools["info"]
    assert "Node name: eb_bridge" in info and "Endpoint type: PUBLISHER" in info, info
    assert "Reliability: RELIABLE" in info and "Durability: TRANSIENT_LOCAL" in info, info
    sub = tools["info_sub"]  # the bridge's subscription of the GPS, with its keep-all QoS
    assert "Node name: eb_bridge" in sub and "Endpoint type: SUBSCRIPTION" in sub, sub
    assert "History (Depth): KEEP_ALL" in sub or "KEEP_ALL" in sub, sub
    assert "data: map v7" in tools["echo"], tools["echo"]
    assert out["bridge"].interrupt(30) == 0, out["bridge"].output()[-3000:]


def ros2_tools(ros: RosEnv) -> dict[str, str]:
    """What ``ros2 node list``, ``topic list``, ``topic info -v`` (the bridge's latched publisher
    and its GPS subscription) and ``topic echo --once /bus/map`` print on rmw_zenoh_cpp."""
    echo = ros.ros2(
        *("topic", "echo", "--once", "--no-daemon", "/bus/map", "std_msgs/msg/String"),
        *("--qos-reliability", "reliable", "--qos-durability", "transient_local"),
        timeout_s=60,
    )
    return {
        "nodes": ros.ros2_until("node", "list", "--spin-time", "2", want="/eb_bridge"),
        "topics": ros.ros2_until("topic", "list", "--spin-time", "2", want="/bus/map"),
        "info": ros.ros2_until("topic", "info", "-v", "/bus/map", "--spin-time", "2", want="eb_bridge"),
        "info_sub": ros.ros2_until(
            "topic", "info", "-v", "/gps/fix", "--spin-time", "2", want="SUBSCRIPTION"
        ),
        "echo": echo.stdout + echo.stderr,
    }


# -- actions both ways, through the router ros-bridge --host-router hosts --------------------------


def count_up(order: int, step_s: float) -> Any:
    """An executor handler of the offered kind: Fibonacci to ``order``, one step per ``step_s``
    with feedback, stopping (canceled) when the queue cancels it."""

    async def handler(action: Any, ctx: Any) -> Any:
        seq = [0, 1]
        for _ in range(action.payload["order"] - 1):
            if ctx.cancelled.is_set():
                return None
            seq.append(seq[-1] + seq[-2])
            ctx.feedback({"sequence": seq})
            await asyncio.sleep(step_s)
        return {"sequence": seq}

    return handler


def test_actions_run_both_ways_between_the_queue_and_rclpy_on_rmw_zenoh_cpp_for_longer_than_10_s(
    tmp_path: Path,
) -> None:
    """``ros-bridge --actions --host-router``: a queue action runs on an rclpy Fibonacci server on
    rmw_zenoh_cpp for 11.7 s with feedback and its result; an rclpy action client gets an offered
    kind served by a queue executor over 11 s with feedback and result; another client cancels."""
    ros2()
    ros_port, bus_port = free_ports(2)
    gen = rmw_zenoh_env(ros_port)
    ros = next(gen)
    try:
        out = asyncio.run(run_actions(ros, tmp_path, ros_port, bus_port))
    finally:
        gen.close()
    done = out["routed"]
    assert done.status.name == "SUCCEEDED", done
    assert done.result["sequence"] == [0, 1, 1, 2, 3, 5, 8, 13, 21, 34, 55]
    assert out["server"]["events"][-1] == {"succeeded": 10, "sequence": done.result["sequence"]}
    assert len(out["routed_feedback"]) >= 8  # one per step, not only the last
    long = out["offered"]
    assert long["status"] == SUCCEEDED and long["sequence"][-1] == 89 and long["elapsed_s"] > 10, long
    assert long["feedback"] >= 8, long
    assert out["canceled"]["status"] == CANCELED, out["canceled"]


async def run_actions(ros: RosEnv, tmp_path: Path, ros_port: int, bus_port: int) -> dict[str, Any]:
    ns = f"rzact{bus_port}"
    bus_url = f"zenoh://127.0.0.1:{bus_port}"
    cfg = robot_yaml(
        tmp_path / "robot.yaml",
        {
            "bus": bus_url,
            "namespace": ns,
            "ros": {"domain_id": ros.domain, "node_name": "eb_actions"},
            "actions": {
                "routes": {"fib": {"action": "/fibonacci", "type": FIBONACCI, "timeout_s": 60}},
                "offer": {"count": {"action": "/count_up", "type": FIBONACCI}},
            },
        },
    )
    bus_router(ros, bus_port)
    queue = ros.start([*CLI, "queue", "--bus", bus_url, "--ns", ns, "--db", str(tmp_path / "q.db")],
                      env=dict(os.environ))  # fmt: skip
    assert await asyncio.to_thread(queue.wait_for, "action queue serving", 60), queue.output()
    proc = bridge(ros, cfg, "--actions", "--host-router", f"tcp/127.0.0.1:{ros_port}")
    server = ros.peer("fibonacci-server", "--action", "/fibonacci", "--step-s", "1.3", "--timeout-s", "90")
    assert await asyncio.to_thread(server.wait_for, "ready", 60), server.output()
    async with open_bus(bus_url, namespace=ns) as bus:
        stop = asyncio.Event()
        ex = Executor(bus, "counter", concurrency=2)
        ex.handler("count")(count_up(11, 1.1))
        ex_task = asyncio.create_task(ex.run(stop))
        client = ros.peer("fibonacci-client", "--action", "/count_up", "--order", "11", "--timeout-s", "60")
        canceled = ros.peer(
            *("fibonacci-client", "--action", "/count_up", "--order", "30"),
            *("--cancel-after-s", "2", "--timeout-s", "60"),
        )
        planner = Planner(bus)
        handle = await planner.submit("fib", {"order": 10})
        feedback: list[Any] = []
        watching = asyncio.create_task(_collect_feedback(handle, feedback))
        try:
            routed = await handle.result(timeout_s=90)
        except TimeoutError:
            raise AssertionError(
                f"{await planner.get(handle.id)}\nbridge:\n{proc.output()[-3000:]}"
            ) from None
        watching.cancel()
        offered = await asyncio.to_thread(client.result, 90)
        cancel = await asyncio.to_thread(canceled.result, 90)
        stop.set()
        await ex_task
    assert proc.interrupt(30) == 0, proc.output()[-3000:]
    return {
        "routed": routed,
        "routed_feedback": feedback,
        "server": await asyncio.to_thread(server.result, 60),
        "offered": offered,
        "canceled": cancel,
    }


async def _collect_feedback(handle: Any, into: list[Any]) -> None:
    async for fb in handle.feedback():
        into.append(fb)


# -- replay --ros --clock, through embodied-bus router ----------------------------------------------


def test_replay_speaks_rmw_zenoh_to_rclpy_on_use_sim_time_through_the_bus_router() -> None:
    """``replay --ros --clock`` in a Python without rclpy (the rmw_zenoh protocol) through
    ``embodied-bus router``, given only the ``ROS_DOMAIN_ID`` and ``ZENOH_CONFIG_OVERRIDE`` the
    rclpy nodes get: an rclpy node on rmw_zenoh_cpp and ``use_sim_time`` gets every message in
    order with its recorded stamp, and its clock follows the recording's."""
    ros2()
    (port,) = free_ports(1)
    gen = rmw_zenoh_env(port)
    ros = next(gen)
    try:
        bus_router(ros, port)
        stamps, log_times = recorded()
        plan = [
            {
                "topic": t,
                "type": "sensor_msgs/msg/PointCloud2",
                "qos": "reliable-all",
                "count": len(stamps[t]),
            }
            for t in CLOUDS
        ]
        listener = ros.peer("listens", "--plan", json.dumps(plan), "--timeout-s", "60", "--use-sim-time")
        assert listener.wait_for("ready", 60), listener.output()
        player = ros.start(
            [
                *CLI, "replay", str(SICK), "--topics", *CLOUDS, "--ros", "--clock", "50",
                "--wait-subscribers", "30", "--json",
            ],
            # the domain and the router from what every ROS process of the robot is given
            env={**os.environ, **{k: ros.env[k] for k in ("ROS_DOMAIN_ID", "ZENOH_CONFIG_OVERRIDE")}},
        )  # fmt: skip
        summary = player.result(90)
        assert player.popen.returncode == 0, player.output()[-3000:]
        assert f"on ROS domain {ros.domain} (rmw_zenoh)" in player.output()
        heard = listener.result(60)
    finally:
        gen.close()
    assert {t: summary["messages"][t] for t in CLOUDS} == {t: len(stamps[t]) for t in CLOUDS}
    for t in CLOUDS:  # every message, in order, with its recorded stamp
        assert heard["received"][t] == stamps[t], t
    assert_sim_time_followed_the_recording(heard["node_clock_ns"], log_times)
