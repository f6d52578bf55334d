"""The launch files as users run them: the plan they start (embodied_bus.ros.launching), its
refusals, and its processes started for real, carrying data from a ros-z driver through fusion
and back to a ros-z subscriber."""

from __future__ import annotations

import ast
import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from embodied_bus import open_bus
from embodied_bus.cli.ros_bridge import bus_beside_ros
from embodied_bus.errors import BusConfigError
from embodied_bus.ros.bridge_core import resolve_routes
from embodied_bus.ros.config import ActionRoute, RosLink, load_robot_config
from embodied_bus.ros.launching import (
    LAUNCH_FILES,
    LaunchArgs,
    ProcessSpec,
    require_shared_bus,
    router_connect_endpoint,
    share_dirs,
)
from embodied_bus.testing.ports import free_port

from ros_z import peer_command, peer_env

ROOT = Path(__file__).resolve().parents[2]
ROBOT = str(ROOT / "config" / "robot.yaml")


def names(specs: list[ProcessSpec]) -> list[str]:
    return [s.name for s in specs]


def test_every_launch_file_is_generated_from_the_shared_plan() -> None:
    for path in sorted((ROOT / "launch").glob("*.launch.py")):
        tree = ast.parse(path.read_text())
        calls = [
            n.args[0].value
            for n in ast.walk(tree)
            if isinstance(n, ast.Call)
            and getattr(n.func, "id", "") == "launch_description"
            and isinstance(n.args[0], ast.Constant)
        ]
        name = path.name.removesuffix(".launch.py")
        assert calls == [name], path.name
        assert name == "demo" or name in LAUNCH_FILES


def test_the_robot_launch_starts_bridges_fusion_queue_and_action_bridge_on_the_robots_router() -> None:
    specs = LAUNCH_FILES["robot"].processes(LaunchArgs(config=ROBOT))
    assert names(specs) == [
        "sensor_bridge",
        "frame_bridge",
        "fusion_worker",
        "queue_service",
        "action_bridge",
    ]
    for spec in specs:  # one bus for all: the config's, rmw_zenohd's endpoint
        assert "zenoh://localhost:7447" in " ".join(spec.command), spec
    bridge = specs[0].command
    assert "__ns:=/robot1" in bridge and f"config:={ROBOT}" in bridge


def test_an_isolated_bus_is_refused_with_the_fix_and_router_true_joins_it_to_the_launched_router() -> None:
    for name, launch_file in LAUNCH_FILES.items():
        with pytest.raises(
            BusConfigError, match=r"no other process can reach.*zenoh://localhost:7447.*router:=true"
        ):
            launch_file.processes(LaunchArgs(config=ROBOT, bus="zenoh:"))
        specs = launch_file.processes(LaunchArgs(config=ROBOT, bus="zenoh:", router=True))
        assert specs[0].name == "zenoh_router", name
        assert specs[0].command[-1] == "router"  # its default: every address, IPv6 and IPv4, port 7447
        for spec in specs[1:]:
            assert any(a.endswith("connect=tcp/localhost:7447") for a in spec.command), spec
    with pytest.raises(BusConfigError, match="zenoh:"):
        require_shared_bus("zenoh:?ns=a", who="fusion_worker")
    assert require_shared_bus("zenoh:?listen=tcp/0.0.0.0:7447", who="x")
    assert router_connect_endpoint("tcp/[::]:7447") == "tcp/localhost:7447"
    assert router_connect_endpoint("tcp/10.0.0.2:7000") == "tcp/10.0.0.2:7000"


def test_on_pulsar_the_queue_service_is_left_out_by_itself_and_queue_false_leaves_it_out_on_zenoh() -> None:
    pulsar = LAUNCH_FILES["robot"].processes(LaunchArgs(config=ROBOT, bus="pulsar://broker:6650"))
    assert "queue_service" not in names(pulsar) and "action_bridge" in names(pulsar)
    assert "queue_service" not in names(
        pulsar + LAUNCH_FILES["robot"].processes(LaunchArgs(config=ROBOT, queue=False))
    )
    args = LaunchArgs.from_strings({"config": ROBOT, "queue": "", "rclpy": "false", "router": "true"})
    assert args.queue is None and args.rclpy is False and args.router is True
    with pytest.raises(BusConfigError, match="rclpy:='maybe' must be true or false"):
        LaunchArgs.from_strings({"rclpy": "maybe"})
    with pytest.raises(BusConfigError, match=r"unknown launch argument\(s\) \['bsu'\]"):
        LaunchArgs.from_strings({"bsu": "zenoh:"})


def test_rclpy_false_starts_the_rmw_zenoh_bridge_in_place_of_the_rclpy_nodes() -> None:
    specs = LAUNCH_FILES["robot"].processes(LaunchArgs(config=ROBOT, rclpy=False, router=True))
    assert names(specs) == ["zenoh_router", "ros_bridge", "fusion_worker", "queue_service"]
    bridge = specs[1].command
    assert bridge[bridge.index("--connect") + 1] == "tcp/localhost:7447" and "--actions" in bridge


