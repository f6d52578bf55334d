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
    _log(action, ctx)
    hold_s = float((action.payload or {}).get("hold_s", 0))
    await asyncio.sleep(hold_s)
    return {"moved": (action.payload or {}).get("to")}


HANDLERS = {"move": move}
