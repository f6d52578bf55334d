"""The life of an action, decided once for every backend.

Each function takes an :class:`~embodied_bus.actions.model.Action` (changed in place), the time
in UTC ns and, where retries matter, the :class:`~embodied_bus.actions.policy.RetryPolicy`. The
SQLite store behind the Zenoh queue service, the Pulsar backend and the in-memory backend all
call these, so a rule changed here holds everywhere::

    submitted ─► QUEUED ─admit─► RUNNING ─succeed─► SUCCEEDED
                   ▲  │ expire      │ fail / lose ─► RETRYING ─(backoff)─► admit again
                   │  ▼             │             └► DEAD (permanent, or attempts exhausted)
         requeue ──┴─ DEAD          └ cancel flag ─► CANCELED (when the handler ends)
                   └─ cancel while waiting ─► CANCELED

An attempt is closed as ``lost`` only by :func:`lose`, which a backend calls when the attempt's
executor is gone (its process died, or its liveness expired); a redelivery alone never closes
an attempt whose executor is alive (:attr:`Admission.HELD`).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from embodied_bus.actions.model import Action, ActionStatus, Attempt, Outcome, SessionFailure
from embodied_bus.actions.policy import RetryPolicy

__all__ = [
    "EXPIRED_REASON",
    "Admission",
    "Decision",
    "Version",
    "admit",
    "cancel",
    "expire",
    "fail",
    "gates",
    "is_newer",
    "late_report",
    "lose",
    "now_ns",
    "requeue",
    "start",
    "succeed",
    "version",
]

#: Reason recorded for an action whose deadline passed before it started.
EXPIRED_REASON = "deadline passed before the action started"


def now_ns() -> int:
    """The current UTC time, ns."""
    return time.time_ns()


class Admission(enum.Enum):
    """What an executor may do with an action offered to it."""

    #: Run it: call :func:`start`.
    START = "start"
    #: It ended already (a duplicate delivery): drop the offer.
    ENDED = "ended"
    #: An attempt is open on a live executor: never start a second run.
    HELD = "held"
    #: Its deadline passed: :func:`expire` dead-lettered it.
    EXPIRED = "expired"
    #: A cancel came while it waited: :func:`admit` ended it as canceled.
    CANCELED = "canceled"
    #: No attempt is left (the last one was lost): dead-lettered.
    EXHAUSTED = "exhausted"
    #: This executor does not run its kind or match its selector.
    NOT_FOR_ME = "not_for_me"
    #: This executor failed it before and another live executor that has not can retry it.
    ELSEWHERE = "elsewhere"


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a failed or lost attempt leaves an action.

    Attributes:
        status: RETRYING, DEAD or CANCELED.
        retry_after_s: Backoff before the next attempt, seconds (RETRYING only).
    """

    status: ActionStatus
    retry_after_s: float = 0.0


def admit(
    a: Action,
    executor: str,
    *,
    kinds: Collection[str],
    labels: Mapping[str, str],
    policy: RetryPolicy,
    holder_gone: Callable[[Attempt], bool],
    others_fresh: Callable[[Action], bool],
    now: int,
) -> Admission:
    """Decide whether ``executor`` may start ``a`` now.

    Args:
        kinds: What the executor runs.
        labels: The executor's labels (an action's selector must match them all).
        holder_gone: Whether the executor of an open attempt is surely gone (died or its liveness
            expired); an open attempt whose holder may be alive is never taken over.
        others_fresh: Whether another live executor that has not failed ``a`` could run it (asked
            only when this executor failed it before).
        now: UTC ns.

    A lost holder's attempt is closed here (:func:`lose`); an expired, canceled or exhausted
    action is ended here. The caller persists ``a`` for every answer but ENDED, HELD,
    NOT_FOR_ME and ELSEWHERE, and calls :func:`start` on START. An attempt found lost here is
    retried at once (no backoff): its executor was gone for a whole liveness window already.
    """
    if a.status.terminal:
        return Admission.ENDED
    held = a.open_attempt
    if held is not None:
        if not holder_gone(held):
            return Admission.HELD
        lose(a, policy, now)
        if a.status.terminal:
            return Admission.CANCELED if a.status is ActionStatus.CANCELED else Admission.EXHAUSTED
    if a.cancel_requested:
        a.status = ActionStatus.CANCELED
        return Admission.CANCELED
    if a.deadline_ns and a.deadline_ns < now:
        expire(a, now)
        return Admission.EXPIRED
    if policy.exhausted(a.attempt_count - a.budget_from):
        a.status = ActionStatus.DEAD
        return Admission.EXHAUSTED
    if a.kind not in kinds or any(labels.get(k) != v for k, v in a.selector.items()):
        return Admission.NOT_FOR_ME
    if executor in a.executors_tried() and others_fresh(a):
        return Admission.ELSEWHERE
    return Admission.START


def start(a: Action, executor: str, session: str, now: int) -> Attempt:
    """Begin a new attempt of ``a`` on ``executor`` (process ``session``); returns it."""
    attempt = Attempt(a.attempt_count + 1, executor, now, session=session)
    a.attempts.append(attempt)
    a.status = ActionStatus.RUNNING
    return attempt


