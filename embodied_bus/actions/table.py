"""The SQLite table an action store keeps its actions in (WAL, fsync on durable commits)."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from embodied_bus.actions.lifecycle import gates
from embodied_bus.actions.model import Action, ActionStatus, decode_action, encode_action

__all__ = ["UPDATE_ACTION", "ActionTable"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS actions (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    priority INTEGER NOT NULL,
    deadline_ns INTEGER NOT NULL,
    idem TEXT UNIQUE,
    status TEXT NOT NULL,
    available_ns INTEGER NOT NULL,
    lease_owner TEXT,
    lease_until_ns INTEGER,
    seq INTEGER NOT NULL,
    body TEXT NOT NULL,
    session TEXT,
    gate INTEGER NOT NULL DEFAULT 0,
    blocked INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS deadlines ON actions(deadline_ns) WHERE deadline_ns > 0;
CREATE INDEX IF NOT EXISTS submitted ON actions(seq);
"""
#: Indexes on the session columns (made after a file of an older layout got its columns).
SESSION_SCHEMA = """
DROP INDEX IF EXISTS ready;
CREATE INDEX IF NOT EXISTS ready_steps ON actions(status, blocked, priority DESC, seq);
CREATE INDEX IF NOT EXISTS steps ON actions(session, seq) WHERE session IS NOT NULL;
"""
_SESSION_COLUMNS = (
    "ALTER TABLE actions ADD COLUMN session TEXT",
    "ALTER TABLE actions ADD COLUMN gate INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE actions ADD COLUMN blocked INTEGER NOT NULL DEFAULT 0",
)
#: Writes an action's row (status, body, lease) from :meth:`ActionTable.update_params`.
UPDATE_ACTION = (
    "UPDATE actions SET status=?, body=?, available_ns=COALESCE(?, available_ns), lease_owner=?, "
    "lease_until_ns=?, deadline_ns=?, gate=? WHERE id=?"
)


class ActionTable:
    """One SQLite file of actions, with the envelopes and leases the last writes made.

    Args:
        path: SQLite file (``:memory:`` for tests of pure logic).
    """

    def __init__(self, path: str) -> None:
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(SCHEMA)
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(actions)")}
        if "session" not in columns:  # a file written before actions had sessions
            for statement in _SESSION_COLUMNS:
                self.db.execute(statement)
        self.db.executescript(SESSION_SCHEMA)
        #: Sessions whose steps the current transaction wrote, and the session steps it
        #: dead-lettered; :attr:`before_commit` settles what follows for their sessions.
        self.touched: set[str] = set()
        self.dead_steps: list[Action] = []
        #: Called with the connection before each commit (the store's session rules).
        self.before_commit: Callable[[sqlite3.Connection], None] | None = None
        #: Envelopes written by the current (or last) transaction, by action id: replies and
        #: result notifications reuse them instead of encoding the same action again.
        self.saved: dict[str, bytes] = {}
        #: Running actions as they were last written, with their lease owner: a report or a
        #: checkpoint finds its action here instead of reading and decoding it again. Every
        #: other write of an action drops it from here; a rolled back transaction clears it.
        self.leased: dict[str, tuple[Action, str]] = {}

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def tx(self, *, durable: bool = True) -> Iterator[sqlite3.Connection]:
        """One write transaction: committed on success, rolled back on error.

        ``durable`` transactions (submit, cancel, requeue: what a planner was told is done) are
        fsynced at commit. Execution bookkeeping (lease, renew, checkpoint, reports, sweeps) is
        not: in WAL mode it survives a process crash (``kill -9``) as it is and reaches the disk
        with the next durable commit; after a power loss the last of it can be lost, so an
        action can run again (at least once; idempotency keys make effects happen once).
        """
        self.db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
        self.saved.clear()
        self.db.execute("BEGIN IMMEDIATE")
        self.touched.clear()
        self.dead_steps.clear()
        try:
            yield self.db
            if self.touched and self.before_commit is not None:
                self.before_commit(self.db)
        except BaseException:
            self.db.execute("ROLLBACK")
            self.leased.clear()
            raise
        self.db.execute("COMMIT")

    def update_params(
        self, a: Action, available_ns: int | None = None, lease: tuple[str, int] | None = None
    ) -> tuple[Any, ...]:
        """Parameters of :data:`UPDATE_ACTION` for ``a`` (``lease``: owner and until, ns)."""
        body = self.saved[a.id] = encode_action(a)
        if a.session is not None:
            self.touched.add(a.session)
            if a.status is ActionStatus.DEAD:
                self.dead_steps.append(a)
        if lease is not None:
            self.leased[a.id] = (a, lease[0])
        else:
            self.leased.pop(a.id, None)
        return (
            a.status.value,
            body.decode(),
            available_ns,
            lease[0] if lease else None,
            lease[1] if lease else None,
            a.deadline_ns,
            gates(a),
            a.id,
        )

    def save(
        self, a: Action, *, available_ns: int | None = None, lease: tuple[str, int] | None = None
    ) -> None:
        """Write ``a`` (its lease, or none)."""
        self.db.execute(UPDATE_ACTION, self.update_params(a, available_ns, lease))

    def save_held(self, a: Action) -> None:
        """Write a running action's body, keeping its lease."""
        self.saved[a.id] = body = encode_action(a)
        self.db.execute("UPDATE actions SET body=? WHERE id=?", (body.decode(), a.id))

    def encoded(self, a: Action) -> bytes:
        """The JSON envelope of ``a`` as the last transaction stored it (encoded now if it
        did not store it)."""
        body = self.saved.get(a.id)
        return body if body is not None else encode_action(a)

    def load(self, action_id: str) -> Action | None:
        row = self.db.execute("SELECT body FROM actions WHERE id=?", (action_id,)).fetchone()
        return decode_action(row[0]) if row else None
