"""A durable action queue in SQLite (WAL, fsync on commit): an acknowledged submit survives
``kill -9``. Transport-free: the Zenoh queue service serves it over queryables.

Dispatch order: highest priority first, FIFO within a priority. Deadlines are checked at lease
time: an action past its deadline is never started, it is dead-lettered as expired. Attempts
are counted here (leases that expire count as ``lost`` attempts), not by any broker.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from embodied_bus.actions.model import (
    Action,
    ActionError,
    ActionStatus,
    Attempt,
    decode_action,
    encode_action,
)
from embodied_bus.actions.policy import DEFAULT_RETRY, RetryPolicy

__all__ = ["DEFAULT_KEEP_ENDED", "ActionStore"]

_SCHEMA = """
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
    body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS ready ON actions(status, priority DESC, seq);
CREATE INDEX IF NOT EXISTS deadlines ON actions(deadline_ns) WHERE deadline_ns > 0;
CREATE INDEX IF NOT EXISTS submitted ON actions(seq);
"""
#: Ended actions (succeeded or canceled) a store keeps by default: the newest by submit order
#: (as many as a Pulsar state-log view keeps in memory, ``VIEW_ENDED_LIMIT``). Dead letters
#: are kept until requeued or purged. Without a bound a robot's queue file grows for good
#: (10 actions/s fill 26 million rows a month).
DEFAULT_KEEP_ENDED = 100_000
#: Most rows one pruning transaction deletes (a larger excess goes in several, so the queue
#: is never held up for long).
PRUNE_CHUNK = 5_000
_PRUNABLE = (ActionStatus.SUCCEEDED.value, ActionStatus.CANCELED.value)
_READY = (ActionStatus.QUEUED.value, ActionStatus.RETRYING.value)


def _now() -> int:
    return time.time_ns()


class ActionStore:
    """The queue's state on disk.

    Args:
        path: SQLite file (``:memory:`` for tests of pure logic).
        policy: Retry policy applied on nack and lost leases.
    """

    def __init__(
        self, path: str | Path, policy: RetryPolicy = DEFAULT_RETRY, *, keep_ended: int = DEFAULT_KEEP_ENDED
    ) -> None:
        if keep_ended < 0:
            raise ValueError(f"keep_ended must be >= 0, got {keep_ended}")
        self.path = str(path)
        self.policy = policy
        self.keep_ended = keep_ended
        #: Ended actions deleted by :meth:`prune` so far (this process).
        self.pruned = 0
        #: Attempts started on actions that had been started before (retries after a nack or a
        #: lost lease), since this store was opened.
        self.redeliveries = 0
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._newly_expired: list[Action] = []
        #: Envelopes written by the current (or last) transaction, by action id: replies and
        #: result notifications reuse them instead of encoding the same action again.
        self._saved: dict[str, bytes] = {}
        #: Running actions as this store last wrote them, with their lease owner: an ack or a
        #: checkpoint finds its action here instead of reading and decoding it again. Every
        #: other write of an action drops it from here; a rolled back transaction clears it.
        self._leased: dict[str, tuple[Action, str]] = {}
        (self._seq,) = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM actions").fetchone()

    def close(self) -> None:
        """Close the database."""
        self._db.close()

    # ------------------------------------------------------------------ helpers
    @contextmanager
    def _tx(self, *, durable: bool = True) -> Iterator[sqlite3.Connection]:
        """One write transaction: committed on success, rolled back on error.

        ``durable`` transactions (submit, cancel, requeue: what a planner was told is done) are
        fsynced at commit. Execution bookkeeping (lease, extend, checkpoint, ack, nack, sweeps)
        is not: in WAL mode it survives a process crash (``kill -9``) as it is and reaches the
        disk with the next durable commit; after a power loss the last of it can be lost, so an
        action can run again (at least once; idempotency keys make effects happen once).
        """
        self._db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
        self._saved.clear()
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            self._leased.clear()
            raise
        self._db.execute("COMMIT")

    _UPDATE = (
        "UPDATE actions SET status=?, body=?, available_ns=COALESCE(?, available_ns), lease_owner=?, "
        "lease_until_ns=? WHERE id=?"
    )

    def _update_params(
        self, a: Action, available_ns: int | None = None, lease: tuple[str, int] | None = None
    ) -> tuple[Any, ...]:
        body = self._saved[a.id] = encode_action(a)
        if lease is not None:
            self._leased[a.id] = (a, lease[0])
        else:
            self._leased.pop(a.id, None)
        return (
            a.status.value,
            body.decode(),
            available_ns,
            lease[0] if lease else None,
            lease[1] if lease else None,
            a.id,
        )

    def _save(
        self, a: Action, *, available_ns: int | None = None, lease: tuple[str, int] | None = None
    ) -> None:
        self._db.execute(self._UPDATE, self._update_params(a, available_ns, lease))

    def encoded(self, a: Action) -> bytes:
        """The JSON envelope of ``a`` as the last transaction stored it (encoded now if it
        did not store it)."""
        body = self._saved.get(a.id)
        return body if body is not None else encode_action(a)

    def _load(self, action_id: str) -> Action | None:
        row = self._db.execute("SELECT body FROM actions WHERE id=?", (action_id,)).fetchone()
        return decode_action(row[0]) if row else None

    # ------------------------------------------------------------------ planner side
    def submit(self, action: Action, now_ns: int | None = None) -> tuple[Action, bool]:
        """Store a new action (durably, before returning).

        Returns:
            The stored action and True if it is new, or the existing action with the same
            idempotency key and False.

        Raises:
            ActionError: The action is invalid.
        """
        return self.submit_many([action], now_ns)[0]

    def submit_many(self, actions: Sequence[Action], now_ns: int | None = None) -> list[tuple[Action, bool]]:
        """Store a batch atomically in one durable transaction (one fsync for the batch).

        Returns:
            Per action, as :meth:`submit`.

        Raises:
            ActionError: An action is invalid or its id exists; nothing of the batch is stored.
        """
        for action in actions:
            action.validate()
        now = now_ns if now_ns is not None else _now()
        out: list[tuple[Action, bool]] = []
        seq = self._seq
        try:
            with self._tx() as db:
                for action in actions:
                    a = replace(
                        action, status=ActionStatus.QUEUED, attempts=[], created_ns=action.created_ns or now
                    )
                    if a.idempotency_key is not None:
                        row = db.execute(
                            "SELECT body FROM actions WHERE idem=?", (a.idempotency_key,)
                        ).fetchone()
                        if row:
                            out.append((decode_action(row[0]), False))
                            continue
                    seq += 1
                    db.execute(
                        "INSERT INTO actions (id, kind, priority, deadline_ns, idem, status, available_ns, "
                        "seq, body) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (
                            a.id,
                            a.kind,
                            a.priority,
                            a.deadline_ns,
                            a.idempotency_key,
                            a.status.value,
                            now,
                            seq,
                            encode_action(a).decode(),
                        ),
                    )
                    out.append((a, True))
        except sqlite3.IntegrityError as err:
            raise ActionError(f"an action id of the batch already exists: {err}") from err
        self._seq = seq
        return out

    def get(self, action_id: str) -> Action | None:
        """The action with this id (a restarted planner looks its actions up here)."""
        return self._load(action_id)

    def terminal_among(self, action_ids: Sequence[str]) -> list[Action]:
        """The actions among ``action_ids`` that ended (succeeded, dead or canceled)."""
        out: list[Action] = []
        terminal = (ActionStatus.SUCCEEDED.value, ActionStatus.DEAD.value, ActionStatus.CANCELED.value)
        for i in range(0, len(action_ids), 500):
            chunk = list(action_ids[i : i + 500])
            marks = ",".join("?" * len(chunk))
            rows = self._db.execute(
                f"SELECT body FROM actions WHERE id IN ({marks}) AND status IN (?, ?, ?)",
                (*chunk, *terminal),
            ).fetchall()
            out.extend(decode_action(r[0]) for r in rows)
        return out

    def cancel(self, action_id: str, now_ns: int | None = None) -> Action | None:
        """Cancel: a queued action is removed from dispatch at once; a running one is flagged
        (its executor sees ``cancel_requested`` on its next lease extension)."""
        with self._tx() as db:
            a = self._load(action_id)
            if a is None or a.status.terminal:
                return a
            if a.status is ActionStatus.RUNNING:
                a.cancel_requested = True
                self._leased.pop(a.id, None)
                db.execute("UPDATE actions SET body=? WHERE id=?", (encode_action(a).decode(), a.id))
            else:
                a.status = ActionStatus.CANCELED
                self._save(a)
            return a

    # ------------------------------------------------------------------ executor side
    def lease(
        self,
        executor: str,
        kinds: Iterable[str],
        *,
        labels: Mapping[str, str] | None = None,
        lease_s: float = 10.0,
        live_executors: Iterable[str] = (),
        now_ns: int | None = None,
    ) -> Action | None:
        """Hand the most urgent ready action of these kinds to ``executor`` (or None).

        Actions past their deadline are dead-lettered as expired on the way. An action this
        executor already failed is skipped while another live executor could take it.
        """
        got = self.lease_many(
            executor, kinds, 1, labels=labels, lease_s=lease_s, live_executors=live_executors, now_ns=now_ns
        )
        return got[0] if got else None

    def lease_many(
        self,
        executor: str,
        kinds: Iterable[str],
        max_actions: int,
        *,
        labels: Mapping[str, str] | None = None,
        lease_s: float = 10.0,
        live_executors: Iterable[str] = (),
        now_ns: int | None = None,
    ) -> list[Action]:
        """Up to ``max_actions`` of the most urgent ready actions, in one transaction (see
        :meth:`lease`)."""
        now = now_ns if now_ns is not None else _now()
        kinds = list(kinds)
        if not kinds or max_actions < 1:
            return []
        labels = dict(labels or {})
        live = set(live_executors) | {executor}
        marks = ",".join("?" * len(kinds))
        chosen: list[Action] = []
        updates: list[tuple[Any, ...]] = []
        with self._tx(durable=False) as db:
            ids = db.execute(
                f"SELECT id FROM actions WHERE status IN (?, ?) AND kind IN ({marks}) "
                "AND available_ns <= ? ORDER BY priority DESC, seq LIMIT ?",
                (*_READY, *kinds, now, 256 + max_actions),
            ).fetchall()
            for (action_id,) in ids:  # bodies one by one: usually the first ones are taken
                (body,) = db.execute("SELECT body FROM actions WHERE id=?", (action_id,)).fetchone()
                a = decode_action(body)
                if a.deadline_ns and a.deadline_ns < now:
                    self._expire(a, now)
                    continue
                if any(labels.get(k) != v for k, v in a.selector.items()):
                    continue
                if executor not in RetryPolicy.prefer(live, a.executors_tried()):
                    continue
                if a.attempt_count:
                    self.redeliveries += 1
                a.attempts.append(Attempt(a.attempt_count + 1, executor, now))
                a.status = ActionStatus.RUNNING
                updates.append(self._update_params(a, lease=(executor, now + int(lease_s * 1e9))))
                chosen.append(a)
                if len(chosen) >= max_actions:
                    break
            db.executemany(self._UPDATE, updates)  # one statement for the batch
        return chosen

    def extend(
        self, action_id: str, executor: str, lease_s: float = 10.0, now_ns: int | None = None
    ) -> Action:
        """Extend a lease while the handler runs; returns the action (check ``cancel_requested``).

        Raises:
            ActionError: The executor does not hold the lease (it expired and moved on).
        """
        now = now_ns if now_ns is not None else _now()
        with self._tx(durable=False) as db:
            row = db.execute(
                "SELECT lease_owner, body FROM actions WHERE id=? AND status=?",
                (action_id, ActionStatus.RUNNING.value),
            ).fetchone()
            if row is None or row[0] != executor:
                raise ActionError(f"{executor} does not hold a lease on action {action_id}")
            db.execute(
                "UPDATE actions SET lease_until_ns=? WHERE id=?", (now + int(lease_s * 1e9), action_id)
            )
            return decode_action(row[1])

    def checkpoint(self, action_id: str, executor: str, state: Any) -> None:
        """Save resumable progress of a running action (the next attempt receives it)."""
        with self._tx(durable=False) as db:
            a = self._held(action_id, executor)
            a.checkpoint = state
            db.execute("UPDATE actions SET body=? WHERE id=?", (encode_action(a).decode(), a.id))

    def _held(self, action_id: str, executor: str) -> Action:
        cached = self._leased.get(action_id)
        if cached is not None:
            if cached[1] != executor:
                raise ActionError(f"{executor} does not hold a lease on action {action_id}")
            return cached[0]
        row = self._db.execute(
            "SELECT lease_owner, body FROM actions WHERE id=? AND status=?",
            (action_id, ActionStatus.RUNNING.value),
        ).fetchone()
        if row is None or row[0] != executor:
            raise ActionError(f"{executor} does not hold a lease on action {action_id}")
        return decode_action(row[1])

    def _expire(self, a: Action, now: int) -> None:
        """Dead-letter a waiting action whose deadline passed (it is never started)."""
        a.attempts.append(
            Attempt(a.attempt_count + 1, "", now, now, "expired", "deadline passed before the action started")
        )
        a.status = ActionStatus.DEAD
        self._save(a)
        self._newly_expired.append(a)
        del self._newly_expired[:-10_000]  # bounded when nobody takes them (standalone use)

    def take_expired(self) -> list[Action]:
        """Actions dead-lettered as expired since the last call (to publish their results)."""
        out, self._newly_expired = self._newly_expired, []
        return out

    def _end_attempt(self, a: Action, outcome: str, reason: str, now: int) -> None:
        last = a.attempts[-1]
        a.attempts[-1] = replace(last, ended_ns=now, outcome=outcome, reason=reason)

    def ack(self, action_id: str, executor: str, result: Any = None, now_ns: int | None = None) -> Action:
        """The handler returned: the action succeeded with ``result``."""
        now = now_ns if now_ns is not None else _now()
        with self._tx(durable=False):
            return self._ack(self._held(action_id, executor), result, now)

    def _ack(self, a: Action, result: Any, now: int, batch: list[tuple[Any, ...]] | None = None) -> Action:
        self._end_attempt(a, "ok", "", now)
        a.status = ActionStatus.CANCELED if a.cancel_requested and result is None else ActionStatus.SUCCEEDED
        a.result = result
        if batch is None:
            self._save(a)
        else:
            batch.append(self._update_params(a))
        return a

    def ack_many(
        self, acks: Sequence[tuple[str, str, Any]], now_ns: int | None = None
    ) -> list[Action | ActionError]:
        """Several ``(action id, executor, result)`` acks in one transaction; each is answered
        on its own (an :class:`ActionError` for one whose lease is gone)."""
        now = now_ns if now_ns is not None else _now()
        out: list[Action | ActionError] = []
        batch: list[tuple[Any, ...]] = []
        acked: set[str] = set()
        with self._tx(durable=False) as db:
            for action_id, executor, result in acks:
                try:
                    if action_id in acked:  # a second ack of one action in the batch
                        raise ActionError(f"{executor} does not hold a lease on action {action_id}")
                    held = self._held(action_id, executor)
                except ActionError as err:
                    out.append(err)
                    continue
                acked.add(action_id)
                out.append(self._ack(held, result, now, batch))
            db.executemany(self._UPDATE, batch)  # one statement for the batch
        return out

    def nack(
        self,
        action_id: str,
        executor: str,
        reason: str,
        *,
        permanent: bool = False,
        now_ns: int | None = None,
    ) -> Action:
        """The handler failed: retry after a backoff, or dead-letter (permanent or exhausted)."""
        now = now_ns if now_ns is not None else _now()
        with self._tx(durable=False):
            a = self._held(action_id, executor)
            self._fail(a, "rejected" if permanent else "nack", reason, now, permanent)
            return a

    def _fail(self, a: Action, outcome: str, reason: str, now: int, permanent: bool) -> None:
        self._end_attempt(a, outcome, reason, now)
        if a.cancel_requested:
            a.status = ActionStatus.CANCELED
            self._save(a)
        elif permanent or self.policy.exhausted(a.attempt_count - a.budget_from):
            a.status = ActionStatus.DEAD
            self._save(a)
        else:
            a.status = ActionStatus.RETRYING
            self._save(a, available_ns=now + int(self.policy.backoff_s(a.attempt_count) * 1e9))

    def release_lost(self, *, executor: str | None = None, now_ns: int | None = None) -> list[Action]:
        """Take back the actions whose lease expired, or all leases of a dead ``executor``;
        each counts as a ``lost`` attempt (retried elsewhere, or dead-lettered when exhausted)."""
        now = now_ns if now_ns is not None else _now()
        with self._tx(durable=False) as db:
            if executor is None:
                rows = db.execute(
                    "SELECT id FROM actions WHERE status=? AND lease_until_ns < ?",
                    (ActionStatus.RUNNING.value, now),
                ).fetchall()
            else:
                rows = db.execute(
                    "SELECT id FROM actions WHERE status=? AND lease_owner=?",
                    (ActionStatus.RUNNING.value, executor),
                ).fetchall()
            out = []
            for (aid,) in rows:
                a = self._load(aid)
                assert a is not None
                who = a.attempts[-1].executor if a.attempts else "?"
                self._fail(
                    a, "lost", f"executor {who} stopped answering (lease expired or process died)", now, False
                )
                out.append(a)
            return out

    # ------------------------------------------------------------------ dead letters and metrics
    def expire_deadlines(self, now_ns: int | None = None) -> list[Action]:
        """Dead-letter every waiting action whose deadline passed (it is never started)."""
        now = now_ns if now_ns is not None else _now()
        with self._tx(durable=False) as db:
            rows = db.execute(
                "SELECT body FROM actions WHERE status IN (?, ?) AND deadline_ns > 0 AND deadline_ns < ?",
                (*_READY, now),
            ).fetchall()
            out = []
            for (body,) in rows:
                a = decode_action(body)
                self._expire(a, now)
                out.append(a)
            return out

    def dead_letters(self) -> list[Action]:
        """Actions in the dead-letter queue, oldest first, with every attempt's reason."""
        rows = self._db.execute(
            "SELECT body FROM actions WHERE status=? ORDER BY seq", (ActionStatus.DEAD.value,)
        ).fetchall()
        return [decode_action(r[0]) for r in rows]

    def requeue(self, action_id: str, now_ns: int | None = None) -> Action:
        """Give a dead-lettered action a fresh set of attempts (its history is kept)."""
        now = now_ns if now_ns is not None else _now()
        with self._tx() as db:
            a = self._load(action_id)
            if a is None or a.status is not ActionStatus.DEAD:
                raise ActionError(f"action {action_id} is not in the dead-letter queue")
            a.status = ActionStatus.QUEUED
            a.deadline_ns = 0 if a.deadline_ns and a.deadline_ns < now else a.deadline_ns
            a.budget_from = a.attempt_count  # a fresh attempt budget; the history stays
            self._save(a, available_ns=now)
            db.execute("UPDATE actions SET deadline_ns=? WHERE id=?", (a.deadline_ns, a.id))
            return a

    def purge_dead(self) -> int:
        """Delete the dead-letter queue; returns how many were removed."""
        cur = self._db.execute("DELETE FROM actions WHERE status=?", (ActionStatus.DEAD.value,))
        return cur.rowcount

    def prune(self) -> int:
        """Delete the oldest ended actions (succeeded or canceled, by submit order) beyond the
        newest :attr:`keep_ended`, in transactions of at most :data:`PRUNE_CHUNK` rows. A
        planner asking for a deleted action gets None, and its idempotency key is free again.

        Returns:
            How many were deleted.
        """
        (ended,) = self._db.execute(
            "SELECT COUNT(*) FROM actions WHERE status IN (?, ?)", _PRUNABLE
        ).fetchone()
        excess = int(ended) - self.keep_ended
        deleted = 0
        while excess > 0:
            with self._tx(durable=False) as db:
                n = db.execute(
                    "DELETE FROM actions WHERE id IN (SELECT id FROM actions WHERE status IN (?, ?) "
                    "ORDER BY seq LIMIT ?)",
                    (*_PRUNABLE, min(excess, PRUNE_CHUNK)),
                ).rowcount
            if n <= 0:
                break
            deleted += n
            excess -= n
        self.pruned += deleted
        return deleted

    def backlog(self) -> dict[str, dict[str, int]]:
        """Counts per ``kind/priority`` and state (queued, leased, retrying, dead), for autoscalers."""
        out: dict[str, dict[str, int]] = {}
        for kind, prio, status, n in self._db.execute(
            # not the ended ones: the index on status keeps this cheap beside a long history
            "SELECT kind, priority, status, COUNT(*) FROM actions WHERE status IN (?, ?, ?, ?) "
            "GROUP BY kind, priority, status",
            (*_READY, ActionStatus.RUNNING.value, ActionStatus.DEAD.value),
        ):
            key = f"{kind}/p{prio}"
            name = {"running": "leased"}.get(status, status)
            out.setdefault(key, {"queued": 0, "leased": 0, "retrying": 0, "dead": 0})
            out[key][name] = out[key].get(name, 0) + int(n)
        return out

    def stats(self) -> dict[str, Any]:
        """Totals per state."""
        return dict(self._db.execute("SELECT status, COUNT(*) FROM actions GROUP BY status").fetchall())
