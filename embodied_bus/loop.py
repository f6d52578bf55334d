"""The event loop the command line runs on.

``uvloop`` where it is installed (embodied_bus installs it on Linux and macOS), else asyncio's
own loop. The rclpy nodes and ``SyncBus`` keep asyncio's loop. uvloop takes less CPU per
action (see docs/performance.md); stream throughput is the same on both. Library code runs on
whatever loop the application chose: ``uvloop.run(main())`` picks this one.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Coroutine
from typing import Any

from embodied_bus.errors import BusConfigError

__all__ = ["LOOP_CHOICES", "LOOP_ENV", "install_stop_signals", "loop_runner"]

#: Environment variable that chooses the loop: ``auto`` (the default: uvloop if installed),
#: ``uvloop`` (fail if it is not installed) or ``asyncio``.
LOOP_ENV = "EMBODIED_BUS_LOOP"
#: The values :data:`LOOP_ENV` takes.
LOOP_CHOICES = ("auto", "uvloop", "asyncio")

Runner = Callable[[Coroutine[Any, Any, Any]], Any]


def loop_runner(choice: str | None = None) -> tuple[str, Runner]:
    """The loop to run a command on, as ``(name, run)``; ``run(coro)`` works as ``asyncio.run``.

    Args:
        choice: One of :data:`LOOP_CHOICES`; None reads :data:`LOOP_ENV` (default ``auto``).

    Raises:
        BusConfigError: An unknown choice, or ``uvloop`` asked for and not installed.
    """
    if choice is None:
        choice = os.environ.get(LOOP_ENV, "auto") or "auto"
    if choice not in LOOP_CHOICES:
        raise BusConfigError(f"{LOOP_ENV}={choice!r}: must be one of {', '.join(LOOP_CHOICES)}")
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError as err:
            if choice == "uvloop":
                raise BusConfigError(
                    f"{LOOP_ENV}=uvloop, but uvloop is not installed: pip install uvloop"
                ) from err
        else:
            return "uvloop", uvloop.run
    return "asyncio", asyncio.run


def install_stop_signals(stop: asyncio.Event) -> None:
    """Set ``stop`` on SIGINT/SIGTERM for a clean shutdown."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
