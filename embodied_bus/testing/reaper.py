"""A watcher that kills a process group once its owner is gone.

Brokers and bookies started for tests run in their own process group (so a ``kill -9`` of one
member reaches its JVM). If the test process that started them dies without cleaning up (a
crash, ``kill -9``), nothing else would stop them: a small watcher process per group does.

Run as ``python -m embodied_bus.testing.reaper OWNER_PID PGID``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

__all__ = ["watch_group"]

#: How often the watcher looks at its owner, seconds.
POLL_S = 1.0


def watch_group(pgid: int, owner_pid: int | None = None) -> None:
    """Start a detached watcher that SIGKILLs process group ``pgid`` once ``owner_pid`` (default:
    this process) has exited; it exits by itself when the group is gone first."""
    subprocess.Popen(
        [sys.executable, "-m", "embodied_bus.testing.reaper", str(owner_pid or os.getpid()), str(pgid)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped) counts as gone
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str]) -> int:
    owner, pgid = int(argv[0]), int(argv[1])
    while _group_alive(pgid):
        if not _alive(owner):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return 0
        time.sleep(POLL_S)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
