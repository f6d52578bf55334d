"""Handlers of the chaos tests' executor processes (``--handlers chaos_handlers:HANDLERS``).

Every run is written down as it happens, one JSON line per event, to
``$EB_CHAOS_LOG/<executor>-<pid>.jsonl`` (a process killed with ``kill -9`` leaves what it wrote):
``start`` when a handler begins, ``owned`` at each step it takes while ``ctx.still_owner()``
holds, ``stop`` when it gives up a run its lease was taken from, ``end`` when it returns. Times
are ``time.monotonic_ns()`` (one clock for every process of the machine).

A ``work`` handler behaves as a handler that moves a robot should: it checks
``ctx.still_owner()`` before each step; while the queue cannot confirm its lease it pauses, and
if the lease was taken back it stops.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

_out: Any = None
STEP_S = 0.02


def _log(event: str, action: Any, ctx: Any, **more: Any) -> None:
    global _out
    if _out is None:
        folder = Path(os.environ["EB_CHAOS_LOG"])
        _out = open(folder / f"{ctx.executor}-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115
    record = {
        "ev": event,
        "id": action.id,
        "attempt": ctx.attempt,
        "ex": ctx.executor,
        "session": action.attempts[-1].session,
        "group": action.session,  # the ordered session the action is a step of (or None)
        "step": (action.payload or {}).get("step") if isinstance(action.payload, dict) else None,
        "pid": os.getpid(),
        "t": time.monotonic_ns(),
        **more,
    }
    _out.write(json.dumps(record) + "\n")


async def work(action: Any, ctx: Any) -> dict[str, Any]:
    _log("start", action, ctx)
    steps = int((action.payload or {}).get("steps", 5))
    done = 0
    while done < steps:
        if ctx.still_owner():
            _log("owned", action, ctx)
            await asyncio.sleep(STEP_S)
            done += 1
            continue
        if ctx.lost or ctx.cancelled.is_set():
            _log("stop", action, ctx)
            raise RuntimeError("its lease was taken back")
        await asyncio.sleep(STEP_S)  # paused until the queue confirms the lease again
    _log("end", action, ctx)
    if (action.payload or {}).get("flaky") and ctx.attempt == 1:
        raise RuntimeError("first try fails")
    return {"by": ctx.executor, "attempt": ctx.attempt}


async def poison(action: Any, ctx: Any) -> None:
    _log("start", action, ctx)
    _log("end", action, ctx)
    raise ValueError("cannot be done (poison)")


HANDLERS = {"work": work, "poison": poison}