def test_the_default_config_and_the_demo_data_are_found_through_the_ament_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = tmp_path / "install" / "embodied_bus"
    (prefix / "share" / "ament_index" / "resource_index" / "packages").mkdir(parents=True)
    (prefix / "share" / "ament_index" / "resource_index" / "packages" / "embodied_bus").touch()
    (prefix / "share" / "embodied_bus" / "config").mkdir(parents=True)
    config = prefix / "share" / "embodied_bus" / "config" / "robot.yaml"
    config.write_text((ROOT / "config" / "robot.yaml").read_text().replace("robot1", "indexed"))
    monkeypatch.setenv("AMENT_PREFIX_PATH", f"/nonexistent:{prefix}")
    assert share_dirs()[0] == prefix / "share" / "embodied_bus"
    specs = LAUNCH_FILES["fusion"].processes(LaunchArgs())
    assert specs[0].command[-4:] == ("--bus", "zenoh://localhost:7447", "--ns", "indexed")


def test_an_action_route_whose_type_is_not_installed_is_named_and_the_others_serve() -> None:
    routes = load_robot_config(ROBOT).actions
    missing = "opennav_docking_msgs"

    def make(route: ActionRoute) -> str:
        action_type = route.action_type
        if action_type.startswith(missing):
            raise ModuleNotFoundError(f"No module named '{missing}'")
        return f"handler for {action_type}"

    ok, problems = resolve_routes(routes, make)
    assert [r.kind for r, _ in ok] == ["navigate_to"]
    assert problems == [
        "action route 'dock' left out: opennav_docking_msgs/action/DockRobot cannot be loaded "
        "(ModuleNotFoundError: No module named 'opennav_docking_msgs'); install its package or fix the type"
    ]


def test_the_ros_bridge_joins_an_isolated_bus_to_the_router_it_hosts_or_reaches() -> None:
    hosted = RosLink(host_router="tcp/[::]:7447")
    assert bus_beside_ros("zenoh:?ns=r", hosted) == "zenoh:?ns=r&connect=tcp/localhost:7447"
    assert (
        bus_beside_ros("zenoh:", RosLink(connect=("tcp/10.0.0.2:7447",)))
        == "zenoh:?connect=tcp/10.0.0.2:7447"
    )
    assert bus_beside_ros("pulsar://b:6650", hosted) == "pulsar://b:6650"


