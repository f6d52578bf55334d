"""ROS 2 nodes and launch files: what can be checked without ROS runs everywhere; the rclpy node
tests run where rclpy exists and skip cleanly where it does not (this project's CI)."""

from __future__ import annotations

import importlib
import inspect
import json
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from package_setup import setup_kwargs

from embodied_bus.cli.launch_nodes import fusion_worker as fusion_worker_main
from embodied_bus.cli.launch_nodes import resolve_bus, strip_ros_args
from embodied_bus.errors import BusConfigError
from embodied_bus.fusion.frame import Member, MultiModalFrame
from embodied_bus.model.header import Header, HeaderFlags, Modality
from embodied_bus.model.sample import Sample
from embodied_bus.ros.bridge_core import (
    GoalOutcome,
    frame_diagnostics_cdr,
    frame_messages,
    frame_topics,
    goal_outcome,
    outcome_json,
    parse_submission,
)
from embodied_bus.ros.config import FrameRoute, load_robot_config
from embodied_bus.ros.launching import LAUNCH_FILES, LaunchArgs
from embodied_bus.rosmsg.conversions import array_to_pointcloud2_cdr
from embodied_bus.testing.ports import free_port

from rmw_node import STORE

ROOT = Path(__file__).resolve().parents[2]
NODES = ["sensor_bridge", "frame_bridge", "action_bridge"]
PROCESSES = ["fusion_worker", "queue_service"]
try:
    import rclpy  # noqa: F401

    HAVE_RCLPY = True
except ImportError:
    HAVE_RCLPY = False
needs_rclpy = pytest.mark.skipif(not HAVE_RCLPY, reason="rclpy is not installed (no ROS 2 on this machine)")


def _scripts() -> dict[str, str]:
    return {
        s.split("=")[0].strip(): s.split("=")[1].strip()
        for s in setup_kwargs()["entry_points"]["console_scripts"]  # type: ignore[index]
    }


@pytest.mark.parametrize("name", NODES + PROCESSES)
def test_every_node_is_a_console_script_with_main_args_none(name: str) -> None:
    target = _scripts()[name]
    module, func = target.split(":")
    if name in NODES:
        assert module == f"embodied_bus.ros.nodes.{name}" and func == "main"
    else:  # processes that run a command of the command line
        assert module == "embodied_bus.cli.launch_nodes" and func == name
    main = getattr(importlib.import_module(module), func)
    assert list(inspect.signature(main).parameters) == ["args"]
    assert inspect.signature(main).parameters["args"].default is None


