"""The package as users install it: an sdist and a wheel that pass ``twine check``, and a wheel
that, installed into a clean virtual environment, runs the synthetic demo and ``doctor``."""

from __future__ import annotations

import re
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_installs_into_a_clean_environment_and_runs_the_demo_and_doctor(tmp_path: Path) -> None:
    from embodied_bus import __version__

    dist = tmp_path / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel", "--outdir", str(dist)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    (wheel,) = dist.glob("embodied_bus-*.whl")
    (sdist,) = dist.glob("embodied_bus-*.tar.gz")
    assert wheel.name.startswith(f"embodied_bus-{__version__}-")
    assert sdist.name == f"embodied_bus-{__version__}.tar.gz"
    check = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(wheel), str(sdist)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    bin_dir = env_dir / "bin"
    install = subprocess.run(
        [str(bin_dir / "python"), "-m", "pip", "install", "-q", str(wheel)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    cli = str(bin_dir / "embodied-bus")
    version = subprocess.run([cli, "--version"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert version.stdout.strip() == f"embodied-bus {__version__}"
    demo = subprocess.run(
        [cli, "demo", "--synthetic", "--duration", "3", "--out", str(tmp_path / "out"), "--json"],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    doctor = subprocess.run([cli, "doctor"], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert re.search(r"round trip\s+ok", doctor.stdout), doctor.stdout


def test_the_version_has_one_source() -> None:
    """``embodied_bus.__version__``: setup.py reads it, and package.xml (ament) must say the same."""
    from embodied_bus import __version__

    package_xml = (ROOT / "package.xml").read_text()
    assert f"<version>{__version__}</version>" in package_xml
    assert "__version__" in (ROOT / "setup.py").read_text()
