"""Lease intake of an executor: which leases may run here, how many at once, which wait for a
slot, and what the queue says about the ones held (renewed, taken back, canceled)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from functools import partial
from typing import Any

from embodied_bus.actions.context import ActionContext
from embodied_bus.actions.queue import Lease, WorkerLink

__all__ = ["Intake", "Running"]

_log = logging.getLogger("embodied_bus.actions")
#: Attempts remembered as started here (a lease for one of them again is refused).
RAN_REMEMBERED = 100_000

#: Runs one attempt: the handler, verification and the report of its outcome.
RunOne = Callable[[ActionContext], Coroutine[Any, Any, None]]
#: Makes the context of an accepted lease.
MakeContext = Callable[[Lease], ActionContext]


@dataclass(slots=True)
class Running:
    """An attempt running here: its context and the task running its handler."""

    ctx: ActionContext
    task: asyncio.Task[None]


class Intake:
    """The leases of one executor process (``name``, ``session``).

    A lease runs only if it was granted to this process, for an attempt not run here yet,
    within ``concurrency``; a lease pushed beyond the free slots waits for one. ``run_one``
    runs an accepted attempt in the context ``make_context`` gives it; ``on_slot`` is called
    when one ends (a slot is free).
    """

    def __init__(
        self,
        name: str,
        session: str,
        concurrency: int,
        make_context: MakeContext,
        run_one: RunOne,
        on_slot: Callable[[], None],
    ) -> None:
        self.name = name
        self.session = session
        self.concurrency = concurrency
        self._make_context = make_context
        self._run_one = run_one
        self._on_slot = on_slot
        self.running: dict[str, Running] = {}
        self.waiting: list[Lease] = []  # leases pushed beyond the free slots
        #: Slots asked for in requests under way.
        self.asking = 0
        #: Leases refused: granted to another executor or process, or run here already.
        self.refused_leases = 0
        self._ran: OrderedDict[tuple[str, int], None] = OrderedDict()  # attempts started here

    def free(self) -> int:
        """Slots neither running nor asked for."""
        return self.concurrency - len(self.running) - self.asking

    def busy(self) -> bool:
        """Whether anything runs or waits for a slot."""
        return bool(self.running or self.waiting)

    def contexts(self) -> list[ActionContext]:
        """Contexts of the attempts running now."""
        return [r.ctx for r in self.running.values()]

    def tasks(self) -> list[asyncio.Task[None]]:
        """Tasks of the attempts running now."""
        return [r.task for r in self.running.values()]

    def refused(self, lease: Lease) -> str | None:
        """Why ``lease`` may not run here (None: it may)."""
        last = lease.action.attempts[-1] if lease.action.attempts else None
        if last is None or not last.open:
            return "it holds no open attempt"
        if last.executor != self.name or last.session != self.session:
            return f"it was granted to {last.executor!r} (process {last.session or '?'}), not to this one"
        if (lease.id, last.number) in self._ran:
            return f"attempt {last.number} already ran here"
        return None

    def start(self, lease: Lease) -> None:
        """Run ``lease`` now, keep it for a free slot, or refuse it (counted, logged)."""
        if lease.id in self.running or any(x.id == lease.id for x in self.waiting):
            return  # a duplicate of what runs or waits
        why = self.refused(lease)
        if why is not None:
            self.refused_leases += 1
            _log.warning("%s: refused a lease on action %s: %s", self.name, lease.id, why)
            return
        if len(self.running) >= self.concurrency:
            self.waiting.append(lease)  # pushed beyond the free slots: runs when one frees
            return
        self._ran[(lease.id, lease.attempt)] = None
        while len(self._ran) > RAN_REMEMBERED:
            self._ran.popitem(last=False)
        ctx = self._make_context(lease)
        task = asyncio.create_task(self._run_one(ctx))
        self.running[lease.id] = Running(ctx, task)
        task.add_done_callback(partial(self._ended, lease.id))

    def _ended(self, action_id: str, _task: asyncio.Task[None]) -> None:
        self.running.pop(action_id, None)
        while self.waiting and len(self.running) < self.concurrency:
            self.start(self.waiting.pop(0))
        self._on_slot()

    async def renew(self, link: WorkerLink) -> None:
        """Renew every lease held; tell handlers whose lease was taken back or canceled.

        Raises:
            QueueUnavailable: The queue did not answer.
        """
        contexts = [ctx for ctx in self.contexts() if not ctx.lost]
        leases = [ctx.lease for ctx in contexts] + list(self.waiting)
        if not leases:
            return
        sent = time.monotonic()
        renewal = await link.renew(leases)
        for ctx in contexts:
            if ctx.lease.id not in self.running:
                continue  # it ended while the renewal was under way
            if ctx.lease.id in renewal.lost:
                ctx.lost = True
                ctx.cancelled.set()
                _log.warning(
                    "%s: the queue took action %s (attempt %d) back; its handler is told to stop",
                    self.name,
                    ctx.lease.id,
                    ctx.lease.attempt,
                )
                continue
            ctx.confirmed_mono = sent
            if ctx.lease.id in renewal.canceled:
                ctx.cancelled.set()
        self.waiting = [x for x in self.waiting if x.id not in renewal.lost]
