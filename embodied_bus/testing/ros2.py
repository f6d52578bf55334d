"""A real ROS 2 Jazzy Python (rclpy over Fast DDS, launch, the ``ros2`` command,
message_filters, rmw_zenoh_cpp) for tests and benchmarks.

Found in this order:

1. This Python, when it imports ``rclpy`` (a sourced ROS 2 install, or rclpy installed beside
   embodied_bus): used as it is, never changed.
2. The environment built once by ``python -m embodied_bus.testing.ros2 setup`` under
   ``~/.cache/embodied_bus/ros2-jazzy-<key>``: the pinned PyPI packages and the wheels of a
   folder such as ``../shared/ros2`` (see its README), plus embodied_bus's own dependencies.

ROS processes started from here get the repository on ``PYTHONPATH``, ``AMENT_PREFIX_PATH`` set to
the environment and ``ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST``.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CACHE", "RosPython", "build", "find_ros_python", "shared_ros2"]

ROOT = Path(__file__).resolve().parents[2]
#: Where built environments are kept.
CACHE = Path(os.environ.get("EMBODIED_BUS_CACHE", Path.home() / ".cache" / "embodied_bus"))
#: Where the wheels are looked for when no folder is given (beside the repository).
DEFAULT_SHARED = ROOT.parent / "shared" / "ros2"
_PROBE = "import rclpy, message_filters, launch_ros, sys; print(sys.prefix)"


@dataclass(frozen=True)
class RosPython:
    """A Python that runs rclpy, and the environment its ROS processes need.

    Attributes:
        python: The interpreter.
        prefix: Its ``sys.prefix`` (the ament prefix of a built environment).
        env: Variables to add to ``os.environ`` for a ROS process.
        built: True for an environment built here (False: this Python or a sourced install).
    """

    python: Path
    prefix: Path
    env: dict[str, str] = field(default_factory=dict)
    built: bool = False

    def environ(self, **extra: str) -> dict[str, str]:
        """``os.environ`` with this environment's variables and ``extra``."""
        out = dict(os.environ)
        path = out.get("PYTHONPATH")
        out.update(self.env)
        out["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), path) if p)
        out.update(extra)
        return out

    @property
    def bin(self) -> Path:
        """Folder of the environment's programs (``ros2``, console scripts)."""
        return self.python.parent

    def zenoh_environ(self, **extra: str) -> dict[str, str]:
        """:meth:`environ` for a process on ``rmw_zenoh_cpp`` (preloaded: the PyPI rcl is linked
        to Fast DDS), as ``../shared/ros2``'s README describes."""
        bundled = glob.glob(str(self.prefix / "lib" / "python3*" / "site-packages" / "ros_*.libs"))
        libs = [str(self.prefix / "lib"), *sorted(bundled)]
        return self.environ(
            RMW_IMPLEMENTATION="rmw_zenoh_cpp",
            LD_LIBRARY_PATH=os.pathsep.join(libs),
            LD_PRELOAD=str(self.prefix / "lib" / "librmw_zenoh_cpp.so"),
            **extra,
        )


def shared_ros2(folder: str | Path | None = None) -> Path | None:
    """The folder of ROS 2 wheels (``folder``, ``$EMBODIED_BUS_ROS2_WHEELS`` or
    ``../shared/ros2``), or None if it is not there."""
    path = Path(folder or os.environ.get("EMBODIED_BUS_ROS2_WHEELS") or DEFAULT_SHARED)
    return path if (path / "requirements.txt").is_file() and glob.glob(str(path / "*.whl")) else None


def _key(shared: Path) -> str:
    h = hashlib.sha1()
    h.update((shared / "requirements.txt").read_bytes())
    for wheel in sorted(glob.glob(str(shared / "*.whl"))):
        h.update(Path(wheel).name.encode())
    h.update((ROOT / "setup.py").read_bytes())
    h.update(f"{sys.version_info.major}.{sys.version_info.minor}".encode())
    return h.hexdigest()[:12]


def _venv(shared: Path) -> Path:
    return CACHE / f"ros2-jazzy-{_key(shared)}"


def _probe(python: Path) -> Path | None:
    try:
        out = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return Path(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else None


def find_ros_python(shared: str | Path | None = None) -> RosPython | str:
    """A ROS 2 Python (see the module), or the reason there is none."""
    base = {"ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST"}
    own = _probe(Path(sys.executable))
    if own is not None:
        return RosPython(Path(sys.executable), own, base)
    folder = shared_ros2(shared)
    if folder is None:
        return (
            "no ROS 2: rclpy is not importable here and no ROS 2 wheels folder "
            f"({DEFAULT_SHARED} or $EMBODIED_BUS_ROS2_WHEELS) is there to build one from"
        )
    venv = _venv(folder)
    python = venv / "bin" / "python"
    prefix = _probe(python) if python.exists() else None
    if prefix is None:
        return f"no ROS 2 environment built yet: run python -m embodied_bus.testing.ros2 setup ({folder})"
    return RosPython(python, prefix, {**base, "AMENT_PREFIX_PATH": str(prefix)}, built=True)


def build(shared: str | Path | None = None, *, quiet: bool = True) -> RosPython:
    """Build (once) the environment from the wheels folder, with embodied_bus's dependencies.

    Raises:
        FileNotFoundError: No wheels folder.
        subprocess.CalledProcessError: pip failed (its output is shown).
    """
    folder = shared_ros2(shared)
    if folder is None:
        raise FileNotFoundError(f"no ROS 2 wheels folder at {shared or DEFAULT_SHARED}")
    venv = _venv(folder)
    python = venv / "bin" / "python"
    if not (python.exists() and _probe(python) is not None):
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", *(["-q"] if quiet else [])]
        subprocess.run([*pip, "--upgrade", "pip"], check=True)
        # one pip command: the wheels depend on each other by exact versions (their README)
        wheels = sorted(glob.glob(str(folder / "*.whl")))
        subprocess.run(
            [*pip, "-r", str(folder / "requirements.txt"), *wheels, "colcon-common-extensions"], check=True
        )
        # embodied_bus's dependencies; the package itself comes from PYTHONPATH (this checkout)
        subprocess.run([*pip, f"{ROOT}[pulsar]"], check=True)
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "embodied_bus"], check=True)
    found = find_ros_python(folder)
    if isinstance(found, str):
        raise RuntimeError(found)
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m embodied_bus.testing.ros2", description=__doc__)
    ap.add_argument("command", choices=["setup", "find"])
    ap.add_argument("--wheels", help="the ROS 2 wheels folder (default: ../shared/ros2)")
    args = ap.parse_args(argv)
    if args.command == "setup":
        if shared_ros2(args.wheels) is None and isinstance(find_ros_python(args.wheels), str):
            print(json.dumps({"ros2": None, "reason": find_ros_python(args.wheels)}))
            return 0
        found = find_ros_python(args.wheels)
        if isinstance(found, str):
            found = build(args.wheels)
    else:
        found = find_ros_python(args.wheels)
    if isinstance(found, str):
        print(json.dumps({"ros2": None, "reason": found}))
        return 1
    print(json.dumps({"ros2": str(found.python), "prefix": str(found.prefix), "built": found.built}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
