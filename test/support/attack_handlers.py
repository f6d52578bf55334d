"""Handlers of the security tests' executor process (``--handlers attack_handlers:HANDLERS``):
every run is a line in ``$EB_ATTACK_LOG`` (action id, attempt, payload, checkpoint it resumed
from), so a test counts what ran however the process was reached."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any


def _log(action: Any, ctx: Any) -> None:
    with open(os.environ["EB_ATTACK_LOG"], "a") as out:
        out.write(
            json.dumps(
                {
                    "id": action.id,
                    "attempt": ctx.attempt,
                    "payload": action.payload,
                    "resumed_from": ctx.previous_checkpoint,
                }
            )
            + "\n"
        )


async def move(action: Any, ctx: Any) -> dict[str, Any]:
    """Holds ``hold_s`` seconds, sending ``feedback`` progress messages over it; the result says
    whether the run still owned its action at the end (``still_owner()``)."""
    _log(action, ctx)
    payload = action.payload or {}
    hold_s = float(payload.get("hold_s", 0))
    steps = int(payload.get("feedback", 0))
    for step in range(steps):
        ctx.feedback({"step": step})
        await asyncio.sleep(hold_s / steps)
    await asyncio.sleep(0 if steps else hold_s)
    result = {"moved": payload.get("to")}
    if payload.get("report_owner"):
        result["owner"] = ctx.still_owner()
    return result


HANDLERS = {"move": move}