@pytest.mark.skipif(HAVE_RCLPY, reason="checks the message shown where rclpy is absent")
@pytest.mark.parametrize("name", NODES)
def test_rclpy_nodes_exit_with_a_clear_message_where_rclpy_is_absent(name: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", f"embodied_bus.ros.nodes.{name}"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "rclpy is not available" in proc.stderr and "embodied-bus ros-bridge" in proc.stderr


@pytest.mark.parametrize("name", sorted(LAUNCH_FILES))
def test_launch_files_take_config_bus_and_namespace_arguments(name: str) -> None:
    declared = {a.name for a in LAUNCH_FILES[name].arguments}
    assert {"config", "bus", "namespace", "router"} <= declared
    assert declared <= set(LaunchArgs.__dataclass_fields__)


def test_every_process_of_every_launch_file_runs_a_module_of_the_package() -> None:
    modules = set()
    for launch_file in LAUNCH_FILES.values():
        for rclpy in (True, False):
            args = LaunchArgs(config=str(ROOT / "config" / "robot.yaml"), rclpy=rclpy, router=True)
            for spec in launch_file.processes(args):
                assert spec.command[:2] == (sys.executable, "-m"), spec
                modules.add(spec.command[2])
    assert modules == {"embodied_bus.cli.main", *(f"embodied_bus.ros.nodes.{n}" for n in NODES)}
    for module in modules:
        importlib.import_module(module)


def test_a_built_wheel_installs_launch_and_config_files_under_share(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            ".",
        ],
        cwd=ROOT,
        check=True,
        timeout=240,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("embodied_bus-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    share = [n.split(".data/data/", 1)[1] for n in names if ".data/data/share/" in n]
    for f in ("bridge", "fusion", "executors", "robot", "demo"):
        assert f"share/embodied_bus/launch/{f}.launch.py" in share
    for f in ("robot.yaml", "fusion.yaml"):
        assert f"share/embodied_bus/config/{f}" in share
    assert "share/ament_index/resource_index/packages/embodied_bus" in share
    assert "share/embodied_bus/package.xml" in share
    assert "embodied_bus/py.typed" in names
    assert "embodied_bus/ros/nodes/sensor_bridge.py" in names


def test_launch_ros_arguments_are_stripped_and_empty_bus_options_fall_back_to_the_config() -> None:
    argv = ["--config", "c.yaml", "--ros-args", "-r", "__node:=fw", "-p", "x:=1", "--", "--json"]
    assert strip_ros_args(argv) == ["--config", "c.yaml", "--json"]
    _, opts = resolve_bus(
        "t",
        ["--config", str(ROOT / "config" / "robot.yaml"), "--bus", "", "--ns", "", "--json"],
        config_required=True,
    )
    assert opts == ["--bus", "zenoh://localhost:7447", "--ns", "robot1", "--json"]
    with pytest.raises(BusConfigError, match="no other process can reach"):
        resolve_bus(
            "fusion_worker",
            ["--config", str(ROOT / "config" / "robot.yaml"), "--bus", "zenoh:"],
            config_required=True,
        )


def test_the_fusion_worker_process_runs_the_robot_configs_spec(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    rc = fusion_worker_main(
        [
            "--config",
            str(ROOT / "config" / "robot.yaml"),
            "--bus",
            f"zenoh:?listen=tcp/127.0.0.1:{port}",
            "--ns",
            "fw",
            "--duration",
            "0.2",
            "--json",
            "--ros-args",
            "-r",
            "__node:=fusion_worker",
        ]
    )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["frames"] == 0


def _frame() -> MultiModalFrame:
    pts = np.zeros(3, dtype=[("x", "<f4"), ("y", "<f4"), ("z", "<f4")])
    cdr = array_to_pointcloud2_cdr(pts, frame_id="lidar", stamp_ns=1_000_000_000)
    h = Header(
        stream="lidar/top",
        modality=Modality.LIDAR,
        seq=1,
        stamp_ns=1_000_000_000,
        bucket=10,
        bucket_width_ns=100_000_000,
        bucket_offset_ns=0,
        encoding="cdr:sensor_msgs/msg/PointCloud2",
        frame_id="lidar",
        publisher_id=7,
        publish_ns=1_000_000_100,
        flags=HeaderFlags(0),
    )
    npy = Header(
        stream="imu",
        modality=Modality.IMU,
        seq=1,
        stamp_ns=1_000_000_000,
        bucket=10,
        bucket_width_ns=100_000_000,
        bucket_offset_ns=0,
        encoding="npy",
        frame_id="",
        publisher_id=8,
        publish_ns=0,
        flags=HeaderFlags(0),
    )
    return MultiModalFrame(
        bucket=10,
        start_ns=1_000_000_000,
        end_ns=1_100_000_000,
        reference_stamp_ns=1_000_000_000,
        members={
            "lidar/top": (Member(Sample(h, cdr, 0), 1_000_000_000, 0),),
            "imu": (Member(Sample(npy, b"x", 0), 1_000_000_000, 0),),
        },
        missing=("camera/front",),
        complete=False,
        max_skew_ns=2_500_000,
    )


def test_frames_become_ros_messages_and_diagnostics_without_ros() -> None:
    route = FrameRoute("frames/fused", "/fused", "/fused/diagnostics")
    msgs = frame_messages(_frame(), route)
    assert [(m.topic, m.ros_type, m.stamp_ns) for m in msgs] == [
        ("/fused/lidar/top", "sensor_msgs/msg/PointCloud2", 1_000_000_000)
    ]
    diag = STORE.deserialize_cdr(
        frame_diagnostics_cdr(_frame(), route), "diagnostic_msgs/msg/DiagnosticArray"
    )
    st = diag.status[0]
    assert st.level == 1 and "camera/front" in st.message
    values = {kv.key: kv.value for kv in st.values}
    assert values["missing"] == "camera/front" and values["max_skew_ms"] == "2.500"
    assert diag.header.stamp.sec == 1


def test_a_frame_route_declares_the_fused_ros_streams_and_its_diagnostics_up_front() -> None:
    cfg = load_robot_config(ROOT / "config" / "robot.yaml").resolved()
    route = cfg.frames[0]
    assert [(t.topic, t.ros_type) for t in frame_topics(cfg, route)] == [
        ("/fused/lidar/top", "sensor_msgs/msg/PointCloud2"),
        ("/fused/camera/front", "sensor_msgs/msg/CompressedImage"),
        ("/fused/gps", "sensor_msgs/msg/NavSatFix"),
        ("/fused/imu", "sensor_msgs/msg/Imu"),
        ("/fused/diagnostics", "diagnostic_msgs/msg/DiagnosticArray"),
    ]
    unfused = replace(cfg, fusion=replace(cfg.fusion, streams=cfg.fusion.streams[:2]))  # type: ignore[arg-type]
    assert [t.topic for t in frame_topics(unfused, route)] == [
        "/fused/lidar/top",
        "/fused/camera/front",
        "/fused/diagnostics",
    ]


def test_ros_submissions_are_validated_and_goal_statuses_map_onto_the_queue() -> None:
    req = parse_submission('{"kind": "dock", "payload": {"id": 3}, "priority": 9, "deadline_s": 5}')
    assert (req.kind, req.payload, req.priority, req.deadline_s) == ("dock", {"id": 3}, 9, 5)
    for text, match in [
        ("[]", "JSON object"),
        ('{"kind": ""}', "'kind'"),
        ('{"kind": "a", "priority": 12}', "priority"),
        ('{"kind": "a", "deadline_s": -1}', "deadline_s"),
        ('{"kind": "a", "extra": 1}', "unknown key"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_submission(text)
    assert json.loads(outcome_json(request_id="r", error="bad"))["status"] == "rejected"
    assert goal_outcome(4) is GoalOutcome.OK
    assert goal_outcome(5) is GoalOutcome.CANCELED
    assert goal_outcome(6) is GoalOutcome.RETRY


# ---- the rclpy nodes themselves run in test_rclpy_nodes.py, under a ROS 2 Python -------------


def test_launch_files_load_with_the_ros_launch_api() -> None:
    from ros2_peers import ros2

    ros = ros2()
    script = (
        "import sys\n"
        "from launch.launch_description_sources import get_launch_description_from_python_launch_file\n"
        "for path in sys.argv[1:]:\n"
        "    assert get_launch_description_from_python_launch_file(path).entities, path\n"
        "print('loaded', len(sys.argv) - 1)\n"
    )
    paths = sorted(str(p) for p in (ROOT / "launch").glob("*.launch.py"))
    out = subprocess.run(
        [str(ros.python), "-c", script, *paths],
        env=ros.environ(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and f"loaded {len(paths)}" in out.stdout, out.stderr[-2000:]


def test_the_shipped_robot_config_routes_typical_topics() -> None:
    cfg = load_robot_config(ROOT / "config" / "robot.yaml")
    by_topic = {r.topic: r for r in cfg.inbound}
    assert by_topic["/lidar/points"].ros_type == "sensor_msgs/msg/PointCloud2"
    assert by_topic["/camera/image_raw/compressed"].ros_type == "sensor_msgs/msg/CompressedImage"
    assert by_topic["/gps/fix"].ros_type == "sensor_msgs/msg/NavSatFix"
    assert by_topic["/imu/data"].ros_type == "sensor_msgs/msg/Imu"
    assert {r.kind for r in cfg.actions} >= {"navigate_to"}