class Running:
    """Processes started from a plan, their output collected; ``ready`` waits for a line."""

    def __init__(self, specs: list[ProcessSpec], cwd: Path) -> None:
        self.lines: dict[str, list[str]] = {s.name: [] for s in specs}
        self.seen = threading.Condition()
        self.procs = {
            s.name: subprocess.Popen(
                s.command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            for s in specs
        }
        for name, proc in self.procs.items():
            threading.Thread(target=self._pump, args=(name, proc), daemon=True).start()

    def _pump(self, name: str, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with self.seen:
                self.lines[name].append(line)
                self.seen.notify_all()

    def ready(self, name: str, marker: str, timeout_s: float = 30.0) -> None:
        with self.seen:
            ok = self.seen.wait_for(
                lambda: any(marker in ln for ln in self.lines[name]) or self.procs[name].poll() is not None,
                timeout_s,
            )
        assert ok and any(marker in ln for ln in self.lines[name]), (
            f"{name}: {''.join(self.lines[name])[-3000:]}"
        )

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture
def robot(tmp_path: Path) -> Iterator[tuple[Running, str]]:
    env = peer_env()  # skips where ros-z is absent
    del env
    port = free_port()
    args = LaunchArgs(
        config=ROBOT,
        bus="zenoh:",
        router=True,
        router_listen=f"tcp/127.0.0.1:{port}",
        rclpy=False,
        queue_db=str(tmp_path / "actions.db"),
    )
    running = Running(LAUNCH_FILES["robot"].processes(args), tmp_path)
    try:
        for name, marker in (
            ("zenoh_router", "zenoh router listening"),
            ("ros_bridge", "ros-bridge: node"),
            ("fusion_worker", "fusing "),
            ("queue_service", "action queue serving"),
        ):
            running.ready(name, marker)
        yield running, f"tcp/127.0.0.1:{port}"
    finally:
        running.stop()


def test_the_robot_launch_carries_ros_z_sensor_data_through_fusion_back_to_ros_z(
    robot: tuple[Running, str],
) -> None:
    running, endpoint = robot
    env = peer_env()
    graph = json.loads(
        subprocess.run(
            peer_command("graph", "--connect", endpoint, "--topic", "/fused/gps", "--timeout-s", "10"),
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    # the bridge's publishers are in the graph before any frame flowed
    assert graph["publishers"] == 1, graph
    assert "/fused/lidar/top sensor_msgs::msg::dds_::PointCloud2_" in graph["topics"]
    assert "/robot1/embodied_bus_bridge" in graph["nodes"]  # the launch passes __ns:=/robot1
    listeners = {
        topic: subprocess.Popen(
            peer_command(
                "listen",
                "--connect",
                endpoint,
                "--topic",
                topic,
                "--type",
                ros_type,
                "--count",
                "10",
                "--timeout-s",
                "25",
            ),
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for topic, ros_type in (
            ("/fused/lidar/top", "sensor_msgs/msg/PointCloud2"),
            ("/fused/gps", "sensor_msgs/msg/NavSatFix"),
        )
    }
    for proc in listeners.values():
        assert proc.stdout is not None and '"ready"' in proc.stdout.readline()
    sensors = subprocess.run(
        peer_command("sensors", "--connect", endpoint, "--duration-s", "4"),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    published = json.loads(sensors.stdout.strip().splitlines()[-1])["published"]
    heard = {}
    for topic, proc in listeners.items():
        out, _ = proc.communicate(timeout=60)
        heard[topic] = json.loads(out.strip().splitlines()[-1])
    assert published["/lidar/points"] >= 35
    assert heard["/fused/lidar/top"]["received"] == 10, (heard, running.lines["ros_bridge"][-5:])
    assert heard["/fused/gps"]["received"] >= 5, heard
    stamps = heard["/fused/lidar/top"]["stamps_ns"]
    assert stamps == sorted(stamps) and len(set(stamps)) == 10  # one sweep per frame, in order


@pytest.mark.parametrize("bus", ["config", "router"], ids=["config-bus-zenoh:", "bus-on-its-own-router"])
async def test_a_ros_bridge_hosting_the_router_shares_its_bus_with_other_processes(
    bus: str, tmp_path: Path
) -> None:
    env = peer_env()  # skips where ros-z is absent
    port = free_port()
    endpoint = f"tcp/127.0.0.1:{port}"
    config = tmp_path / "robot.yaml"
    config.write_text(Path(ROBOT).read_text().replace('bus: "zenoh://localhost:7447"', 'bus: "zenoh:"'))
    argv = ["ros-bridge", "--config", str(config), "--host-router", endpoint, "--ns", "shared"]
    if bus == "router":  # the bus connects to the router this same process hosts
        argv += ["--bus", f"zenoh://127.0.0.1:{port}"]
    running = Running(
        [ProcessSpec("ros_bridge", (sys.executable, "-m", "embodied_bus.cli.main", *argv))], tmp_path
    )
    try:
        running.ready("ros_bridge", "ros-bridge: node")
        async with open_bus(f"zenoh://127.0.0.1:{port}", namespace="shared") as other:
            sub = await other.subscribe("gps")
            sensors = await asyncio.create_subprocess_exec(
                *peer_command("sensors", "--connect", endpoint, "--duration-s", "3"),
                env=env,
                stdout=asyncio.subprocess.PIPE,
            )
            out, _ = await asyncio.wait_for(sensors.communicate(), 60)
            published = json.loads(out.decode().strip().splitlines()[-1])["published"]["/gps/fix"]
            got = []
            async with asyncio.timeout(10):
                async for sample in sub:
                    got.append(sample.header.stamp_ns)
                    if len(got) == published:
                        break
        assert len(got) == published >= 14 and got == sorted(got)
    finally:
        running.stop()


def test_every_publisher_of_the_robot_takes_one_bucket_clock_from_its_config(tmp_path: Path) -> None:
    from embodied_bus.cli.common import bucket_clock
    from embodied_bus.model.clock import BucketClock
    from embodied_bus.ros.config import RobotConfigError, robot_config_from_dict

    robot = load_robot_config(ROBOT)
    assert robot.clock == robot.fusion.clock == BucketClock(100_000_000, 50_000_000)  # type: ignore[union-attr]
    assert bucket_clock(None, config=ROBOT) == robot.clock  # replay --config
    assert bucket_clock(str(ROOT / "config" / "demo.yaml")) == BucketClock(100_000_000, 72_000_000)  # --spec
    assert bucket_clock(None) == BucketClock()
    explicit = robot_config_from_dict({"clock": {"bucket_width_ms": 50, "bucket_offset_ms": 20}})
    assert explicit.clock == BucketClock(50_000_000, 20_000_000)
    mapping_only = tmp_path / "map.yaml"
    mapping_only.write_text("streams:\n  /scan: scan\n")
    assert bucket_clock(None, config=str(mapping_only)) == BucketClock()
    doc = {
        "clock": {"bucket_width_ms": 100},
        "fusion": {
            "bucket_offset_ms": 50,
            "streams": {"a": {"role": "reference", "expected_period_ms": 100}},
        },
    }
    with pytest.raises(
        RobotConfigError,
        match=r"robot.clock: 100 ms offset 0 ms differs from the fusion spec's 100 ms offset 50 ms",
    ):
        robot_config_from_dict(doc)
    with pytest.raises(RobotConfigError, match=r"robot.clock: bucket offset_ns must satisfy"):
        robot_config_from_dict({"clock": {"bucket_width_ms": 50, "bucket_offset_ms": 60}})
