"""``ros2 launch`` for real: the package built with colcon into a workspace (the ament index finds
it), ``ros2 launch embodied_bus robot.launch.py`` starting every process, data from an rclpy
driver fused and back to an rclpy subscriber, the ``ros2`` tools seeing the nodes and topics,
and Ctrl-C stopping everything with exit code 0. rclpy nodes over Fast DDS, and
``rclpy:=false`` (``embodied-bus ros-bridge``) with rclpy on rmw_zenoh_cpp. Skipped, saying why,
where no ROS 2 Python is there."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ros2_peers import ROOT, RosEnv, robot_yaml, ros_env

from embodied_bus.testing.ports import free_port

pytestmark = pytest.mark.flaky(reruns=1)  # a launch of six processes and DDS discovery on two cores

FUSION = {
    "name": "fused",
    "bucket_width_ms": 100,
    "bucket_offset_ms": 50,
    "lateness_ms": 500,
    "streams": {
        "lidar/top": {"role": "reference", "expected_period_ms": 100},
        "camera/front": {"role": "required", "pick": "nearest", "max_skew_ms": 40},
        "imu": {"role": "optional", "pick": "all", "window": "around"},
    },
}


def workspace(ros: RosEnv, tmp_path: Path) -> dict[str, str]:
    """Build the package with colcon into a workspace under ``tmp_path``; the environment of a
    shell that sourced its ``install/setup.bash`` on top of ``ros``'s."""
    ws = tmp_path / "ws"
    ws.mkdir()
    out = subprocess.run(
        [
            *(str(ros.ros.bin / "colcon"), "build", "--base-paths", str(ROOT)),
            *("--build-base", str(ws / "build"), "--install-base", str(ws / "install")),
            *("--packages-select", "embodied_bus"),
        ],
        cwd=ws,
        env={**ros.env, "PATH": f"{ros.ros.bin}{os.pathsep}{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    prefix = ws / "install" / "embodied_bus"
    site = next(prefix.glob("lib/python3*/site-packages"))
    env = dict(ros.env)
    env["AMENT_PREFIX_PATH"] = os.pathsep.join([str(prefix), env.get("AMENT_PREFIX_PATH", "")])
    env["PYTHONPATH"] = str(site)  # the installed package, as setup.bash puts it first
    env["PATH"] = f"{ros.ros.bin}{os.pathsep}{os.environ['PATH']}"
    return env


def fused_sweeps_listener(ros: RosEnv) -> Any:
    """An rclpy peer counting the fused sweeps the launch publishes (up to 20, 40 s)."""
    plan = [
        {"topic": "/robot1/fused/lidar/top", "type": "sensor_msgs/msg/PointCloud2", "qos": "reliable-all"}
    ]
    return ros.peer("listens", "--plan", json.dumps(plan), "--count", "20", "--timeout-s", "40")


@pytest.fixture
def ros() -> Iterator[RosEnv]:
    yield from ros_env()


def robot(tmp_path: Path, router_port: int) -> Path:
    return robot_yaml(
        tmp_path / "robot.yaml",
        {
            "bus": f"zenoh://127.0.0.1:{router_port}",
            "namespace": "robot1",
            "streams": {  # relative: under the launch's namespace
                "lidar/top": {"topic": "lidar/points", "type": "sensor_msgs/msg/PointCloud2"},
                "camera/front": {
                    "topic": "camera/image_raw/compressed",
                    "type": "sensor_msgs/msg/CompressedImage",
                },
                "imu": {"topic": "imu/data", "type": "sensor_msgs/msg/Imu", "qos": "default"},
            },
            "fusion": FUSION,
            "publish": {"frames": [{"stream": "frames/fused", "namespace": "fused"}]},
        },
    )


def test_ros2_launch_of_the_built_package_carries_rclpy_data_through_fusion_and_stops_cleanly(
    ros: RosEnv, tmp_path: Path
) -> None:
    """``ros2 launch embodied_bus robot.launch.py`` (rclpy nodes over Fast DDS, the robot's
    Zenoh router started by the launch): an rclpy driver's sweeps come back fused on
    /robot1/fused/lidar/top; ``ros2 node list``, ``topic list`` and ``topic echo --once`` show
    the bridge; SIGINT ends the launch and every process with exit code 0."""
    env = workspace(ros, tmp_path)
    port = free_port()
    cfg = robot(tmp_path, port)
    ros.env = env
    launch = ros.start(
        [
            *(str(ros.ros.bin / "ros2"), "launch", "embodied_bus", "robot.launch.py"),
            *(f"config:={cfg}", "namespace:=robot1", "router:=true", f"router_listen:=tcp/127.0.0.1:{port}"),
            f"queue_db:={tmp_path / 'actions.db'}",
        ],
        cwd=tmp_path,
    )
    assert launch.wait_for("-> bus stream imu", 90), launch.output()[-4000:]
    assert launch.wait_for("fusing", 90), launch.output()[-4000:]
    listener = fused_sweeps_listener(ros)
    assert listener.wait_for("ready", 60), listener.output()
    echo = ros.start(
        [
            *(str(ros.ros.bin / "ros2"), "topic", "echo", "--once", "--no-daemon"),
            *("/robot1/fused/imu", "sensor_msgs/msg/Imu", "--field", "header.frame_id"),
        ]
    )
    driver = ros.peer("sensors", "--duration-s", "6", "--namespace", "/robot1")
    bridges = ("/robot1/sensor_bridge", "/robot1/frame_bridge", "/robot1/action_bridge")
    nodes = ros.ros2_until("node", "list", "--spin-time", "2", want=bridges)
    topics = ros.ros2_until("topic", "list", "--spin-time", "2", want="/robot1/fused/lidar/top")
    sent = driver.result(120)
    echo.popen.wait(timeout=60)
    got: Any = listener.result(90)["received"]["/robot1/fused/lidar/top"]
    assert sent["published"]["lidar/points"] >= 35
    assert len(got) >= 20, f"{len(got)} fused sweeps back in ROS"
    assert set(bridges) <= set(nodes.split()), nodes
    assert {"/robot1/lidar/points", "/robot1/fused/lidar/top"} <= set(topics.split()), topics
    assert echo.popen.returncode == 0 and "imu" in echo.output(), echo.output()  # the member's frame id
    code = launch.interrupt(60)
    out = launch.output()
    assert code == 0, out[-4000:]
    started = out.count("process started with pid")
    assert started >= 6 and out.count("process has finished cleanly") == started, out[-4000:]


def test_ros2_launch_with_rclpy_false_bridges_rclpy_nodes_on_rmw_zenoh_cpp(tmp_path: Path) -> None:
    """``rclpy:=false``: the launch starts ``embodied-bus ros-bridge`` (rmw_zenoh protocol, no
    rclpy) and the robot's router; rclpy nodes on the reference rmw_zenoh_cpp reach it through
    that router: a driver's sweeps come back fused, and ``ros2 node list`` (on rmw_zenoh) shows
    the bridge."""
    port = free_port()
    zenoh = f'connect/endpoints=["tcp/127.0.0.1:{port}"];listen/endpoints=["tcp/127.0.0.1:0"]'
    gen = ros_env(zenoh=zenoh)
    ros = next(gen)
    try:
        env = workspace(ros, tmp_path)
        cfg = robot(tmp_path, port)
        doc: dict[str, Any] = __import__("yaml").safe_load(cfg.read_text())
        doc["ros"] = {"domain_id": ros.domain, "node_name": "embodied_bus_bridge"}
        cfg.write_text(__import__("yaml").safe_dump(doc))
        launch_env = {k: v for k, v in env.items() if k not in ("LD_PRELOAD", "RMW_IMPLEMENTATION")}
        proc = ros.start(
            [
                *(str(ros.ros.bin / "ros2"), "launch", "embodied_bus", "robot.launch.py"),
                *(
                    f"config:={cfg}",
                    "namespace:=robot1",
                    "router:=true",
                    f"router_listen:=tcp/127.0.0.1:{port}",
                ),
                *("rclpy:=false", f"queue_db:={tmp_path / 'actions.db'}"),
            ],
            cwd=tmp_path,
            env=launch_env,  # the launch itself runs no rclpy node
        )
        assert proc.wait_for("ros-bridge: node", 90), proc.output()[-4000:]
        listener = fused_sweeps_listener(ros)
        assert listener.wait_for("ready", 60), listener.output()
        driver = ros.peer("sensors", "--duration-s", "6", "--namespace", "/robot1")
        nodes = ros.ros2_until("node", "list", "--spin-time", "2", want="embodied_bus_bridge")
        sent = driver.result(120)
        got = listener.result(90)["received"]["/robot1/fused/lidar/top"]
        assert sent["published"]["lidar/points"] >= 50
        assert len(got) >= 20, f"{len(got)} fused sweeps back over rmw_zenoh_cpp\n{proc.output()[-5000:]}"
        assert "/robot1/embodied_bus_bridge" in nodes.split(), nodes
        assert proc.interrupt(60) == 0, proc.output()[-4000:]
    finally:
        gen.close()
