"""Processes the tests start: the command line, an environment that finds the helper modules
(handlers loaded with ``--handlers``), and waiting for a line that says a process is ready."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

#: ``embodied-bus`` as the running interpreter runs it.
CLI = [sys.executable, "-m", "embodied_bus.cli.main"]
#: The helper modules (``test/support``).
SUPPORT_DIR = Path(__file__).resolve().parent
#: The repository.
ROOT = SUPPORT_DIR.parents[1]


def helper_env(**extra: str) -> dict[str, str]:
    """This process's environment with the helper modules on ``PYTHONPATH``, and ``extra``."""
    path = f"{SUPPORT_DIR}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    return {**os.environ, "PYTHONPATH": path, **extra}


def wait_line(proc: subprocess.Popen[str], text: str, timeout_s: float = 60) -> None:
    """Wait until the process prints a line containing ``text`` (it is ready)."""
    seen = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if text in line:
                seen.set()
                return

    threading.Thread(target=read, daemon=True).start()
    assert seen.wait(timeout_s), f"process never printed {text!r}: {proc.poll()}"
