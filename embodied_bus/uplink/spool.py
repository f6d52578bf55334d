"""The uplink's store-and-forward buffer: samples waiting for the link, on disk.

One SQLite file (WAL). Items leave in class order (class 0 first), and in arrival order within
a class, so a stream's samples stay in order and, when the link returns, what matters most goes
first. Past the size limit the oldest items of the lowest class (the highest class number) are
dropped, and counted per stream; the limit counts what waits (a batch being sent is on top).
An item stays until the far side has it: :meth:`Spool.take` hands it out without removing it,
:meth:`Spool.remove` forgets it once it was delivered; after a crash of the uplink what was
taken but not removed is sent again (the far side's sequence tracking drops the copies).
"""

from __future__ import annotations

import sqlite3
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Spool", "SpoolFullError", "Spooled"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS items (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    class INTEGER NOT NULL,
    stream TEXT NOT NULL,
    header BLOB NOT NULL,
    payload BLOB NOT NULL,
    size INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS items_by_class ON items (class, id);
"""


class SpoolFullError(Exception):
    """One item is larger than the whole spool."""


@dataclass(frozen=True, slots=True)
class Spooled:
    """One buffered sample: its wire header and payload, as it came off the robot's bus."""

    id: int
    cls: int
    stream: str
    header: bytes
    payload: bytes

    @property
    def size(self) -> int:
        return len(self.header) + len(self.payload)


class Spool:
    """A bounded, ordered, on-disk buffer (``limit_bytes`` of payload and header)."""

    def __init__(self, path: str | Path, limit_bytes: int) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"spool limit must be positive, got {limit_bytes} bytes")
        self.path = Path(path)
        self.limit_bytes = limit_bytes
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # a crashed process loses nothing
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()
        row = self._db.execute("SELECT COALESCE(SUM(size), 0), COUNT(*) FROM items").fetchone()
        self._bytes, self._items = int(row[0]), int(row[1])
        self._taken: dict[int, int] = {}  # handed out, not yet removed: id -> size
        #: Items dropped because the spool was full, per stream.
        self.dropped: Counter[str] = Counter()

    @property
    def size_bytes(self) -> int:
        """Bytes buffered now."""
        return self._bytes

    def __len__(self) -> int:
        return self._items

    def put_many(self, items: list[tuple[int, str, bytes, bytes]]) -> None:
        """Buffer ``(class, stream, header, payload)`` items in this order; then drop the oldest
        items of the lowest class until the spool fits its limit.

        Raises:
            SpoolFullError: An item alone is larger than the limit (nothing is buffered).
        """
        rows = [(c, s, h, p, len(h) + len(p)) for c, s, h, p in items]
        for _, stream, _, _, size in rows:
            if size > self.limit_bytes:
                raise SpoolFullError(
                    f"a sample of {stream!r} ({size} bytes) is larger than the whole spool "
                    f"({self.limit_bytes} bytes)"
                )
        with self._lock:
            with self._db:
                self._db.execute("BEGIN")
                self._db.executemany(
                    "INSERT INTO items (class, stream, header, payload, size) VALUES (?, ?, ?, ?, ?)", rows
                )
            self._bytes += sum(r[4] for r in rows)
            self._items += len(rows)
            if self._waiting_bytes() > self.limit_bytes:
                self._evict()

    def _waiting_bytes(self) -> int:
        return self._bytes - sum(self._taken.values())

    def _evict(self) -> None:
        """Drop the oldest waiting items of the lowest class until what waits fits."""
        with self._db:
            self._db.execute("BEGIN")
            waiting = self._waiting_bytes()
            while waiting > self.limit_bytes:
                lowest = self._db.execute("SELECT MAX(class) FROM items").fetchone()[0]
                if lowest is None:
                    break
                victims = self._db.execute(
                    "SELECT id, stream, size FROM items WHERE class = ? ORDER BY id LIMIT 256", (lowest,)
                ).fetchall()
                victims = [v for v in victims if v[0] not in self._taken]
                if not victims:  # all handed out: the next class up
                    victims = self._db.execute(
                        "SELECT id, stream, size FROM items WHERE class < ? "
                        "ORDER BY class DESC, id LIMIT 256",
                        (lowest,),
                    ).fetchall()
                    victims = [v for v in victims if v[0] not in self._taken]
                    if not victims:
                        break
                gone: list[tuple[int]] = []
                for item_id, stream, size in victims:
                    if waiting <= self.limit_bytes:
                        break
                    gone.append((item_id,))
                    waiting -= size
                    self._bytes -= size
                    self._items -= 1
                    self.dropped[stream] += 1
                self._db.executemany("DELETE FROM items WHERE id = ?", gone)

    def take(self, max_items: int, max_bytes: int) -> list[Spooled]:
        """The next items to send: the oldest of the first class waiting, in arrival order, at
        most ``max_items`` and about ``max_bytes`` (at least one), never two classes at once (a
        class is delivered before the next is sent); they stay buffered until :meth:`remove`."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id, class, stream, header, payload, size FROM items ORDER BY class, id LIMIT ?",
                (max_items + len(self._taken),),
            ).fetchall()
            out: list[Spooled] = []
            total = 0
            for item_id, cls, stream, header, payload, size in rows:
                if item_id in self._taken:
                    continue
                if out and (len(out) >= max_items or total + size > max_bytes or cls != out[0].cls):
                    break
                out.append(Spooled(item_id, cls, stream, header, payload))
                total += size
            self._taken.update((s.id, s.size) for s in out)
            return out

    def give_back(self, items: list[Spooled]) -> None:
        """Items taken but not delivered: they are sent again, in their place."""
        with self._lock:
            for s in items:
                self._taken.pop(s.id, None)

    def remove(self, items: list[Spooled]) -> None:
        """Forget delivered items."""
        with self._lock:
            mine = [s for s in items if s.id in self._taken]  # taken items are never evicted
            with self._db:
                self._db.execute("BEGIN")
                self._db.executemany("DELETE FROM items WHERE id = ?", [(s.id,) for s in mine])
            self._bytes -= sum(s.size for s in mine)
            self._items -= len(mine)
            for s in mine:
                del self._taken[s.id]

    def close(self) -> None:
        with self._lock:
            self._db.close()
