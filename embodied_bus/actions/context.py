"""What a handler gets besides its action: progress, checkpoints, cancel, and whether it still
holds the action."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Protocol

from embodied_bus.actions.model import Action
from embodied_bus.actions.queue import LEASE_S, Lease

__all__ = ["OWNER_WINDOW_S", "ActionContext", "ContextPort"]

#: A lease counts as held for this long after the queue last confirmed it, seconds: less than
#: the queue's lease (:data:`~embodied_bus.actions.queue.LEASE_S`), which starts later (when the
#: confirmation arrives there), so an executor that can no longer reach the queue stops
#: believing it holds the action before the queue hands it to another executor.
OWNER_WINDOW_S = 0.8 * LEASE_S


class ContextPort(Protocol):
    """What a context asks of its executor's link to the queue."""

    def queue_reachable(self) -> bool:
        """Whether the queue can be reached now."""
        ...

    def send_feedback(self, lease: Lease, data: bytes) -> None:
        """Feedback of a running attempt (best effort, never blocks)."""
        ...

    async def save_checkpoint(self, ctx: ActionContext, state: Any) -> None:
        """Save a checkpoint now, or when the queue is back."""
        ...


class ActionContext:
    """Passed to a handler with its action.

    Attributes:
        action: The action (its last attempt is this one).
        executor: Name of the executor running it.
        attempt: 1 for the first try.
        fencing_token: Grows with every attempt of this action: give it to actuators and
            services that can refuse commands carrying an older token than one they have seen
            (a run that lost its lease cannot then overrule the run that took over).
        previous_checkpoint: The last checkpoint of an earlier attempt (None on a fresh start).
        cancelled: Set when the planner cancels the action, or when this executor learns that
            its lease was taken back (see :meth:`still_owner`).
    """

    def __init__(self, port: ContextPort, executor: str, lease: Lease) -> None:
        self._port = port
        self.lease = lease
        self.action: Action = lease.action
        self.executor = executor
        self.attempt = lease.attempt
        self.fencing_token = lease.attempt
        self.previous_checkpoint = lease.action.checkpoint
        self.cancelled = asyncio.Event()
        #: The queue took the lease back (it closed this attempt): another run may have begun.
        self.lost = False
        #: When the queue last confirmed this lease (``time.monotonic()``): at first, when it was
        #: granted (the attempt's start, on the queue's clock: a lease that waited on its way, in
        #: a partition or behind full slots, arrives already old).
        granted_ns = lease.action.attempts[-1].started_ns if lease.action.attempts else 0
        age_s = (time.time_ns() - granted_ns) / 1e9
        self.confirmed_mono = time.monotonic() - (age_s if 0 <= age_s < 3600 else 3600.0)
        #: A checkpoint saved while the queue was away, sent when it is back.
        self.pending_checkpoint: Any = None
        self.has_pending_checkpoint = False

    def still_owner(self) -> bool:
        """Whether this run still holds its action: the queue confirmed the lease less than
        :data:`OWNER_WINDOW_S` ago and can be reached now, and did not take it back.

        False while the queue service or the broker is away, or the executor is cut off from
        it: the action may then be handed to another executor (only once the lease has
        expired there). Check it before every step that must not happen twice (and stop, or
        wait for it to come back), and pass :attr:`fencing_token` to what you command.
        """
        if self.lost:
            return False
        fresh = time.monotonic() - self.confirmed_mono < OWNER_WINDOW_S
        return fresh and self._port.queue_reachable()

    def feedback(self, data: Any) -> None:
        """Send progress to the planner (JSON-compatible; best effort, never blocks)."""
        self._port.send_feedback(self.lease, json.dumps(data).encode())

    async def checkpoint(self, state: Any) -> None:
        """Save resumable progress durably; a retry elsewhere starts from it. While the queue is
        away the latest checkpoint waits and is saved when it is back."""
        await self._port.save_checkpoint(self, state)
