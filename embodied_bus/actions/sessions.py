"""Ordered sessions in the SQLite queue: the steps of a session start in submission order, one
at a time, on any executor of their kind.

A step *gates* its session while it has not ended (or was dead-lettered in a session that holds,
:attr:`~embodied_bus.actions.model.SessionFailure.HOLD`); a step submitted while an earlier step
gates is *blocked*: the dispatch query passes it over. Whenever a transaction writes a step,
before it commits, the session's first gating step is unblocked (it is the session's head), and
the waiting steps after a step dead-lettered with ``on_failure=cancel`` end canceled with the
reason. A session costs its steps' rows and an index entry each: no table or topic of its own.
"""

from __future__ import annotations

import sqlite3

from embodied_bus.actions.model import Action, ActionStatus, SessionFailure, decode_action
from embodied_bus.actions.table import ActionTable

__all__ = ["Sessions"]

_WAITING = (ActionStatus.QUEUED.value, ActionStatus.RETRYING.value)


class Sessions:
    """The session rules of one :class:`ActionTable` (installed as its ``before_commit``).

    Attributes:
        ended: Steps these rules ended (canceled after a dead step), for their results to be
            published; taken with :meth:`take_ended`.
        unblocked: Kinds of steps that became their session's head, for their executors to be
            woken; taken with :meth:`take_unblocked`.
    """

    def __init__(self, table: ActionTable) -> None:
        self.table = table
        self.ended: list[Action] = []
        self.unblocked: set[str] = set()
        table.before_commit = self.settle

    @staticmethod
    def waits(db: sqlite3.Connection, session: str | None) -> bool:
        """Whether a step submitted to ``session`` now must wait for an earlier one."""
        if session is None:
            return False
        return (
            db.execute("SELECT 1 FROM actions WHERE session=? AND gate=1 LIMIT 1", (session,)).fetchone()
            is not None
        )

    def settle(self, db: sqlite3.Connection) -> None:
        """Apply the rules to every session the transaction wrote (until nothing changes)."""
        while self.table.dead_steps or self.table.touched:
            while self.table.dead_steps:
                self._cancel_after(db, self.table.dead_steps.pop())
            while self.table.touched:
                self._unblock_head(db, self.table.touched.pop())

    def _cancel_after(self, db: sqlite3.Connection, dead: Action) -> None:
        if dead.on_failure is not SessionFailure.CANCEL or dead.status is not ActionStatus.DEAD:
            return
        row = db.execute("SELECT seq FROM actions WHERE id=?", (dead.id,)).fetchone()
        if row is None:
            return
        last = dead.attempts[-1].reason if dead.attempts else "no attempt left"
        why = f"step {dead.id} ({dead.kind}) of session {dead.session!r} was dead-lettered: {last}"
        later = db.execute(
            "SELECT body FROM actions WHERE session=? AND seq>? AND status IN (?, ?) ORDER BY seq",
            (dead.session, row[0], *_WAITING),
        ).fetchall()
        for (body,) in later:
            a = decode_action(body)
            a.status = ActionStatus.CANCELED
            a.ended_reason = why
            self.table.save(a)
            db.execute("UPDATE actions SET blocked=0 WHERE id=?", (a.id,))
            self.ended.append(a)

    def _unblock_head(self, db: sqlite3.Connection, session: str) -> None:
        head = db.execute(
            "SELECT id, kind, blocked FROM actions WHERE session=? AND gate=1 ORDER BY seq LIMIT 1",
            (session,),
        ).fetchone()
        if head is not None and head[2]:
            db.execute("UPDATE actions SET blocked=0 WHERE id=?", (head[0],))
            self.unblocked.add(head[1])

    def take_ended(self) -> list[Action]:
        """Steps ended by the rules since the last call."""
        out, self.ended = self.ended, []
        return out

    def take_unblocked(self) -> set[str]:
        """Kinds of steps that became their session's head since the last call."""
        out, self.unblocked = self.unblocked, set()
        return out
