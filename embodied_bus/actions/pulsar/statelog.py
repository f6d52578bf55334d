"""The state log: a materialized view of the action queue's state topic (latest snapshot per
action), read from its start on a client thread.

Every planner and executor of an engine shares one view (:meth:`StateLog.acquire`). Records
written while a state-log message is being persisted go out together in the next one (a group
commit: one message per turn of the event loop when the broker keeps up, fewer and larger ones
under load). A snapshot replaces the view's action only if it is newer
(:func:`~embodied_bus.actions.lifecycle.is_newer`): every view applies the same log in the same
order, so two executors that claim the same attempt agree on which claim stands (the first one
written), and each learns it by reading its own claim back (:meth:`StateLog.reaching`).

The log is kept by a durable subscription (``eb-state-keeper``); the namespace's retention
policy bounds it. A view keeps every open action and the newest :data:`VIEW_ENDED_LIMIT` ended
ones in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Iterator
from typing import Any

import msgspec
import pulsar

from embodied_bus.actions import lifecycle
from embodied_bus.actions.model import Action, ActionError, ActionStatus, encode_action
from embodied_bus.actions.policy import RetryPolicies
from embodied_bus.actions.pulsar.records import (
    Event,
    chunks,
    decode_policy,
    encode_record,
    parse_records,
    parse_snapshot,
)
from embodied_bus.actions.pulsar.sending import LoopInbox, send_settling, unavailable
from embodied_bus.actions.pulsar.topics import STATE_KEEPER, ActionTopics
from embodied_bus.engines.pulsar import PulsarEngine, close_handle
from embodied_bus.engines.pulsar.native import last_message_id_async
from embodied_bus.errors import BusConnectionError

__all__ = [
    "CAUGHT_UP_WAIT_S",
    "REOPEN_AFTER_S",
    "STATE_MESSAGES_IN_FLIGHT",
    "VIEW_ENDED_LIMIT",
    "StateLog",
    "position",
]

_log = logging.getLogger("embodied_bus.actions.pulsar")

#: State-log messages a process has in flight at once: records written while they are being
#: persisted go out together in the next one.
STATE_MESSAGES_IN_FLIGHT = 1
#: A state-log reader that has not answered for this long is replaced, seconds.
REOPEN_AFTER_S = 3.0
#: :meth:`StateLog.caught_up` falls back to a marker round when the reader has not reached the
#: log's end within this, seconds.
CAUGHT_UP_WAIT_S = 1.0
#: Ended actions a view keeps in memory (a planner asks about older ones in vain).
VIEW_ENDED_LIMIT = 100_000

Position = tuple[int, int]


def position(msg_id: Any) -> Position:
    """A message id as ``(ledger, entry)``."""
    return (msg_id.ledger_id(), msg_id.entry_id())


class StateLog:
    """The view of one state topic, shared by the planners and executors of an engine."""

    _shared: weakref.WeakKeyDictionary[Any, dict[str, StateLog]] = weakref.WeakKeyDictionary()

    @classmethod
    def acquire(cls, engine: PulsarEngine, topics: ActionTopics) -> StateLog:
        """The engine's view of ``topics.state`` (one more user; :meth:`release` when done)."""
        logs = cls._shared.setdefault(engine, {})
        log = logs.get(topics.state)
        if log is None:
            log = logs[topics.state] = cls(engine, topics)
        log._users += 1
        return log

    async def release(self) -> None:
        """One user less; the last one closes the reader and the producer."""
        self._users -= 1
        if self._users > 0:
            return
        logs = self._shared.get(self._engine, {})
        if logs.get(self._topics.state) is self:
            del logs[self._topics.state]
        await self.close()

    def __init__(self, engine: PulsarEngine, topics: ActionTopics) -> None:
        self._users = 0
        self._open_lock = asyncio.Lock()
        self._opened = False
        self._sync_task: asyncio.Task[None] | None = None
        self._sync_started = float("-inf")  # time.monotonic() when the running sync began
        self._synced_at = float("-inf")  # ... and when the last successful one began
        self._engine = engine
        self._topics = topics
        self.actions: dict[str, Action] = {}
        #: The steps of each session, in the order the log first showed them (their order).
        self.sessions: dict[str, list[str]] = {}
        #: Session steps put on their priority topics (:attr:`Event.RELEASE`).
        self.released: set[str] = set()
        #: The reply topics of the planners of waiting session steps (:attr:`Event.ROUTE`).
        self.routes: dict[str, str] = {}
        self._ended: deque[str] = deque()
        self.idem: dict[str, str] = {}
        #: The queue's retry policies (:attr:`Event.POLICY` records; the default until one).
        self.policies = RetryPolicies()
        self._lock = threading.Lock()
        self._reader: Any = None
        self._producer: Any = None
        self._last_id: Any = None
        self._generation = 0
        #: Times a stuck reader was replaced.
        self.reopened = 0
        self._pending: list[bytes] = []  # records not sent yet, sent together by _flush
        self._in_flight = 0  # state-log messages sent and not yet persisted
        # one per pending record: its future, or None where a later record's covers it
        self._pending_futs: list[asyncio.Future[Any] | None] = []
        # sync markers published and not yet read back: token -> (loop, future)
        self._markers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = {}
        # a consumer that receives nothing (zero queue, on the keeper subscription): it asks the
        # broker for the log's last persisted position (caught_up)
        self._tail: Any = None
        self._tail_round: tuple[float, asyncio.Future[Position]] | None = None
        self._caught_at = float("-inf")  # time.monotonic() when the latest round reached began
        # the reader's position and those waiting for it to reach one
        self._position: Position = (-1, -1)
        self._reach_lock = threading.Lock()
        self._reach: list[tuple[Position, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    async def open(self) -> None:
        """Open the producer and the reader (once for all users) and read the log up to now."""
        async with self._open_lock:
            if not self._opened:
                await self._open()
                self._opened = True

    async def _open(self) -> None:
        client = self._engine.client
        try:
            self._producer = await asyncio.to_thread(
                client.create_producer,
                self._topics.state,
                batching_enabled=False,  # records are gathered into messages of many records
                block_if_queue_full=True,
            )
            self._reader = await self._create_reader(pulsar.MessageId.earliest)
            self._tail = await asyncio.to_thread(
                client.subscribe,
                self._topics.state,
                STATE_KEEPER,
                consumer_type=pulsar.ConsumerType.Shared,
                receiver_queue_size=0,  # never dispatched anything: it only asks for the end
            )
        except pulsar.PulsarException as err:
            raise unavailable("opening the state log", err) from err
        await self.sync()

    async def _create_reader(self, start: Any) -> Any:
        self._generation += 1
        generation = self._generation

        def on_message(_reader: Any, msg: Any) -> None:  # client listener thread
            if generation != self._generation:
                return  # from a reader that was replaced
            try:
                self.apply_message(msg.data())
            except Exception as err:  # a bad record never stops the view
                _log.warning("state record not applied: %s", err)
            mid = self._last_id = msg.message_id()
            self._reached(position(mid))

        return await asyncio.to_thread(
            self._engine.client.create_reader,
            self._topics.state,
            start,
            reader_listener=on_message,
            receiver_queue_size=1000,
        )

    async def _reopen(self) -> None:
        """Replace a reader that stopped answering (after a broker crash the client can fail to
        reconnect it): a new one resumes after the last record applied."""
        old, self._reader = self._reader, None
        _log.warning("Pulsar action state log: reader stuck, reopening it after the last record")
        if old is not None:
            await close_handle(old)
        try:
            self._reader = await self._create_reader(self._last_id or pulsar.MessageId.earliest)
        except pulsar.PulsarException as err:
            self._reader = old  # keep trying with what there is
            _log.warning("Pulsar action state log: reopening the reader failed: %s", err)
        self.reopened += 1

    # ------------------------------------------------------------------ applying records
    def apply_message(self, data: bytes) -> None:
        """Apply the records of one state-log message (reader thread)."""
        for rec in parse_records(data):
            try:
                self._apply(rec.k, rec.e, rec.d)
            except (ActionError, TypeError, ValueError) as err:
                _log.warning("ignored a malformed state record: %s", err)

    def _apply(self, aid: str, event: str, raw: msgspec.Raw) -> None:
        if event == Event.SYNC:
            waiter = self._markers.pop(str(msgspec.json.decode(raw)), None)
            if waiter is not None:
                loop, fut = waiter
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                    loop.call_soon_threadsafe(_resolve, fut)
            return
        if event == Event.POLICY:
            self.policies = self.policies.with_policy(decode_policy(raw), aid or None)
            return
        new = parse_snapshot(raw) if event in (Event.SNAPSHOT, Event.REQUEUE) else None
        with self._lock:
            old = self.actions.get(aid)
            if event == Event.CANCEL:
                if old is None:  # a cancel that came before the submit
                    self.actions[aid] = Action("unknown", id=aid, cancel_requested=True)
                elif not old.status.terminal:
                    old.cancel_requested = True
            elif event == Event.RELEASE:
                self.released.add(aid)
            elif event == Event.ROUTE:
                self.routes[aid] = str(msgspec.json.decode(raw))
            elif event == Event.PURGE:
                for dead in msgspec.json.decode(raw):
                    a = self.actions.get(dead)
                    if a is not None and a.status is ActionStatus.DEAD:
                        del self.actions[dead]
                        self._leave_session(a)
            elif event == Event.LATE and old is not None:
                number, ok, reason = msgspec.json.decode(raw)
                lifecycle.late_report(old, int(number), ok=bool(ok), reason=str(reason))
            elif new is not None:
                self._apply_snapshot(old, new)

    def _apply_snapshot(self, old: Action | None, new: Action) -> None:
        if old is not None and old.kind != "unknown":
            if not lifecycle.is_newer(new, old):
                return  # older than what is known, or a claim that lost the race
            if new.budget_from == old.budget_from:  # a requeue clears a cancel; nothing else does
                new.cancel_requested = new.cancel_requested or old.cancel_requested
        elif old is not None:  # a cancel that came before the submit
            new.cancel_requested = True
        self.actions[new.id] = new
        if new.session is not None and (old is None or old.kind == "unknown"):
            self.sessions.setdefault(new.session, []).append(new.id)
        if new.idempotency_key and new.idempotency_key not in self.idem:
            self.idem[new.idempotency_key] = new.id
        if new.status.terminal:
            self._forget_old(new.id)

    def _forget_old(self, action_id: str) -> None:
        """Keep at most :data:`VIEW_ENDED_LIMIT` ended actions in memory (oldest go first; the
        log itself keeps them for as long as the topic's retention allows)."""
        self._ended.append(action_id)
        while len(self._ended) > VIEW_ENDED_LIMIT:
            old_id = self._ended.popleft()
            old = self.actions.get(old_id)
            if old is not None and old.status.terminal:
                del self.actions[old_id]
                self._leave_session(old)
                if old.idempotency_key and self.idem.get(old.idempotency_key) == old_id:
                    del self.idem[old.idempotency_key]

    def _leave_session(self, a: Action) -> None:
        steps = self.sessions.get(a.session or "")
        if steps is not None and a.id in steps:
            steps.remove(a.id)
            if not steps:
                del self.sessions[a.session or ""]
        self.released.discard(a.id)
        self.routes.pop(a.id, None)

    # ------------------------------------------------------------------ reading the view
    def session_steps(self, session: str) -> list[Action]:
        """Copies of the steps of ``session`` the view keeps, in their order."""
        with self._lock:
            found = (self.actions.get(i) for i in self.sessions.get(session, ()))
            return [a.copy() for a in found if a is not None]

    def unreleased_heads(self) -> list[str]:
        """Sessions whose next step (the first that gates) waits and is on no priority topic."""
        out = []
        with self._lock:
            for session, ids in self.sessions.items():
                for i in ids:
                    a = self.actions.get(i)
                    if a is None or not lifecycle.gates(a):
                        continue
                    if a.status is ActionStatus.QUEUED and not a.attempts and i not in self.released:
                        out.append(session)
                    break
        return out

    def get(self, action_id: str) -> Action | None:
        """A copy of the view's action."""
        with self._lock:
            a = self.actions.get(action_id)
            return None if a is None or a.kind == "unknown" else a.copy()

    @contextlib.contextmanager
    def peek(self, action_id: str) -> Iterator[Action | None]:
        """The view's own record of an action (not a copy: read it inside the block only)."""
        with self._lock:
            a = self.actions.get(action_id)
            yield None if a is None or a.kind == "unknown" else a

    def cancel_requested(self, action_id: str) -> bool:
        """Whether a cancel of the action is on the log."""
        with self._lock:
            a = self.actions.get(action_id)
            return bool(a is not None and a.cancel_requested)

    def ended(self, action_ids: list[str]) -> list[Action]:
        """Copies of those of ``action_ids`` that have ended."""
        with self._lock:
            found = (self.actions.get(i) for i in action_ids)
            return [a.copy() for a in found if a is not None and a.kind != "unknown" and a.status.terminal]

    def snapshot(self) -> list[Action]:
        """Copies of every action the view keeps."""
        with self._lock:
            return [a.copy() for a in self.actions.values() if a.kind != "unknown"]

    # ------------------------------------------------------------------ catching up

    # ------------------------------------------------------------------ views (monitoring, tests)
    @property
    def position(self) -> Position:
        """How far the log has been read: (ledger, entry) of the last message applied."""
        return self._position

    @property
    def awaited_positions(self) -> int:
        """Callers waiting for the log to be read up to a position."""
        return len(self._reach)

    @property
    def users(self) -> int:
        """Queues of this engine sharing the view (it closes with the last one)."""
        return self._users

    @property
    def reader(self) -> Any:
        """The pulsar-client ``Reader`` of the log (tests close it to play a reader that
        cannot reconnect; the view reopens it)."""
        return self._reader

    @property
    def tail(self) -> Any:
        """The consumer asked where the log ends (tests close it to play a broker that cannot
        be asked; the view then writes a marker and reads up to it)."""
        return self._tail

    async def sync(self, timeout_s: float = 10.0, *, since_mono: float | None = None) -> None:
        """Wait until every state record published before this call (or before ``since_mono``,
        a ``time.monotonic()`` value) is applied: a marker record published after it has been
        read back (the log is one ordered topic). Concurrent callers share one round.

        Raises:
            QueueUnavailable: The state log did not catch up within ``timeout_s``.
        """
        need = time.monotonic() if since_mono is None else since_mono
        if self._synced_at >= need:
            return  # a round began since
        task = self._sync_task
        if task is None or task.done() or self._sync_started < need:
            started = time.monotonic()
            task = asyncio.ensure_future(self._sync_round(timeout_s))
            self._sync_task, self._sync_started = task, started

            def done(t: asyncio.Task[None], started: float = started) -> None:
                if not t.cancelled() and t.exception() is None:
                    self._synced_at = max(self._synced_at, started)

            task.add_done_callback(done)
        await asyncio.shield(task)

    async def _sync_round(self, timeout_s: float) -> None:
        """Publish a marker and wait until the reader applies it; a reader that does not answer
        within :data:`REOPEN_AFTER_S` is replaced; a marker Pulsar did not take is published
        again."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            token = uuid.uuid4().hex
            seen: asyncio.Future[None] = loop.create_future()
            self._markers[token] = (loop, seen)
            try:
                persisted = self.enqueue([("", Event.SYNC, json.dumps(token).encode())])
                await asyncio.wait_for(persisted, max(0.01, deadline - loop.time()))
                while True:
                    wait_s = min(REOPEN_AFTER_S, deadline - loop.time())
                    try:
                        await asyncio.wait_for(asyncio.shield(seen), max(0.01, wait_s))
                        with self._lock:  # a record being applied right now finishes first
                            return
                    except TimeoutError:
                        if loop.time() >= deadline:
                            raise
                        await self._reopen()
            except (BusConnectionError, pulsar.PulsarException, TimeoutError) as err:
                if loop.time() >= deadline:
                    raise unavailable(f"the state log catching up within {timeout_s:g} s", err) from err
                await asyncio.sleep(0.05)
            finally:
                self._markers.pop(token, None)

    def _reached(self, pos: Position) -> None:
        """The reader applied the message at ``pos`` (reader thread): wake who waits for it."""
        with self._reach_lock:
            self._position = max(self._position, pos)
            if not self._reach:
                return
            due = [w for w in self._reach if w[0] <= pos]
            self._reach = [w for w in self._reach if w[0] > pos]
        for _, loop, fut in due:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                loop.call_soon_threadsafe(_resolve, fut)

    def reaching(self, target: Position) -> asyncio.Future[None]:
        """A future completed once the reader has applied the message at ``target``;
        cancelling it (a caller that gave up waiting) removes it from the waiters."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._reach_lock:
            if self._position >= target:
                fut.set_result(None)
                return fut
            waiter = (target, loop, fut)
            self._reach.append(waiter)

        def gave_up(f: asyncio.Future[None]) -> None:
            if f.cancelled():
                with self._reach_lock, contextlib.suppress(ValueError):  # already woken
                    self._reach.remove(waiter)

        fut.add_done_callback(gave_up)
        return fut

    async def read_back(self, msg_id: Any, timeout_s: float = 10.0) -> None:
        """Wait until the reader has applied the message ``msg_id`` (a record this process
        wrote): the view then shows whether it stood. Falls back to :meth:`sync` when the
        reader does not get there within :data:`CAUGHT_UP_WAIT_S`.

        Raises:
            QueueUnavailable: The state log did not catch up.
        """
        fut = self.reaching(position(msg_id))
        if fut.done():
            return
        expired: list[bool] = []

        def give_up() -> None:
            expired.append(True)
            fut.cancel()

        timer = asyncio.get_running_loop().call_later(CAUGHT_UP_WAIT_S, give_up)
        try:
            await fut
        except asyncio.CancelledError:
            if not expired:
                raise
            await self.sync(timeout_s)
        finally:
            timer.cancel()

    async def caught_up(self, since_mono: float) -> None:
        """Wait until every state record persisted before ``since_mono`` (a
        ``time.monotonic()`` value) is applied, without writing to the log: the broker is asked
        for the log's last persisted position and the reader is waited for until it gets there.
        Falls back to :meth:`sync` when the broker does not answer or the reader does not get
        there within :data:`CAUGHT_UP_WAIT_S`.

        Raises:
            QueueUnavailable: The state log did not catch up.
        """
        if self._synced_at >= since_mono or self._caught_at >= since_mono:
            return
        started = time.monotonic()
        try:
            target = await self._last_position(since_mono)
            if target[1] >= 0:  # (ledger, -1): nothing persisted yet
                await asyncio.wait_for(self.reaching(target), CAUGHT_UP_WAIT_S)
        except (BusConnectionError, TimeoutError) as err:
            _log.debug("state log: asking for its end failed (%s); publishing a marker", err)
            await self.sync(since_mono=since_mono)
            return
        self._caught_at = max(self._caught_at, started)

    async def _last_position(self, need_mono: float) -> Position:
        """The log's last persisted position, asked of the broker at or after ``need_mono``;
        callers share rounds (at most one in flight)."""
        while True:
            current = self._tail_round
            if current is not None and current[0] >= need_mono:
                return await asyncio.shield(current[1])
            if current is None or current[1].done():
                self._tail_round = (time.monotonic(), self._ask_last_position())
                continue
            await asyncio.wait([current[1]])  # began too early: the next one is due after it

    def _ask_last_position(self) -> asyncio.Future[Position]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Position] = loop.create_future()
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved or not
        inbox = LoopInbox.of(loop)

        def settle(result: Any, mid: Any) -> None:  # loop thread
            if fut.done():
                return
            if result != pulsar.Result.Ok:
                fut.set_exception(BusConnectionError(f"the state log's end: {result}"))
            else:
                fut.set_result(position(mid))

        def answered(result: Any, mid: Any) -> None:  # client thread
            inbox.post(settle, result, mid)

        try:
            last_message_id_async(self._tail, answered)
        except pulsar.PulsarException as err:
            fut.set_exception(BusConnectionError(f"the state log's end: {err}"))
        return fut

    # ------------------------------------------------------------------ writing
    async def publish(
        self, action: Action, event: Event = Event.SNAPSHOT, *, encoded: bytes | None = None
    ) -> Any:
        """Append a snapshot of ``action``; returns the message id once persisted."""
        return await self.enqueue([(action.id, event, encode_action(action) if encoded is None else encoded)])

    def enqueue(self, records: list[tuple[str, Event, bytes]]) -> asyncio.Future[Any]:
        """Add ``(action id, event, JSON data)`` records to the next state-log message; one
        future for all, completed with the message id when they are persisted (the client
        completes one producer's sends in order, so the last record's message confirms the
        others), or failed with :class:`QueueUnavailable`."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if not records:
            fut.set_result(None)
            return fut
        if not self._pending and self._in_flight < STATE_MESSAGES_IN_FLIGHT:
            loop.call_soon(self._flush)
        self._pending.extend(encode_record(aid, event, data) for aid, event, data in records)
        self._pending_futs.extend([None] * (len(records) - 1))
        self._pending_futs.append(fut)
        return fut

    def _flush(self) -> None:
        """Send the pending records (at most :data:`STATE_MESSAGES_IN_FLIGHT` messages in
        flight: the rest wait for :meth:`_sent`)."""
        if not self._pending or self._in_flight >= STATE_MESSAGES_IN_FLIGHT:
            return
        records, futs = self._pending, self._pending_futs
        self._pending, self._pending_futs = [], []
        start = 0
        for run in chunks(records):
            end = start + len(run)
            self._in_flight += 1
            covered = [f for f in futs[start:end] if f is not None]
            send_settling(self._producer, b"[" + b",".join(run) + b"]", covered, on_done=self._sent)
            start = end

    def _sent(self) -> None:
        """A state-log message was persisted or failed (loop thread): send what gathered."""
        self._in_flight -= 1
        self._flush()

    async def close(self) -> None:
        for h in (self._reader, self._producer, self._tail):
            if h is not None:
                await close_handle(h, self._engine)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
