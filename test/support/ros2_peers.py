"""Real ROS 2 Jazzy for the tests: rclpy nodes of embodied_bus and rclpy peers (``rclpy_peer.py``)
as processes of a Python that has rclpy (see :mod:`embodied_bus.testing.ros2`), each test on a
ROS domain of its own. Where there is no such Python, the tests that need one skip, saying why."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from embodied_bus.testing.ros2 import RosPython, find_ros_python

ROOT = Path(__file__).resolve().parents[2]
PEER = Path(__file__).with_name("rclpy_peer.py")
_FOUND: list[RosPython | str] = []
#: ROS domains handed out to tests, in a random order (concurrent test runs and participants
#: that a killed process left behind rarely share one).
# each pytest worker (``-n 2``) draws from its own range: concurrent tests never share a domain
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
_DOMAINS = random.sample(range(1 + 50 * (_WORKER % 4), 51 + 50 * (_WORKER % 4)), 50)


def ros2() -> RosPython:
    """The ROS 2 Python (found once), or skip the test with the reason."""
    if not _FOUND:
        _FOUND.append(find_ros_python())
    found = _FOUND[0]
    if isinstance(found, str):
        pytest.skip(found)
    return found


def domain_id() -> int:
    """A ROS_DOMAIN_ID for one test."""
    domain = _DOMAINS.pop(0)
    _DOMAINS.append(domain)
    return domain


class Proc:
    """A process with its output collected by a thread (so pipes never fill), which can be
    waited on for a line."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path | None = None) -> None:
        self.argv = argv
        # a session of its own: what it starts (a launch's nodes) is killed with it, never left behind
        self.popen = subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, text: str, timeout_s: float) -> bool:
        """Whether a line containing ``text`` came within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not any(text in line for line in self.lines):
                left = deadline - time.monotonic()
                if left <= 0 or (self.popen.poll() is not None and not self._reader.is_alive()):
                    return any(text in line for line in self.lines)
                self._changed.wait(min(left, 0.2))
        return True

    def output(self) -> str:
        return "\n".join(self.lines)

    def result(self, timeout_s: float = 60.0) -> Any:
        """Wait for the process to end; the last JSON document it printed (on one line, or
        indented over the last lines)."""
        self.popen.wait(timeout=timeout_s)
        self._reader.join(5)
        for i in range(len(self.lines) - 1, -1, -1):
            if self.lines[i].startswith("{"):
                for text in (self.lines[i], "\n".join(self.lines[i:])):
                    with contextlib.suppress(json.JSONDecodeError):
                        return json.loads(text)
        raise AssertionError(
            f"{self.argv[:4]} printed no JSON (exit {self.popen.returncode}):\n{self.output()[-3000:]}"
        )

    def interrupt(self, timeout_s: float = 30.0) -> int:
        """SIGINT, then wait; the exit code (SIGKILL after ``timeout_s``)."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
        try:
            code = self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill_all()
            return self.popen.wait(timeout=10)
        self.kill_all()  # anything it left running
        return code

    def kill_all(self) -> None:
        """SIGKILL the process and every process of its session."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)


class RosEnv:
    """One test's ROS 2: its domain, its environment, and the processes it started (stopped at
    the end)."""

    def __init__(self, ros: RosPython, domain: int, *, zenoh: str | None = None) -> None:
        self.ros = ros
        self.domain = domain
        extra = {"ROS_DOMAIN_ID": str(domain)}
        self.env = ros.zenoh_environ(**extra, ZENOH_CONFIG_OVERRIDE=zenoh) if zenoh else ros.environ(**extra)
        self.procs: list[Proc] = []

    def start(self, argv: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> Proc:
        """A process of this test (``env``: instead of the test's environment)."""
        p = Proc(argv, env or self.env, cwd)
        self.procs.append(p)
        return p

    def peer(self, *argv: str) -> Proc:
        """An rclpy peer (``rclpy_peer.py``)."""
        return self.start([str(self.ros.python), str(PEER), *argv])

    def node(self, name: str, config: Path, *params: str) -> Proc:
        """An embodied_bus rclpy node (``sensor_bridge``, ``frame_bridge``, ``action_bridge``)."""
        ros_args = ["--ros-args", "-p", f"config:={config}"]
        for p in params:
            ros_args += ["-p", p]
        return self.start([str(self.ros.python), "-m", f"embodied_bus.ros.nodes.{name}", *ros_args])

    def ros2(self, *argv: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        """A ``ros2`` command of the environment, to completion."""
        return subprocess.run(
            [str(self.ros.bin / "ros2"), *argv],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def ros2_until(self, *argv: str, want: str | tuple[str, ...], timeout_s: float = 30.0) -> str:
        """Run a ``ros2`` command (``--no-daemon``: discovery starts afresh each time, and may
        not have found every node yet) until its output has a line holding ``want`` (each of
        them, for a tuple); its last output."""
        wants = (want,) if isinstance(want, str) else want
        deadline = time.monotonic() + timeout_s
        while True:
            out = self.ros2(*argv, "--no-daemon").stdout
            lines = out.splitlines()
            if all(any(w in line for line in lines) for w in wants) or time.monotonic() > deadline:
                return out

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.interrupt()


def ros_env(*, zenoh: str | None = None) -> Iterator[RosEnv]:
    """A fixture body: a :class:`RosEnv` on a domain of its own, its processes stopped after."""
    env = RosEnv(ros2(), domain_id(), zenoh=zenoh)
    try:
        yield env
    finally:
        env.stop()


def robot_yaml(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(doc))
    return path
