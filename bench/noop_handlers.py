"""Handlers for ``bench/actions.py --executor-processes``: executors in their own processes
(``embodied-bus executor --handlers noop_handlers:HANDLERS``)."""

from __future__ import annotations

import time
from typing import Any


async def noop(action: Any, ctx: Any) -> int:
    """Do nothing; the result is the start time (ns, this host's clock) for submit→start."""
    return time.time_ns()


HANDLERS = {"noop": noop}