def _close(a: Action, outcome: Outcome, reason: str, now: int) -> None:
    a.attempts[-1] = a.attempts[-1].ended(now, outcome, reason)


def succeed(a: Action, result: object, now: int) -> None:
    """The handler returned ``result``: succeeded (canceled if a cancel was asked for and the
    handler returned nothing)."""
    _close(a, Outcome.OK, "", now)
    a.result = result
    a.status = ActionStatus.CANCELED if a.cancel_requested and result is None else ActionStatus.SUCCEEDED


def _after_failure(a: Action, policy: RetryPolicy, now: int, *, permanent: bool) -> Decision:
    if a.cancel_requested:
        a.status = ActionStatus.CANCELED
    elif permanent or policy.exhausted(a.attempt_count - a.budget_from):
        a.status = ActionStatus.DEAD
    else:
        a.status = ActionStatus.RETRYING
        return Decision(a.status, policy.backoff_s(a.attempt_count))
    return Decision(a.status)


def fail(a: Action, reason: str, policy: RetryPolicy, now: int, *, permanent: bool = False) -> Decision:
    """The handler raised: retry after a backoff, or dead-letter (permanent or exhausted)."""
    _close(a, Outcome.REJECTED if permanent else Outcome.NACK, reason, now)
    return _after_failure(a, policy, now, permanent=permanent)


def lose(a: Action, policy: RetryPolicy, now: int, *, reason: str = "") -> Decision:
    """The open attempt's executor is gone: the attempt counts as ``lost`` (``reason`` says why
    when it is not that the executor stopped answering)."""
    held = a.open_attempt
    who = held.executor if held is not None else "?"
    why = reason or f"executor {who} stopped answering (process died or its liveness expired)"
    _close(a, Outcome.LOST, why, now)
    return _after_failure(a, policy, now, permanent=False)


def expire(a: Action, now: int) -> None:
    """Dead-letter a waiting action whose deadline passed (it is never started)."""
    a.attempts.append(Attempt(a.attempt_count + 1, "", now, now, Outcome.EXPIRED.value, EXPIRED_REASON))
    a.status = ActionStatus.DEAD


def cancel(a: Action) -> bool:
    """Cancel ``a``: a waiting action ends at once (returns True), a running one is flagged for
    its handler (False); an ended one is left as it is (False)."""
    if a.status.terminal:
        return False
    a.cancel_requested = True
    if a.status is ActionStatus.RUNNING:
        return False
    a.status = ActionStatus.CANCELED
    return True


def requeue(a: Action, now: int) -> None:
    """A dead letter gets a fresh attempt budget (its history stays); a passed deadline is
    dropped."""
    a.status = ActionStatus.QUEUED
    if a.deadline_ns and a.deadline_ns < now:
        a.deadline_ns = 0
    a.budget_from = a.attempt_count
    a.cancel_requested = False


def late_report(a: Action, number: int, *, ok: bool, reason: str) -> bool:
    """Record what the executor of attempt ``number`` reported after that attempt had been
    closed as lost (it was cut off, not dead): the run stays in the history with what it did.
    Returns whether anything was recorded."""
    if not 0 < number <= len(a.attempts):
        return False
    t = a.attempts[number - 1]
    if t.outcome != Outcome.LOST.value or "reported later" in t.reason:
        return False
    what = "succeeded" if ok else f"failed: {reason}"
    a.attempts[number - 1] = Attempt(
        t.number,
        t.executor,
        t.started_ns,
        t.ended_ns,
        t.outcome,
        f"{t.reason}; reported later: {what}",
        t.session,
    )
    return True


class Version(NamedTuple):
    """How far an action's history has come; versions order as the history grows."""

    #: Attempts before this count against the retry budget no more (a requeue moves it).
    budget_from: int
    #: Attempts started.
    attempts: int
    #: Whether the last attempt ended.
    last_ended: bool


def version(a: Action) -> Version:
    """How far an action's history has come: budget, attempts, and whether the last one ended."""
    return Version(a.budget_from, len(a.attempts), not (a.attempts and a.attempts[-1].open))


def is_newer(new: Action, old: Action) -> bool:
    """Whether the snapshot ``new`` may replace ``old`` in a log of snapshots that several
    writers append to: a later history wins; of two that started the same attempt, the first
    one written stands (the later claim lost the race); an ended action stays ended."""
    if old.status.terminal and new.budget_from <= old.budget_from:
        return False  # ended stays ended, unless requeued from the dead letters
    v_new, v_old = version(new), version(old)
    if v_new != v_old:
        return v_new > v_old
    # a competing claim of the same attempt: the first one written wins
    return not (new.attempts and old.attempts and new.attempts[-1].session != old.attempts[-1].session)


_OPEN = frozenset({ActionStatus.QUEUED, ActionStatus.RUNNING, ActionStatus.RETRYING})


def gates(a: Action) -> bool:
    """Whether ``a`` keeps the later steps of its session waiting: it has not ended, or it was
    dead-lettered in a session that holds on failure (an action of no session gates nothing)."""
    if a.session is None:
        return False
    return a.status in _OPEN or (a.status is ActionStatus.DEAD and a.on_failure is SessionFailure.HOLD)
