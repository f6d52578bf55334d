"""Latest values per key in SQLite (WAL, fsync on commit): a put survives ``kill -9`` once
stored. Transport-free; the Zenoh state service serves it.

Every write of a table gets the next revision of that table (1, 2, ...), so a reader that
holds revision N asks for what came after it. A delete keeps a tombstone (its revision) for
readers that catch up; a full read leaves tombstones out.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path

from embodied_bus.state.model import StateEntry

__all__ = ["StateStore"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS state (
    tbl TEXT NOT NULL,
    key TEXT NOT NULL,
    data BLOB NOT NULL,
    is_json INTEGER NOT NULL,
    deleted INTEGER NOT NULL,
    stamp_ns INTEGER NOT NULL,
    revision INTEGER NOT NULL,
    PRIMARY KEY (tbl, key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS by_revision ON state(tbl, revision);
CREATE TABLE IF NOT EXISTS revisions (tbl TEXT PRIMARY KEY, revision INTEGER NOT NULL);
"""
_UPSERT = (
    "INSERT INTO state(tbl, key, data, is_json, deleted, stamp_ns, revision) VALUES (?,?,?,?,?,?,?) "
    "ON CONFLICT(tbl, key) DO UPDATE SET data=excluded.data, is_json=excluded.is_json, "
    "deleted=excluded.deleted, stamp_ns=excluded.stamp_ns, revision=excluded.revision"
)


class StateStore:
    """Every table of one namespace in one SQLite file; safe to call from several threads.

    Args:
        path: SQLite file (``:memory:`` for tests of pure logic).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(SCHEMA)
        self._lock = threading.Lock()
        self._revisions: dict[str, int] = dict(self.db.execute("SELECT tbl, revision FROM revisions"))

    def close(self) -> None:
        """Close the database."""
        with self._lock:
            self.db.close()

    def revision(self, table: str) -> int:
        """The revision of ``table``'s last write (0: never written)."""
        return self._revisions.get(table, 0)

    def put(self, table: str, entries: Sequence[StateEntry]) -> list[StateEntry]:
        """Store ``entries`` (puts and deletes, in order) in one durable transaction.

        Returns:
            The entries as stored, each with its revision.
        """
        with self._lock:
            first = self._revisions.get(table, 0) + 1
            stored = [e._replace(revision=first + i) for i, e in enumerate(entries)]
            rows = [
                (table, e.key, b"" if e.deleted else e.data, e.is_json, e.deleted, e.stamp_ns, e.revision)
                for e in stored
            ]
            last = first + len(stored) - 1
            self.db.execute("BEGIN IMMEDIATE")
            try:
                self.db.executemany(_UPSERT, rows)
                self.db.execute(
                    "INSERT INTO revisions(tbl, revision) VALUES (?, ?) "
                    "ON CONFLICT(tbl) DO UPDATE SET revision=excluded.revision",
                    (table, last),
                )
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self._revisions[table] = last
            return stored

    def since(self, table: str, revision: int) -> tuple[int, list[StateEntry]]:
        """``(table revision, entries)``: the latest entry of every key written after
        ``revision``, in revision order (tombstones included); with ``revision`` 0, every key
        that has a value (no tombstones)."""
        with self._lock:
            rows = self.db.execute(
                "SELECT key, data, is_json, deleted, stamp_ns, revision FROM state "
                "WHERE tbl=? AND revision>? " + ("" if revision else "AND deleted=0 ") + "ORDER BY revision",
                (table, revision),
            ).fetchall()
            current = self._revisions.get(table, 0)
        return current, [StateEntry(k, d, bool(j), s, bool(x), r) for k, d, j, x, s, r in rows]

    def tables(self) -> dict[str, int]:
        """Every table written so far, with its revision."""
        with self._lock:
            return dict(self._revisions)
