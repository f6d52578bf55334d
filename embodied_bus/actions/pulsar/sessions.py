"""Ordered sessions on Pulsar: only a session's next step is on a priority topic.

A step submitted while an earlier step of its session has not ended is written to the state
log only. Whoever ends a step (the executor that settles it, the planner that cancels or purges
it) reads the log up to its own record and then *advances* the session: it cancels the waiting
steps after a step dead-lettered with ``on_failure=cancel``, and puts the session's next step on
its priority topic with a :attr:`~embodied_bus.actions.pulsar.records.Event.RELEASE` record.
The log orders the steps (the order it first showed them), so every view agrees on which step
is next. Two parties that advance a session at once put its next step on the topic twice; its
executors run it once (a claim stands only if it is the first on the log). A step left waiting
by a party that died before advancing is released by the executors' sweep
(:data:`STRANDED_S`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from embodied_bus.actions import lifecycle
from embodied_bus.actions.model import Action, ActionStatus, SessionFailure, encode_action
from embodied_bus.actions.pulsar.records import Event
from embodied_bus.actions.queue import QueueUnavailable

if TYPE_CHECKING:
    from embodied_bus.actions.pulsar.connection import QueueConnection
    from embodied_bus.actions.pulsar.statelog import StateLog

__all__ = ["STRANDED_S", "StrandedSteps", "advance", "advance_after", "waits_in_session"]

_log = logging.getLogger("embodied_bus.actions.pulsar")
#: An executor releases a session's next step that has waited unreleased this long, seconds.
STRANDED_S = 3.0
_WAITING = (ActionStatus.QUEUED, ActionStatus.RETRYING)


async def advance(q: QueueConnection, session: str, reply_to: str, *, died: Action | None = None) -> None:
    """Apply the session's rules to what the view shows now (the caller has read the log up to
    its own last record of the session): ``died``, a step just dead-lettered, cancels the
    waiting steps after it (``on_failure=cancel``); the next step is released."""
    steps = q.state.session_steps(session)
    records: list[tuple[str, Event, bytes]] = []
    dead = died if died is not None and died.on_failure is SessionFailure.CANCEL else None
    if dead is not None and any(a.id == dead.id for a in steps):
        last = dead.attempts[-1].reason if dead.attempts else "no attempt left"
        why = f"step {dead.id} ({dead.kind}) of session {session!r} was dead-lettered: {last}"
        after = steps[[a.id for a in steps].index(dead.id) + 1 :]
        for a in after:
            if a.status in _WAITING and not a.attempts:
                lifecycle.cancel(a)
                a.ended_reason = why
                records.append((a.id, Event.SNAPSHOT, encode_action(a)))
        steps = [a for a in steps if a.status not in (ActionStatus.CANCELED,)]
    head = next((a for a in steps if lifecycle.gates(a)), None)
    if (
        head is not None
        and head.status is ActionStatus.QUEUED
        and not head.attempts
        and head.id not in q.state.released
    ):
        # the message first: a released step always has one
        await q.enqueue(head, q.state.routes.get(head.id, reply_to))
        records.append((head.id, Event.RELEASE, b""))
    if records:
        await q.state.enqueue(records)


async def advance_after(q: QueueConnection, logged: Any, sessions: dict[str, str]) -> None:
    """Advance ``sessions`` (session -> a reply topic) once the log is read up to ``logged``
    (the message of the steps that ended); a session this process cannot advance now is
    released by an executor's sweep."""
    try:
        await q.state.read_back(logged)
        await asyncio.gather(*(advance(q, s, reply_to) for s, reply_to in sessions.items()))
    except QueueUnavailable as err:
        _log.debug("sessions %s not advanced here: %s", sorted(sessions)[:3], err)


def waits_in_session(view: StateLog, a: Action) -> bool:
    """Whether a step before ``a`` in its session still gates it (a message of a step that is
    not its session's next: a duplicate, or a step whose predecessor was requeued)."""
    for step in view.session_steps(a.session or ""):
        if step.id == a.id:
            return False
        if lifecycle.gates(step):
            return True
    return False


class StrandedSteps:
    """Releases a session's next step that stayed unreleased for :data:`STRANDED_S` (the party
    that ended the step before it died before it released this one)."""

    #: How often the view is looked through, seconds.
    CHECK_S = 1.0

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}  # session -> when its next step was seen unreleased
        self._next_check = 0.0

    async def check(self, q: QueueConnection) -> None:
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + self.CHECK_S
        waiting = set(q.state.unreleased_heads())
        for session in [s for s in self._seen if s not in waiting]:
            del self._seen[session]
        for session in waiting:
            if now - self._seen.setdefault(session, now) >= STRANDED_S:
                del self._seen[session]
                _log.info("releasing the next step of session %r (nobody did)", session)
                await advance(q, session, "")
