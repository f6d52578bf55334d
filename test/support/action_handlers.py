"""Handlers used by the executor-process tests (loaded with --handlers action_handlers:HANDLERS)."""

from __future__ import annotations

import asyncio
import os
from typing import Any


async def navigate_to(action: Any, ctx: Any) -> dict[str, Any]:
    resumed = ctx.previous_checkpoint
    await ctx.checkpoint({"waypoint": 3, "pid": os.getpid()})
    if (action.payload or {}).get("hang_first") and ctx.attempt == 1:
        await asyncio.sleep(120)  # this executor gets killed here
    return {"resumed_from": resumed, "attempt": ctx.attempt}


async def dock(action: Any, ctx: Any) -> None:
    raise ValueError("charger not found")


HANDLERS = {"navigate_to": navigate_to, "dock": dock}
