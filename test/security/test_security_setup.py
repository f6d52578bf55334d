"""The secure set-up in one command: ``embodied-bus keys init`` writes a robot's keys and
allow-list and prints what each process needs; processes started with exactly that run sealed
end to end, the robot YAML and the launch take its ``security:`` section, and a process that
runs unsealed on a bus other hosts can reach says so once."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import pytest
import yaml
from processes import CLI, ROOT, helper_env

from embodied_bus.engines.urls import parse_bus_url
from embodied_bus.ros.config import RobotConfigError, load_robot_config, robot_config_from_dict
from embodied_bus.ros.launching import LAUNCH_FILES, LaunchArgs
from embodied_bus.security import Role, load_allow_list
from embodied_bus.testing.ports import free_port


def keys_init(folder: Path, *argv: str) -> str:
    out = subprocess.run(
        [*CLI, "keys", "init", str(folder), *argv], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def flags_of(printed: str, command: str) -> list[str]:
    """The flags ``keys init`` printed for ``embodied-bus <command> ...``."""
    line = next(ln for ln in printed.splitlines() if ln.startswith(f"embodied-bus {command} ..."))
    return line.split("...", 1)[1].split()


def test_keys_init_writes_every_key_and_an_allow_list_and_never_overwrites(tmp_path: Path) -> None:
    printed = keys_init(tmp_path / "keys", "--executors", "arm,gripper", "--kinds", "move,dock")
    allow = {k.name: k for k in load_allow_list(tmp_path / "keys" / "allow.yaml").keys}
    assert allow["queue"].roles == {Role.QUEUE}
    assert allow["planner"].roles == {Role.PLANNER} and allow["planner"].kinds == {"move", "dock"}
    assert allow["arm"].acts_as("arm") and not allow["arm"].acts_as("gripper")
    assert allow["bridge"].acts_as("ros-embodied_bus_bridge") and allow["bridge"].acts_as("ros-action_bridge")
    for name in allow:
        assert (tmp_path / "keys" / f"{name}.pem").stat().st_mode & 0o777 == 0o600
    section = yaml.safe_load(printed[printed.index("security:") : printed.index("# processes")])
    cfg = robot_config_from_dict(section)
    assert cfg.security is not None and cfg.security.queue_key == str(tmp_path / "keys" / "queue.pem")
    again = subprocess.run([*CLI, "keys", "init", str(tmp_path / "keys")], capture_output=True, text=True)
    assert again.returncode != 0 and "already holds keys" in again.stderr


def test_the_robot_yaml_security_section_seals_the_launched_queue_and_names_missing_files(
    tmp_path: Path,
) -> None:
    printed = keys_init(tmp_path / "keys")
    section = yaml.safe_load(printed[printed.index("security:") : printed.index("# processes")])
    robot = yaml.safe_load((ROOT / "config" / "robot.yaml").read_text()) | section
    (tmp_path / "robot.yaml").write_text(yaml.safe_dump(robot))
    args = LaunchArgs(config=str(tmp_path / "robot.yaml"), rclpy=False, router=True)
    (queue,) = [p for p in LAUNCH_FILES["robot"].processes(args) if p.name == "queue_service"]
    assert ("--seal", section["security"]["queue_key"]) == queue.command[-4:-2]
    assert ("--trust", section["security"]["allow_list"]) == queue.command[-2:]
    robot["security"]["planner_key"] = "keys/nothing.pem"
    (tmp_path / "robot.yaml").write_text(yaml.safe_dump(robot))
    with pytest.raises(RobotConfigError, match=r"security\.planner_key: no file .*keys init"):
        load_robot_config(tmp_path / "robot.yaml")


def test_processes_started_as_keys_init_says_run_sealed_and_unsealed_ones_say_so_loudly(
    tmp_path: Path,
) -> None:
    printed = keys_init(tmp_path / "keys", "--executors", "arm")
    port = free_port()
    ns = "setup" + str(port)
    listen = f"zenoh:?listen=tcp/0.0.0.0:{port}"  # other hosts can reach it
    url = f"zenoh://127.0.0.1:{port}"
    assert parse_bus_url(listen).reaches_other_hosts and not parse_bus_url(url).reaches_other_hosts
    env = helper_env(EB_ATTACK_LOG=str(tmp_path / "runs.jsonl"))
    db = str(tmp_path / "q.db")
    queue = subprocess.Popen(
        [*CLI, "queue", "--bus", listen, "--ns", ns, "--db", db, *flags_of(printed, "queue")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    executor = subprocess.Popen(
        [*CLI, "executor", "--bus", url, "--ns", ns, "--handlers", "attack_handlers:HANDLERS",
         *flags_of(printed, "executor"), "--nonce-db", str(tmp_path / "nonces.db")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        sent = subprocess.run(
            [*CLI, "send", "move", "--bus", url, "--ns", ns, "--payload", json.dumps({"to": "bin"}),
             "--wait", "--timeout", "60", *flags_of(printed, "send")],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert sent.returncode == 0, sent.stderr
        assert '"succeeded"' in sent.stdout and '"moved": "bin"' in sent.stdout, sent.stdout
    finally:
        for p in (executor, queue):
            p.send_signal(signal.SIGINT)
        outs = [p.communicate(timeout=30) for p in (executor, queue)]
    assert all("NOT SEALED" not in err for _, err in outs), outs
    # the same queue without the flags, on a bus other hosts can reach
    unsealed = subprocess.Popen(
        [*CLI, "queue", "--bus", f"zenoh:?listen=tcp/0.0.0.0:{free_port()}", "--ns", ns, "--db", db],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert unsealed.stdout is not None and "serving" in unsealed.stdout.readline()
    unsealed.send_signal(signal.SIGINT)
    _, err = unsealed.communicate(timeout=30)
    assert err.count("NOT SEALED") == 1 and "embodied-bus keys init" in err, err
    assert re.search(
        r"the queue service: the action queue's messages on zenoh:\?listen=tcp/0\.0\.0\.0:\d+", err
    )
