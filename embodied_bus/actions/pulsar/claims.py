"""Claims an executor wrote to the Pulsar state log but could not read back.

An executor starts an action by writing a claim to the state log and reading it back; it runs
the action only if its claim is the one the log shows. When the broker that serves the log dies
between the write and the read-back, the claim may be on the log although no handler runs it:
every other executor sees the attempt open on a live executor and never takes it over. Such a
claim is remembered here and, once the log can be read again, an attempt the log shows open for
it is closed as lost and the action retried at once, like any attempt whose executor is gone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from embodied_bus.actions import lifecycle
from embodied_bus.actions.model import Action, ActionStatus

if TYPE_CHECKING:
    from embodied_bus.actions.pulsar.connection import QueueConnection

__all__ = ["DoubtfulClaims"]

_log = logging.getLogger("embodied_bus.actions.pulsar")

#: The reason written on an attempt whose claim was never read back.
NEVER_STARTED = "its claim could not be read back (the Pulsar broker went away): never started"


@dataclass(frozen=True, slots=True)
class _Claim:
    attempt: int
    reply_to: str


class DoubtfulClaims:
    """Claims of this executor process (``session``) that may stand on the log unrun."""

    def __init__(self, session: str) -> None:
        self._session = session
        self._claims: dict[str, _Claim] = {}

    def __len__(self) -> int:
        return len(self._claims)

    def add(self, a: Action, reply_to: str) -> None:
        """``a`` carries the attempt whose claim was written, or maybe written, but not read back."""
        self._claims[a.id] = _Claim(a.attempts[-1].number, reply_to)

    async def resolve(
        self,
        q: QueueConnection,
        busy: Callable[[str], bool],
        settle: Callable[[Action, Sequence[Any], str], Awaitable[None]],
    ) -> None:
        """Close what the log shows open for a remembered claim; ``busy(action_id)`` says this
        process works on the action again (left for later); ``settle`` ends an action that has
        no attempt left. Raises :class:`~embodied_bus.actions.queue.QueueUnavailable` while the
        log cannot be read (the claims stay for the next call)."""
        if not self._claims:
            return
        await q.state.caught_up(time.monotonic())
        for action_id, claim in list(self._claims.items()):
            if busy(action_id):
                continue
            with q.state.peek(action_id) as view:
                held = view.open_attempt if view is not None else None
                mine = held is not None and held.session == self._session and held.number == claim.attempt
                a = view.copy() if view is not None and mine else None
            if a is not None:
                decision = lifecycle.lose(a, q.policy_for(a), time.time_ns(), reason=NEVER_STARTED)
                _log.warning("action %s: attempt %d %s", action_id, claim.attempt, NEVER_STARTED)
                if decision.status is ActionStatus.RETRYING:
                    await q.enqueue(a, claim.reply_to)  # the message first, as for any retry
                    await q.state.publish(a)
                else:
                    await settle(a, [], claim.reply_to)
            del self._claims[action_id]
