"""ros-z beside the repository (``../shared/ros-z``): an independent ROS 2 implementation over
Zenoh (ZettaScale, Apache-2.0) for interoperability tests. Its wheels are installed once into a
cache directory and the peers run as their own processes (``test/ros_z_peer.py``); where ros-z
is absent, the tests that need it skip with the reason."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROS_Z = ROOT.parent / "shared" / "ros-z"
PEER = Path(__file__).with_name("ros_z_peer.py")
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "embodied_bus" / "ros-z"


def ros_z_pythonpath() -> str:
    """Install ros-z's Python wheels into the cache (once per wheel set) and return the
    directory to put on ``PYTHONPATH``; skip the test with the reason where that cannot be."""
    wheels = sorted(ROS_Z.glob("*.whl"))
    if not wheels:
        pytest.skip(f"ros-z is not beside the repository ({ROS_Z} has no wheels)")
    digest = hashlib.sha256("".join(f"{w.name}:{w.stat().st_size}" for w in wheels).encode()).hexdigest()[:12]
    target = CACHE / digest
    if not (target / ".installed").exists():
        out = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--target", str(target), *map(str, wheels)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if out.returncode != 0:
            pytest.skip(f"ros-z wheels do not install here: {out.stderr.strip()[-300:]}")
        (target / ".installed").touch()
    return str(target)


def peer_command(*argv: str) -> list[str]:
    """The command that runs the ros-z peer script with ``argv``."""
    return [sys.executable, str(PEER), *argv]


def peer_env() -> dict[str, str]:
    """The environment for ros-z peer processes."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ros_z_pythonpath()
    return env


def run_peer(*argv: str, timeout_s: float = 60.0) -> dict[str, object]:
    """Run the ros-z peer to completion; its JSON answer."""
    out = subprocess.run(
        peer_command(*argv), env=peer_env(), capture_output=True, text=True, timeout=timeout_s
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result
