"""A durable action queue in SQLite (WAL, fsync on commit): an acknowledged submit survives
``kill -9``. Transport-free: the Zenoh queue service and the in-memory backend serve it.

Dispatch order: highest priority first, FIFO within a priority. Every transition is decided in
:mod:`embodied_bus.actions.lifecycle`; this module stores the result. A lease binds an attempt
to one executor process (its name and session) and lasts until it is not renewed for its
length, or until the executor leaves its group.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from embodied_bus.actions import lifecycle
from embodied_bus.actions.lifecycle import Admission, gates
from embodied_bus.actions.model import Action, ActionError, ActionStatus, decode_action, encode_action
from embodied_bus.actions.policy import RetryPolicies, RetryPolicy
from embodied_bus.actions.sessions import Sessions
from embodied_bus.actions.table import UPDATE_ACTION, ActionTable

__all__ = ["DEFAULT_KEEP_ENDED", "PRUNE_CHUNK", "ActionStore", "Settled"]

#: Ended actions (succeeded or canceled) a store keeps by default: the newest by submit order.
#: Dead letters are kept until requeued or purged. Without a bound a robot's queue file grows
#: for good (10 actions/s fill 26 million rows a month).
DEFAULT_KEEP_ENDED = 100_000
#: Most rows one pruning transaction deletes (a larger excess goes in several, so the queue
#: is never held up for long).
PRUNE_CHUNK = 5_000
_PRUNABLE = (ActionStatus.SUCCEEDED.value, ActionStatus.CANCELED.value)
_READY = (ActionStatus.QUEUED.value, ActionStatus.RETRYING.value)
_TERMINAL = (ActionStatus.SUCCEEDED.value, ActionStatus.DEAD.value, ActionStatus.CANCELED.value)


def _now() -> int:
    return time.time_ns()


@dataclass(frozen=True, slots=True)
class Settled:
    """What a report did: the action as it is now, and the backoff of a retry (seconds)."""

    action: Action
    retry_after_s: float = 0.0


class ActionStore:
    """The queue's state on disk.

    Args:
        path: SQLite file (``:memory:`` for tests of pure logic).
        policy: Retry policy applied on nack and lost leases (one for every kind, or per kind).
        keep_ended: Ended actions (succeeded or canceled) kept: the newest this many by submit order.
    """

    def __init__(
        self,
        path: str | Path,
        policy: RetryPolicy | RetryPolicies | None = None,
        *,
        keep_ended: int = DEFAULT_KEEP_ENDED,
    ) -> None:
        if keep_ended < 0:
            raise ValueError(f"keep_ended must be >= 0, got {keep_ended}")
        self.path = str(path)
        self.policies = RetryPolicies.of(policy)
        self.keep_ended = keep_ended
        #: Ended actions deleted by :meth:`prune` so far (this process).
        self.pruned = 0
        #: Attempts started on actions that had been started before, since this store was opened.
        self.redeliveries = 0
        self.table = ActionTable(self.path)
        #: The session rules (ordered steps), applied in every transaction.
        self.sessions = Sessions(self.table)
        self._newly_expired: list[Action] = []
        (self._seq,) = self.table.db.execute("SELECT COALESCE(MAX(seq), 0) FROM actions").fetchone()

    def close(self) -> None:
        """Close the database."""
        self.table.close()

    def encoded(self, a: Action) -> bytes:
        """The JSON envelope of ``a`` as the last transaction stored it (encoded now if it
        did not store it)."""
        return self.table.encoded(a)

    # ------------------------------------------------------------------ planner side
    def submit(self, action: Action, now_ns: int | None = None) -> tuple[Action, bool]:
        """Store a new action (durably, before returning).

        Returns:
            The stored action and True if it is new, or the existing action with the same
            idempotency key (or the same id: a planner that submits again after an outage) and
            False.

        Raises:
            ActionError: The action is invalid.
        """
        return self.submit_many([action], now_ns)[0]

    def submit_many(self, actions: Sequence[Action], now_ns: int | None = None) -> list[tuple[Action, bool]]:
        """Store a batch atomically in one durable transaction (one fsync for the batch).

        Returns:
            Per action, as :meth:`submit`.

        Raises:
            ActionError: An action is invalid; nothing of the batch is stored.
        """
        for action in actions:
            action.validate()
        now = now_ns if now_ns is not None else _now()
        out: list[tuple[Action, bool]] = []
        seq = self._seq
        with self.table.tx() as db:
            for action in actions:
                a = replace(
                    action, status=ActionStatus.QUEUED, attempts=[], created_ns=action.created_ns or now
                )
                row = db.execute(
                    "SELECT body FROM actions WHERE id=? OR (idem IS NOT NULL AND idem=?)",
                    (a.id, a.idempotency_key),
                ).fetchone()
                if row:
                    out.append((decode_action(row[0]), False))
                    continue
                seq += 1
                blocked = self.sessions.waits(db, a.session)
                if a.session is not None:
                    self.table.touched.add(a.session)
                db.execute(
                    "INSERT INTO actions (id, kind, priority, deadline_ns, idem, status, available_ns, "
                    "seq, body, session, gate, blocked) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
                        a.session,
                        gates(a),
                        blocked,
                    ),
                )
                out.append((a, True))
        self._seq = seq
        return out

    def get(self, action_id: str) -> Action | None:
        """The action with this id (a restarted planner looks its actions up here)."""
        return self.table.load(action_id)

    def terminal_among(self, action_ids: Sequence[str]) -> list[Action]:
        """The actions among ``action_ids`` that ended (succeeded, dead or canceled)."""
        out: list[Action] = []
        for i in range(0, len(action_ids), 500):
            chunk = list(action_ids[i : i + 500])
            marks = ",".join("?" * len(chunk))
            rows = self.table.db.execute(
                f"SELECT body FROM actions WHERE id IN ({marks}) AND status IN (?, ?, ?)",
                (*chunk, *_TERMINAL),
            ).fetchall()
            out.extend(decode_action(r[0]) for r in rows)
        return out

    def cancel(self, action_id: str) -> Action | None:
        """Cancel: a waiting action ends at once; a running one is flagged (its executor sees
        it on its next renewal)."""
        with self.table.tx():
            a = self.table.load(action_id)
            if a is None or a.status.terminal:
                return a
            if lifecycle.cancel(a):
                self.table.save(a)
            else:
                self.table.leased.pop(a.id, None)
                self.table.save_held(a)
            return a

    # ------------------------------------------------------------------ executor side
    def lease(
        self,
        executor: str,
        kinds: Iterable[str],
        *,
        session: str = "",
        labels: Mapping[str, str] | None = None,
        lease_s: float = 10.0,
        live_executors: Mapping[str, Collection[str]] | None = None,
        now_ns: int | None = None,
    ) -> Action | None:
        """Hand the most urgent ready action of these kinds to ``executor`` (or None); see
        :meth:`lease_many`."""
        got = self.lease_many(
            executor,
            kinds,
            1,
            session=session,
            labels=labels,
            lease_s=lease_s,
            live_executors=live_executors,
            now_ns=now_ns,
        )
        return got[0] if got else None

    def lease_many(
        self,
        executor: str,
        kinds: Iterable[str],
        max_actions: int,
        *,
        session: str = "",
        labels: Mapping[str, str] | None = None,
        lease_s: float = 10.0,
        live_executors: Mapping[str, Collection[str]] | None = None,
        now_ns: int | None = None,
    ) -> list[Action]:
        """Up to ``max_actions`` of the most urgent ready actions, in one transaction.

        Actions past their deadline are dead-lettered as expired on the way. An action this
        executor already failed is skipped while another live executor that runs its kind
        (``live_executors``: name → the kinds it runs) and has not failed it could take it.
        """
        now = now_ns if now_ns is not None else _now()
        kinds = list(kinds)
        if not kinds or max_actions < 1:
            return []
        labels = dict(labels or {})
        live = dict(live_executors or {})
        marks = ",".join("?" * len(kinds))
        chosen: list[Action] = []
        updates: list[tuple[Any, ...]] = []
        with self.table.tx(durable=False) as db:
            ids = db.execute(
                f"SELECT id FROM actions WHERE status IN (?, ?) AND blocked=0 AND kind IN ({marks}) "
                "AND available_ns <= ? ORDER BY priority DESC, seq LIMIT ?",
                (*_READY, *kinds, now, 256 + max_actions),
            ).fetchall()
            for (action_id,) in ids:  # bodies one by one: usually the first ones are taken
                (body,) = db.execute("SELECT body FROM actions WHERE id=?", (action_id,)).fetchone()
                a = decode_action(body)
                verdict = lifecycle.admit(
                    a,
                    executor,
                    kinds=kinds,
                    labels=labels,
                    policy=self.policies.for_action(a),
                    holder_gone=lambda _attempt: True,  # waiting actions hold no open attempt
                    others_fresh=lambda act: _others_fresh(act, executor, live),
                    now=now,
                )
                if verdict is Admission.START:
                    if a.attempt_count:
                        self.redeliveries += 1
                    lifecycle.start(a, executor, session, now)
                    updates.append(self.table.update_params(a, lease=(executor, now + int(lease_s * 1e9))))
                    chosen.append(a)
                    if len(chosen) >= max_actions:
                        break
                elif verdict in (Admission.EXPIRED, Admission.CANCELED, Admission.EXHAUSTED):
                    self.table.save(a)
                    self._ended_on_the_way(a)
            db.executemany(UPDATE_ACTION, updates)  # one statement for the batch
        return chosen

    def _ended_on_the_way(self, a: Action) -> None:
        self._newly_expired.append(a)
        del self._newly_expired[:-10_000]  # bounded when nobody takes them (standalone use)

    def take_expired(self) -> list[Action]:
        """Actions that ended without running since the last call (deadline passed, canceled,
        a later step of a session whose step was dead-lettered), to publish their results."""
        out, self._newly_expired = self._newly_expired, []
        return out + self.sessions.take_ended()

    def _held(self, action_id: str, executor: str, attempt: int | None, session: str) -> Action:
        """The running action ``executor`` (process ``session``) holds in ``attempt``.

        Raises:
            ActionError: It holds no such lease (it was taken back, or never granted).
        """
        cached = self.table.leased.get(action_id)
        if cached is not None and cached[1] == executor:
            a = cached[0]
        else:
            row = self.table.db.execute(
                "SELECT lease_owner, body FROM actions WHERE id=? AND status=?",
                (action_id, ActionStatus.RUNNING.value),
            ).fetchone()
            if row is None or row[0] != executor:
                raise ActionError(f"{executor} does not hold a lease on action {action_id}")
            a = decode_action(row[1])
        last = a.attempts[-1] if a.attempts else None
        if (
            last is None
            or (attempt is not None and last.number != attempt)
            or (session and last.session != session)
        ):
            raise ActionError(f"{executor} does not hold a lease on action {action_id}")
        return a

    def renew(
        self,
        executor: str,
        leases: Sequence[tuple[str, int]],
        *,
        session: str = "",
        lease_s: float = 10.0,
        now_ns: int | None = None,
    ) -> tuple[list[str], list[str]]:
        """Extend ``executor``'s leases ``(action id, attempt)``.

        Returns:
            The ids whose cancel was asked for, and the ids it no longer holds.
        """
        now = now_ns if now_ns is not None else _now()
        canceled: list[str] = []
        lost: list[str] = []
        with self.table.tx(durable=False) as db:
            for action_id, attempt in leases:
                try:
                    a = self._held(action_id, executor, attempt, session)
                except ActionError:
                    lost.append(action_id)
                    continue
                db.execute(
                    "UPDATE actions SET lease_until_ns=? WHERE id=?", (now + int(lease_s * 1e9), action_id)
                )
                if a.cancel_requested:
                    canceled.append(action_id)
        return canceled, lost

    def extend(
        self, action_id: str, executor: str, lease_s: float = 10.0, now_ns: int | None = None
    ) -> Action:
        """Extend one lease; returns the action (check ``cancel_requested``).

        Raises:
            ActionError: The executor does not hold the lease (it expired and moved on).
        """
        a = self._held(action_id, executor, None, "")
        self.renew(executor, [(action_id, a.attempts[-1].number)], lease_s=lease_s, now_ns=now_ns)
        return a

    def checkpoint(
        self, action_id: str, executor: str, state: Any, *, attempt: int | None = None, session: str = ""
    ) -> None:
        """Save resumable progress of a running action (the next attempt receives it).

        Raises:
            ActionError: The executor does not hold the lease.
        """
        with self.table.tx(durable=False):
            a = self._held(action_id, executor, attempt, session)
            a.checkpoint = state
            self.table.save_held(a)

    def settle(
        self,
        executor: str,
        action_id: str,
        *,
        ok: bool,
        result: Any = None,
        reason: str = "",
        permanent: bool = False,
        attempt: int | None = None,
        session: str = "",
        now_ns: int | None = None,
    ) -> Settled:
        """Record how ``executor``'s attempt ended (see :meth:`settle_many`).

        Raises:
            ActionError: The executor does not hold the lease (its late report is noted in the
                history where its attempt was closed as lost).
        """
        out = self.settle_many(
            executor,
            [(action_id, attempt, ok, result, reason, permanent)],
            session=session,
            now_ns=now_ns,
        )[0]
        if isinstance(out, ActionError):
            raise out
        return out

    def settle_many(
        self,
        executor: str,
        reports: Sequence[tuple[str, int | None, bool, Any, str, bool]],
        *,
        session: str = "",
        now_ns: int | None = None,
    ) -> list[Settled | ActionError]:
        """Several outcomes ``(id, attempt, ok, result, reason, permanent)`` of one executor in
        one transaction, each answered on its own: how it left the action, or an
        :class:`ActionError` for one whose lease is gone."""
        now = now_ns if now_ns is not None else _now()
        out: list[Settled | ActionError] = []
        batch: list[tuple[Any, ...]] = []
        seen: set[str] = set()
        with self.table.tx(durable=False) as db:
            for action_id, attempt, ok, result, reason, permanent in reports:
                try:
                    if action_id in seen:  # a second report of one attempt in the batch
                        raise ActionError(f"{executor} does not hold a lease on action {action_id}")
                    a = self._held(action_id, executor, attempt, session)
                except ActionError as err:
                    self._note_late(action_id, attempt, ok, reason)
                    out.append(err)
                    continue
                seen.add(action_id)
                retry_after_s = 0.0
                available = None
                if ok:
                    lifecycle.succeed(a, result, now)
                else:
                    decision = lifecycle.fail(
                        a, reason, self.policies.for_action(a), now, permanent=permanent
                    )
                    retry_after_s = decision.retry_after_s
                    if decision.status is ActionStatus.RETRYING:
                        available = now + int(retry_after_s * 1e9)
                batch.append(self.table.update_params(a, available))
                out.append(Settled(a, retry_after_s))
            db.executemany(UPDATE_ACTION, batch)  # one statement for the batch
        return out

    def _note_late(self, action_id: str, attempt: int | None, ok: bool, reason: str) -> None:
        """A report from an attempt that was closed as lost: the history notes what it did."""
        if attempt is None:
            return
        a = self.table.load(action_id)
        if a is not None and lifecycle.late_report(a, attempt, ok=ok, reason=reason):
            self.table.leased.pop(a.id, None)
            self.table.save_held(a)

    def ack(self, action_id: str, executor: str, result: Any = None, now_ns: int | None = None) -> Action:
        """The handler returned: the action succeeded with ``result``."""
        return self.settle(executor, action_id, ok=True, result=result, now_ns=now_ns).action

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
        return self.settle(
            executor, action_id, ok=False, reason=reason, permanent=permanent, now_ns=now_ns
        ).action

    def release_lost(
        self,
        *,
        executor: str | None = None,
        session: str | None = None,
        keep_session: str | None = None,
        now_ns: int | None = None,
    ) -> list[Action]:
        """Take back the leases that were not renewed in time, or the leases of a gone
        ``executor``: of its process ``session`` only (if given and not empty), or of every
        process of that name but ``keep_session``. Each counts as a ``lost`` attempt (retried,
        or dead-lettered when exhausted)."""
        now = now_ns if now_ns is not None else _now()
        with self.table.tx(durable=False) as db:
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
                a = self.table.load(aid)
                assert a is not None
                held = a.open_attempt
                holder = held.session if held is not None else ""
                if (session and holder != session) or (keep_session is not None and holder == keep_session):
                    continue  # another process of that name holds it
                decision = lifecycle.lose(a, self.policies.for_action(a), now)
                available = now + int(decision.retry_after_s * 1e9) if decision.retry_after_s else None
                self.table.save(a, available_ns=available)
                out.append(a)
            return out

    def hold_leases(self, until_ns: int) -> int:
        """Let every lease last at least until ``until_ns`` (a queue service that restarts gives
        executors this long to renew what they ran through its absence). Returns how many."""
        with self.table.tx(durable=False) as db:
            return db.execute(
                "UPDATE actions SET lease_until_ns=? WHERE status=? AND lease_until_ns < ?",
                (until_ns, ActionStatus.RUNNING.value, until_ns),
            ).rowcount

    # ------------------------------------------------------------------ dead letters and metrics
    def expire_deadlines(self, now_ns: int | None = None) -> list[Action]:
        """Dead-letter every waiting action whose deadline passed (it is never started)."""
        now = now_ns if now_ns is not None else _now()
        with self.table.tx(durable=False) as db:
            rows = db.execute(
                "SELECT body FROM actions WHERE status IN (?, ?) AND deadline_ns > 0 AND deadline_ns < ?",
                (*_READY, now),
            ).fetchall()
            out = []
            for (body,) in rows:
                a = decode_action(body)
                lifecycle.expire(a, now)
                self.table.save(a)
                self._ended_on_the_way(a)
                out.append(a)
            return out

    def dead_letters(self) -> list[Action]:
        """Actions in the dead-letter queue, oldest first, with every attempt's reason."""
        rows = self.table.db.execute(
            "SELECT body FROM actions WHERE status=? ORDER BY seq", (ActionStatus.DEAD.value,)
        ).fetchall()
        return [decode_action(r[0]) for r in rows]

    def requeue(self, action_id: str, now_ns: int | None = None) -> Action:
        """Give a dead-lettered action a fresh set of attempts (its history is kept)."""
        now = now_ns if now_ns is not None else _now()
        with self.table.tx():
            a = self.table.load(action_id)
            if a is None or a.status is not ActionStatus.DEAD:
                raise ActionError(f"action {action_id} is not in the dead-letter queue")
            lifecycle.requeue(a, now)
            self.table.save(a, available_ns=now)
            return a

    def purge_dead(self) -> int:
        """Delete the dead-letter queue; returns how many were removed."""
        with self.table.tx() as db:
            held = db.execute(  # sessions held by a dead step go on once it is gone
                "SELECT DISTINCT session FROM actions WHERE status=? AND gate=1", (ActionStatus.DEAD.value,)
            ).fetchall()
            self.table.touched.update(session for (session,) in held)
            cur = db.execute("DELETE FROM actions WHERE status=?", (ActionStatus.DEAD.value,))
        return cur.rowcount

    def prune(self) -> int:
        """Delete the oldest ended actions (succeeded or canceled, by submit order) beyond the
        newest :attr:`keep_ended`, in transactions of at most :data:`PRUNE_CHUNK` rows. A
        planner asking for a deleted action gets None, and its idempotency key is free again.

        Returns:
            How many were deleted.
        """
        (ended,) = self.table.db.execute(
            "SELECT COUNT(*) FROM actions WHERE status IN (?, ?)", _PRUNABLE
        ).fetchone()
        excess = int(ended) - self.keep_ended
        deleted = 0
        while excess > 0:
            with self.table.tx(durable=False) as db:
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
        """Counts per ``kind/p<priority>`` and state (queued, leased, retrying, dead), and the
        queued steps waiting for an earlier step of their session (blocked)."""
        out: dict[str, dict[str, int]] = {}
        for kind, prio, status, n, blocked in self.table.db.execute(
            # not the ended ones: the index on status keeps this cheap beside a long history
            "SELECT kind, priority, status, COUNT(*), SUM(blocked) FROM actions WHERE status IN (?, ?, ?, ?) "
            "GROUP BY kind, priority, status",
            (*_READY, ActionStatus.RUNNING.value, ActionStatus.DEAD.value),
        ):
            key = f"{kind}/p{prio}"
            name = "leased" if status == ActionStatus.RUNNING.value else status
            row = out.setdefault(key, {"queued": 0, "leased": 0, "retrying": 0, "dead": 0, "blocked": 0})
            row[name] += int(n)
            row["blocked"] += int(blocked or 0)
        return out

    def stats(self) -> dict[str, int]:
        """Totals per state."""
        return {
            str(k): int(v)
            for k, v in self.table.db.execute("SELECT status, COUNT(*) FROM actions GROUP BY status")
        }


def _others_fresh(a: Action, executor: str, live: Mapping[str, Collection[str]]) -> bool:
    """Whether a live executor other than ``executor`` runs ``a``'s kind and has not failed it."""
    tried = a.executors_tried()
    return any(name != executor and name not in tried and a.kind in kinds for name, kinds in live.items())
