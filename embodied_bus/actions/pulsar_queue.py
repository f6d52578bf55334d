"""The action queue on Apache Pulsar: no queue service, the queue is Pulsar's.

Topics (``<t>/<ns>`` is the bus's Pulsar tenant and namespace, ``<bus>`` its namespace)::

    persistent://<t>/<ns>/eb.<bus>.actions.q<P>.<kind>   one per priority level P = 0..9 and
                                                          kind; Shared subscription
                                                          "eb-executors"
    persistent://<t>/<ns>/eb.<bus>.actions.state         event log: every state change as a full
                                                          action snapshot; records written
                                                          together share one message
    persistent://<t>/<ns>/eb.<bus>.actions.dlq           dead-letter topic (with every attempt)
    non-persistent://<t>/<ns>/eb.<bus>.actions.reply.<planner>   feedback and results of the
                                                          actions of one planner (on demand)

Semantics, and why they are not Pulsar's own:

* **Priorities.** Pulsar has none, so each level is a topic (per kind: an executor subscribes,
  with one multi-topic consumer per level, to the kinds it runs only, so no action bounces
  between executors that cannot run it) and an executor with a free slot takes the highest
  level it holds first (RocketMQ's priority queues). Consumers use ``receiver_queue_size`` =
  the executor's ``prefetch`` (:data:`RECEIVER_QUEUE_SIZE`, 2, by default) and take one message
  per level until it is leased, so a backlog stays with the broker (which hands it to whichever
  executor asks next) and a busy executor holds at most ``prefetch`` + 1 unstarted actions per
  level.
* **Attempts** are counted by embodied_bus in the action itself (``attempts`` in the envelope,
  ``eb-attempts`` in the message properties, and the state log). Pulsar's redelivery counter
  does not count consumer crashes and resets on a broker restart: an executor that receives a
  message whose state shows an attempt still open (its executor died, the broker redelivered
  the message on disconnect) closes that attempt as ``lost`` before it starts the next.
* **Catching up.** Before an executor starts a message that was delivered before or is older
  than :data:`SYNC_AFTER_S`, its view reads the log up to the message's receipt: the broker is
  asked where the log ends (a zero-queue consumer's ``get_last_message_id``) and the reader is
  waited for, with no write (a crashed executor persisted its start before it ran the action).
* **Retries** are republished with ``deliver_after`` = the policy's backoff (Pulsar's retry-letter
  pattern) and the original is acknowledged; an executor that already failed an action gives it
  back with a negative ack while another live executor with that capability exists, so the retry
  runs elsewhere. The client's ``dead_letter_policy`` is not used: it counts broker redeliveries.
* **Dead letters** go to the DLQ topic (subscription ``eb-dlq``) and the state log with the
  reason of every attempt; ``requeue`` gives an action a fresh attempt budget.
* **Executor death** is Pulsar's consumer disconnect: the broker redelivers what it held.
* **Durability**: each submitted action is on the state log and its priority topic before
  ``submit`` returns (Pulsar acknowledges persisted messages); a batch is not atomic.
* **Results** are on the state log (a planner that was away reads them back with ``get``) and
  are sent to the submitting planner's reply topic.

The state log is read from its start by every planner and executor (a materialized view that
keeps every open action and the latest :data:`VIEW_ENDED_LIMIT` ended ones in memory); a
durable subscription (``eb-state-keeper``) keeps it from being deleted, and the namespace's
retention policy bounds it. A state-log message is a JSON array of records
``{"k": action id, "e": event, "d": snapshot or null}`` (event ``snapshot``, ``requeue``,
``cancel``, ``purge`` or ``sync``): a process has one state-log message in flight at a time
(:data:`STATE_MESSAGES_IN_FLIGHT`) and the records written while it is being persisted go out
together in the next (a group commit: one message per turn of the event loop when the broker
keeps up, fewer and larger ones under load). Records are parsed with msgspec, a snapshot only
when it is applied. Views also read the one-record-per-message layout written before
2026-12-03 (property ``eb-event`` = the event, key = the action id); views from before then do
not read arrays, so the planners and executors of one namespace are upgraded together.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import json
import logging
import threading
import time
import uuid
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import msgspec
import pulsar

from embodied_bus.actions.model import (
    Action,
    ActionError,
    ActionStatus,
    Attempt,
    action_from_dict,
    decode_action,
    encode_action,
)
from embodied_bus.actions.policy import DEFAULT_RETRY, RetryPolicy
from embodied_bus.engines._blocking import resolve_none
from embodied_bus.engines.pulsar_engine import PulsarEngine, _MessageBuilder, _native, close_handle
from embodied_bus.errors import BusConnectionError

__all__ = [
    "EXECUTOR_SUBSCRIPTION",
    "PRIORITY_LEVELS",
    "RECEIVER_QUEUE_SIZE",
    "ActionTopics",
    "PulsarActionQueue",
    "StateLog",
]

_log = logging.getLogger("embodied_bus.actions.pulsar")

#: Priority levels, one topic each; consumed highest first.
PRIORITY_LEVELS = tuple(range(10))
#: The Shared subscription every executor consumes the priority topics with.
EXECUTOR_SUBSCRIPTION = "eb-executors"
#: Messages a consumer prefetches per priority topic: small, so a busy executor does not hoard
#: work an idle one could run (it holds at most this + 1 unstarted actions per level). 2, not 1:
#: the next message is then already on its way while the executor takes the last one (planner
#: and 4 executors in one process, 12 alternating pairs: +11 to +65 % actions/s, 8-30 % less CPU
#: per action; raw pulsar-client ran the same with 1 and 2). An executor may choose more
#: (``Executor(prefetch=...)``): short actions then move faster, at the cost of hoarding.
RECEIVER_QUEUE_SIZE = 2
#: Durable subscription that keeps the state log (never acknowledged).
STATE_KEEPER = "eb-state-keeper"
#: Subscription of the dead-letter topic (acknowledged by ``requeue`` and ``purge``).
DLQ_SUBSCRIPTION = "eb-dlq"
#: Delay before an action given back with a negative ack is offered again, milliseconds.
NACK_REDELIVERY_MS = 50
#: How often an executor gives an action back so another executor retries it, at most.
MAX_HANDBACKS = 20
#: A message older than this is checked against the state log before it starts, seconds (a
#: younger one was published moments ago; the log is followed continuously anyway).
SYNC_AFTER_S = 1.0
#: Most records in one state-log or reply message (more in one event-loop turn go out in several).
STATE_BATCH_MAX_RECORDS = 500
#: Most bytes of records gathered into one state-log or reply message (a larger record goes
#: alone), well under Pulsar's default message size limit (``maxMessageSize``, 5 MiB).
STATE_BATCH_MAX_BYTES = 1 << 20
#: State-log messages a process has in flight at once: records written while they are being
#: persisted go out together in the next one (a group commit: one message per turn of the event
#: loop when the broker keeps up, larger messages and fewer broker writes when it does not).
STATE_MESSAGES_IN_FLIGHT = 1
#: A level whose receive failed is asked again after this long, seconds.
REARM_AFTER_S = 0.2
#: A state-log reader that has not answered for this long is replaced, seconds.
REOPEN_AFTER_S = 3.0
#: :meth:`StateLog.caught_up` falls back to a marker round (:meth:`StateLog.sync`, which also
#: replaces a stuck reader) when the reader has not reached the log's end within this, seconds.
CAUGHT_UP_WAIT_S = 1.0
#: Ended actions a state-log view keeps in memory (a planner asks about older ones in vain).
VIEW_ENDED_LIMIT = 100_000
#: Producers to planners' reply topics an executor keeps open.
REPLY_PRODUCERS = 64


@dataclass(frozen=True, slots=True)
class ActionTopics:
    """Topic names of one bus namespace."""

    prefix: str
    np_prefix: str

    @classmethod
    def of(cls, engine: PulsarEngine) -> ActionTopics:
        s = engine.settings
        base = f"{s.tenant}/{s.pulsar_namespace}/eb.{s.namespace}.actions"
        return cls(f"persistent://{base}", f"non-persistent://{base}")

    def queue(self, priority: int, kind: str) -> str:
        """The topic of one kind at one priority level (``/`` in a kind becomes ``:``)."""
        return f"{self.prefix}.q{priority}.{kind.replace('/', ':')}"

    @property
    def state(self) -> str:
        return f"{self.prefix}.state"

    @property
    def dlq(self) -> str:
        return f"{self.prefix}.dlq"

    def reply(self, planner: str) -> str:
        return f"{self.np_prefix}.reply.{planner}"


def _to_thread_error(what: str, err: Exception) -> BusConnectionError:
    return BusConnectionError(f"Pulsar action queue: {what} failed: {err}")


class StateLog:
    """A materialized view of the state topic (latest snapshot per action), read from its start
    on a thread; :meth:`sync` waits until everything published before the call is applied.

    The planners and executors of one engine (one process, usually) share one view:
    :meth:`acquire` and :meth:`release` count its users.
    """

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
        self._ended: deque[str] = deque()
        self.idem: dict[str, str] = {}
        self._lock = threading.Lock()
        self._reader: Any = None
        self._producer: Any = None
        self._last_id: Any = None
        self._generation = 0
        #: Times a stuck reader was replaced.
        self.reopened = 0
        # records not sent yet, sent together by _flush
        self._pending: list[bytes] = []
        self._in_flight = 0  # state-log messages sent and not yet persisted
        # one per pending record: its future, or None where a later record's covers it
        self._pending_futs: list[asyncio.Future[None] | None] = []
        # sync markers published and not yet read back: token -> (loop, future)
        self._markers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = {}
        # a consumer that receives nothing (zero queue, on the keeper subscription): it asks the
        # broker for the log's last persisted position (caught_up)
        self._tail: Any = None
        self._tail_round: tuple[float, asyncio.Future[tuple[int, int]]] | None = None
        self._caught_at = float("-inf")  # time.monotonic() when the latest round reached began
        # the reader's position (ledger, entry) and those waiting for it to reach one
        self._position: tuple[int, int] = (-1, -1)
        self._reach_lock = threading.Lock()
        self._reach: list[tuple[tuple[int, int], asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

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
                # records are gathered by _enqueue_record into messages of many records
                batching_enabled=False,
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
            raise _to_thread_error("opening the state log", err) from err
        await self.sync()

    async def _create_reader(self, start: Any) -> Any:
        self._generation += 1
        generation = self._generation

        def on_message(_reader: Any, msg: Any) -> None:  # client listener thread
            if generation != self._generation:
                return  # from a reader that was replaced
            try:
                self._apply(msg)
            except Exception as err:  # a bad record never stops the view
                _log.warning("state record not applied: %s", err)
            mid = self._last_id = msg.message_id()
            self._reached((mid.ledger_id(), mid.entry_id()))

        return await asyncio.to_thread(
            self._engine.client.create_reader,
            self._topics.state,
            start,
            reader_listener=on_message,
            receiver_queue_size=1000,
        )

    async def _reopen(self) -> None:
        """Replace a reader that stopped answering (after a broker crash the client can fail to
        reconnect it: "consumer ... is already present"): a new one resumes after the last
        record applied."""
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

    def _apply(self, msg: Any) -> None:
        props = msg.properties()
        event = props.get("eb-event", "batch")
        if event == "batch":
            records = _parse_records(msg.data())
        else:  # one record per message (embodied_bus before 2026-12-03)
            records = [_legacy_record(msg, msg.partition_key(), event)]
        for rec in records:
            try:
                self._apply_record(rec.k, rec.e, rec.d)
            except (ActionError, TypeError, ValueError) as err:
                _log.warning("ignored a malformed state record: %s", err)

    def _apply_record(self, aid: str, event: str, raw: msgspec.Raw) -> None:
        """Apply one record (``raw``: the JSON of its snapshot, purge list, marker token or null)."""
        if event == "sync":
            waiter = self._markers.pop(str(msgspec.json.decode(raw)), None)
            if waiter is not None:
                loop, fut = waiter
                try:
                    loop.call_soon_threadsafe(resolve_none, fut)
                except RuntimeError:  # the loop is closed: nobody waits any more
                    pass
            return
        if event in ("snapshot", "requeue"):
            try:
                new = _snapshot(raw)  # parsed before the lock is taken
            except ActionError as err:
                _log.warning("ignored a malformed state record %s: %s", aid, err)
                return
        with self._lock:
            old = self.actions.get(aid)
            if event == "cancel":
                if old is None:  # a cancel that came before the submit
                    self.actions[aid] = Action("unknown", id=aid, cancel_requested=True)
                elif not old.status.terminal:
                    old.cancel_requested = True
            elif event == "purge":
                for dead in msgspec.json.decode(raw):
                    a = self.actions.get(dead)
                    if a is not None and a.status is ActionStatus.DEAD:
                        del self.actions[dead]
            elif event in ("snapshot", "requeue"):
                if old is not None and old.kind != "unknown":
                    if old.status.terminal and event != "requeue":
                        return  # terminal is final (a late duplicate snapshot changes nothing)
                    if event != "requeue" and (
                        new.budget_from < old.budget_from
                        or (new.budget_from == old.budget_from and len(new.attempts) < len(old.attempts))
                    ):
                        return  # older than what is known (the submit and the first start race)
                    new.cancel_requested = new.cancel_requested or old.cancel_requested
                elif old is not None:  # a cancel that came before the submit
                    new.cancel_requested = True
                self.actions[new.id] = new
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
                if old.idempotency_key and self.idem.get(old.idempotency_key) == old_id:
                    del self.idem[old.idempotency_key]

    async def sync(self, timeout_s: float = 10.0, *, since_mono: float | None = None) -> None:
        """Wait until every state record published before this call (or before ``since_mono``,
        a ``time.monotonic()`` value) is applied: a marker record published after it has been
        read back (the log is one ordered topic). Concurrent callers share one round: a round
        begun after the moment a caller needs is enough for it.

        Raises:
            BusConnectionError: The state log did not catch up within ``timeout_s``.
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
        within :data:`REOPEN_AFTER_S` is replaced (the new one resumes after the last record
        applied, so it reads the marker too); a marker Pulsar did not take is published again."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            token = uuid.uuid4().hex
            seen: asyncio.Future[None] = loop.create_future()
            self._markers[token] = (loop, seen)
            try:
                persisted = self._enqueue_record("", "sync", json.dumps(token).encode())
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
                    raise BusConnectionError(
                        f"the Pulsar action state log did not catch up within {timeout_s:g} s: {err}"
                    ) from err
                await asyncio.sleep(0.05)
            finally:
                self._markers.pop(token, None)

    def _reached(self, position: tuple[int, int]) -> None:
        """The reader applied the message at ``position`` (reader thread): wake who waits for it."""
        with self._reach_lock:
            self._position = max(self._position, position)
            if not self._reach:
                return
            due = [w for w in self._reach if w[0] <= position]
            self._reach = [w for w in self._reach if w[0] > position]
        for _, loop, fut in due:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                loop.call_soon_threadsafe(resolve_none, fut)

    async def caught_up(self, since_mono: float) -> None:
        """Wait until every state record persisted before ``since_mono`` (a
        ``time.monotonic()`` value) is applied, without writing to the log: the broker is asked
        for the log's last persisted position and the reader is waited for until it gets there
        (a broker round trip and the reader's lag, where :meth:`sync`'s marker waits for a
        state-log message to be persisted and read back). Records this process has sent and
        Pulsar has not yet persisted are not waited for (:meth:`sync` waits for those). Falls
        back to :meth:`sync` when the broker does not answer or the reader does not get there
        within :data:`CAUGHT_UP_WAIT_S`.

        Raises:
            BusConnectionError: The state log did not catch up (see :meth:`sync`).
        """
        if self._synced_at >= since_mono or self._caught_at >= since_mono:
            return
        started = time.monotonic()
        try:
            target = await self._last_position(since_mono)
            if target[1] >= 0:  # (ledger, -1): nothing persisted yet
                await asyncio.wait_for(self._reaching(target), CAUGHT_UP_WAIT_S)
        except (BusConnectionError, TimeoutError) as err:
            _log.debug("state log: asking for its end failed (%s); publishing a marker", err)
            await self.sync(since_mono=since_mono)
            return
        self._caught_at = max(self._caught_at, started)

    def _reaching(self, target: tuple[int, int]) -> asyncio.Future[None]:
        """A future completed once the reader has applied the message at ``target``; cancelling
        it (a caller that gave up waiting) removes it from the waiters."""
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

    async def _last_position(self, need_mono: float) -> tuple[int, int]:
        """The log's last persisted position, asked of the broker at or after ``need_mono``;
        callers share rounds (at most one in flight: who needs a later one waits for it to end).

        Raises:
            BusConnectionError: The broker did not answer.
        """
        while True:
            current = self._tail_round
            if current is not None and current[0] >= need_mono:
                return await asyncio.shield(current[1])
            if current is None or current[1].done():
                self._tail_round = (time.monotonic(), self._ask_last_position())
                continue
            await asyncio.wait([current[1]])  # began too early: the next one is due after it

    def _ask_last_position(self) -> asyncio.Future[tuple[int, int]]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[tuple[int, int]] = loop.create_future()
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved or not
        inbox = _LoopInbox.of(loop)

        def settle(result: Any, mid: Any) -> None:  # loop thread
            if fut.done():
                return
            if result != pulsar.Result.Ok:
                fut.set_exception(BusConnectionError(f"the state log's end: {result}"))
            else:
                fut.set_result((mid.ledger_id(), mid.entry_id()))

        def answered(result: Any, mid: Any) -> None:  # client thread
            inbox.post(settle, result, mid)

        try:
            self._tail._consumer.get_last_message_id_async(answered)
        except (AttributeError, pulsar.PulsarException) as err:
            fut.set_exception(BusConnectionError(f"the state log's end: {err}"))
        return fut

    def get(self, action_id: str) -> Action | None:
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
        """Whether a cancel of the action is on the log (no copy made)."""
        with self._lock:
            a = self.actions.get(action_id)
            return bool(a is not None and a.cancel_requested)

    def ended(self, action_ids: list[str]) -> list[Action]:
        """Copies of those of ``action_ids`` that have ended (the others are not copied)."""
        with self._lock:
            found = (self.actions.get(i) for i in action_ids)
            return [a.copy() for a in found if a is not None and a.kind != "unknown" and a.status.terminal]

    def snapshot(self) -> list[Action]:
        with self._lock:
            return [a.copy() for a in self.actions.values() if a.kind != "unknown"]

    async def publish(self, action: Action, event: str = "snapshot", *, encoded: bytes | None = None) -> None:
        """Append a snapshot of ``action`` (persisted when this returns); ``encoded`` is
        ``encode_action(action)`` if the caller has it already."""
        await self.publish_event(action.id, event, encode_action(action) if encoded is None else encoded)

    async def publish_event(self, action_id: str, event: str, data: bytes = b"") -> None:
        """Append a record (persisted when this returns); ``data`` is JSON (or empty)."""
        await self._enqueue_record(action_id, event, data)

    def _enqueue_record(self, action_id: str, event: str, data: bytes) -> asyncio.Future[None]:
        """Add a record to the next state-log message; the future completes when that
        message is persisted (or fails with :class:`BusConnectionError`)."""
        return self._enqueue_records([(action_id, event, data)])

    def _enqueue_records(self, records: list[tuple[str, str, bytes]]) -> asyncio.Future[None]:
        """Add ``(action id, event, data)`` records to the next state-log message; one future
        for all, completed when they are persisted (the client completes one producer's sends
        in order, so the last record's message confirms the others)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        if not records:
            fut.set_result(None)
            return fut
        if not self._pending and self._in_flight < STATE_MESSAGES_IN_FLIGHT:
            loop.call_soon(self._flush)
        self._pending.extend(_record(aid, event, data or b"null") for aid, event, data in records)
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
        for chunk in _chunks(records):
            end = start + len(chunk)
            data = b"[" + b",".join(chunk) + b"]"
            self._in_flight += 1
            covered = [f for f in futs[start:end] if f is not None]
            _send_settling(
                self._producer, data, covered, properties={"eb-event": "batch"}, on_done=self._sent
            )
            start = end

    def _sent(self) -> None:
        """A state-log message was persisted or failed (loop thread): send what gathered."""
        self._in_flight -= 1
        self._flush()

    async def close(self) -> None:
        for h in (self._reader, self._producer, self._tail):
            if h is not None:
                await close_handle(h, self._engine)


def _record(key: str, event: str, data: bytes) -> bytes:
    """One record of a state-log or reply message (``data``: JSON)."""
    return b'{"k":%s,"e":"%s","d":%s}' % (msgspec.json.encode(key), event.encode(), data)


class _Record(msgspec.Struct):
    """One record of a state-log or reply message; ``d`` stays JSON until it is needed."""

    k: str
    e: str
    d: msgspec.Raw = msgspec.Raw(b"null")


_RECORDS = msgspec.json.Decoder(list[_Record])
_RAW_ITEMS = msgspec.json.Decoder(list[msgspec.Raw])
_ONE_RECORD = msgspec.json.Decoder(_Record)
_SNAPSHOT = msgspec.json.Decoder(Action)


def _parse_records(data: bytes) -> list[_Record]:
    """The records of a state-log or reply message; a malformed record is logged and skipped.

    Raises:
        ActionError: The message is not a JSON array.
        ValueError: The message is not JSON.
    """
    try:
        return _RECORDS.decode(data)
    except msgspec.ValidationError:
        pass  # a malformed record among them: read the others one by one
    except msgspec.DecodeError as err:
        raise ValueError(f"a state-log or reply message is not JSON: {err}") from err
    try:
        items = _RAW_ITEMS.decode(data)
    except msgspec.ValidationError as err:
        raise ActionError("a state-log or reply message must be a JSON array of records") from err
    out = []
    for item in items:
        try:
            out.append(_ONE_RECORD.decode(item))
        except msgspec.ValidationError as err:
            _log.warning("ignored a malformed record %.80r: %s", bytes(item), err)
    return out


def _legacy_record(msg: Any, key: str, event: str) -> _Record:
    """The record of a one-record-per-message layout (embodied_bus before 2026-12-03)."""
    return _Record(key, event, msgspec.Raw(msg.data() or b"null"))


def _snapshot(raw: msgspec.Raw) -> Action:
    """The action of a snapshot record.

    Raises:
        ActionError: It is not a valid action envelope.
    """
    try:
        return _SNAPSHOT.decode(raw).validate(check_payload=False)
    except msgspec.ValidationError as err:
        raise ActionError(f"action envelope is malformed: {err}") from err
    except msgspec.DecodeError as err:
        raise ActionError(f"action envelope is not valid JSON: {err}") from err


def _chunks(records: list[bytes]) -> list[list[bytes]]:
    """Split records into message-sized runs (:data:`STATE_BATCH_MAX_RECORDS` and
    :data:`STATE_BATCH_MAX_BYTES`; a record larger than the byte limit goes alone)."""
    out: list[list[bytes]] = []
    run: list[bytes] = []
    size = 0
    for rec in records:
        if run and (size + len(rec) > STATE_BATCH_MAX_BYTES or len(run) >= STATE_BATCH_MAX_RECORDS):
            out.append(run)
            run, size = [], 0
        run.append(rec)
        size += len(rec)
    if run:
        out.append(run)
    return out


async def _send(producer: Any, data: bytes, **kwargs: Any) -> None:
    """Send and wait for the broker's acknowledgement without blocking the event loop."""
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    _send_settling(producer, data, [fut], **kwargs)
    await fut


def _send_settling(
    producer: Any,
    data: bytes,
    futs: list[asyncio.Future[None]],
    *,
    on_done: Callable[[], None] | None = None,
    **kwargs: Any,
) -> None:
    """Send; complete ``futs`` (of the running loop) when the broker has persisted the message,
    or fail them with :class:`BusConnectionError`; ``on_done`` is called (on the loop) first."""
    loop = asyncio.get_running_loop()

    def settle(error: BusConnectionError | None) -> None:
        if on_done is not None:
            on_done()
        for fut in futs:
            if fut.done():
                continue
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)

    inbox = _LoopInbox.of(loop)

    def sent(result: Any, _msg_id: Any) -> None:  # client thread
        error = None
        if result != pulsar.Result.Ok:
            error = BusConnectionError(f"Pulsar did not persist an action message: {result}")
        inbox.post(settle, error)

    try:
        _send_async(producer, data, sent, **kwargs)
    except pulsar.PulsarException as err:
        settle(BusConnectionError(f"Pulsar did not take an action message: {err}"))


def _send_async(
    producer: Any,
    data: bytes,
    callback: Callable[[Any, Any], None] | None,
    *,
    partition_key: str | None = None,
    properties: dict[str, str] | None = None,
    deliver_after: timedelta | None = None,
) -> None:
    """``producer.send_async`` through the client's native message builder when it has one
    (no per-call argument checks: the arguments here have known types)."""
    native = _native(producer, "_producer")
    if native is producer:
        producer.send_async(
            data, callback, partition_key=partition_key, properties=properties, deliver_after=deliver_after
        )
        return
    mb = _MessageBuilder().content(data)
    for k, v in (properties or {}).items():
        mb.property(k, v)
    if partition_key:
        mb.partition_key(partition_key)
    if deliver_after is not None:
        mb.deliver_after(deliver_after)
    native.send_async(mb.build(), callback)


def _send_runs(runs: dict[Any, list[tuple[bytes, str, dict[str, str]]]]) -> asyncio.Future[None]:
    """Send runs of messages, each ``(data, key, properties)``, one run per producer; the future
    completes when the broker has persisted them all (or fails with
    :class:`BusConnectionError`). Only the last message of a run carries a callback: the client
    completes one producer's sends in order and fails the ones pending after a failed one, so
    that callback confirms the run (a callback per message takes the GIL from the client's I/O
    thread once per message)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    left = [len(runs)]
    inbox = _LoopInbox.of(loop)

    def settle(error: BusConnectionError | None) -> None:  # loop thread
        left[0] -= 1
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        elif left[0] == 0:
            done.set_result(None)

    def sent(result: Any, _msg_id: Any) -> None:  # client thread
        error = None
        if result != pulsar.Result.Ok:
            error = BusConnectionError(f"Pulsar did not persist an action message: {result}")
        inbox.post(settle, error)

    if not runs:
        done.set_result(None)
    for producer, run in runs.items():
        last = len(run) - 1
        try:
            for i, (data, key, props) in enumerate(run):
                _send_async(producer, data, sent if i == last else None, partition_key=key, properties=props)
        except pulsar.PulsarException as err:
            settle(BusConnectionError(f"Pulsar did not take an action message: {err}"))
    return done


class _LoopInbox:
    """Calls from client threads into one event loop, with one wake-up of the loop per burst
    (``call_soon_threadsafe`` per call wakes it once per persisted message)."""

    _of: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopInbox] = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _LoopInbox:
        """The loop's inbox (made on first use; call on the loop's thread)."""
        inbox = cls._of.get(loop)
        if inbox is None:
            inbox = cls._of[loop] = cls(loop)
        return inbox

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._calls: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()
        self._scheduled = False

    def post(self, fn: Callable[..., None], *args: Any) -> None:
        """Call ``fn(*args)`` on the loop soon (any thread; never raises: a closed loop has
        nobody waiting any more)."""
        self._calls.append((fn, args))  # before the flag is read: a drain under way takes it
        if not self._scheduled:
            self._scheduled = True
            try:
                self._loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed
                self._scheduled = False

    def _drain(self) -> None:
        self._scheduled = False  # before taking calls: one posted from now on schedules a drain
        calls = self._calls
        while calls:
            fn, args = calls.popleft()
            try:
                fn(*args)
            except Exception:  # one failing call does not hold up the others
                _log.exception("callback %r failed", fn)


class _Producers:
    """Producers created on first use (thread-safe), closed together."""

    def __init__(self, engine: PulsarEngine, *, limit: int | None = None, **options: Any) -> None:
        self._engine = engine
        self._client = engine.client
        self._options = options
        self._limit = limit
        self._open: OrderedDict[str, Any] = OrderedDict()
        self._lock = asyncio.Lock()

    async def get(self, topic: str) -> Any:
        p = self._open.get(topic)
        if p is not None:
            self._open.move_to_end(topic)
            return p
        async with self._lock:
            if topic not in self._open:
                try:
                    self._open[topic] = await asyncio.to_thread(
                        self._client.create_producer, topic, batching_enabled=False, **self._options
                    )
                except pulsar.PulsarException as err:
                    raise _to_thread_error(f"creating a producer on {topic}", err) from err
                while self._limit is not None and len(self._open) > self._limit:
                    _, old = self._open.popitem(last=False)
                    await asyncio.to_thread(old.close)
            return self._open[topic]

    async def close(self) -> None:
        for p in self._open.values():
            await close_handle(p, self._engine)
        self._open.clear()


class _Replies:
    """Replies to planners from the planners and executors of one engine: the records for one
    planner's topic that gather while its previous message is being sent go out together (one
    message in flight per topic, as on the state log), whichever executor wrote them.
    :meth:`acquire` and :meth:`release` count the users; the last one closes the producers."""

    _shared: weakref.WeakKeyDictionary[Any, _Replies] = weakref.WeakKeyDictionary()

    @classmethod
    def acquire(cls, engine: PulsarEngine) -> _Replies:
        replies = cls._shared.get(engine)
        if replies is None:
            replies = cls._shared[engine] = cls(engine)
        replies._users += 1
        return replies

    async def release(self) -> None:
        self._users -= 1
        if self._users > 0:
            return
        if self._shared.get(self._engine) is self:
            del self._shared[self._engine]
        await self._producers.close()

    def __init__(self, engine: PulsarEngine) -> None:
        self._engine = engine
        self._users = 0
        self._producers = _Producers(engine, limit=REPLY_PRODUCERS, block_if_queue_full=False)
        self._pending: dict[str, list[bytes]] = {}  # topic -> records not sent yet
        self._in_flight: set[str] = set()  # topics with a message being sent
        self._tasks: set[asyncio.Future[None]] = set()

    def add(self, topic: str, record: bytes) -> None:
        """Queue a record for ``topic`` (loop thread); sent after this turn of the loop or when
        the topic's message in flight is out."""
        pending = self._pending.get(topic)
        if pending is None:
            pending = self._pending[topic] = []
            if topic not in self._in_flight:
                self._schedule(topic)
        pending.append(record)

    def _schedule(self, topic: str) -> None:
        task = asyncio.ensure_future(self._send(topic))  # runs after this turn
        self._tasks.add(task)  # referenced until done (the loop keeps only weak ones)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, topic: str) -> None:
        if topic in self._in_flight or topic not in self._pending:
            return
        self._in_flight.add(topic)
        records: list[bytes] = []
        try:
            producer = await self._producers.get(topic)
            records = self._pending.pop(topic, [])
            chunks = _chunks(records)
        except (BusConnectionError, pulsar.PulsarException) as err:  # the planner's topic is gone
            records = self._pending.pop(topic, [])
            _log.debug("%d replies to %s not sent: %s", len(records), topic, err)
            self._in_flight.discard(topic)
            return
        inbox = _LoopInbox.of(asyncio.get_running_loop())
        left = [len(chunks)]

        def done() -> None:  # loop thread
            left[0] -= 1
            if left[0] == 0:
                self._in_flight.discard(topic)
                if topic in self._pending:
                    self._schedule(topic)

        def sent(_result: Any, _msg_id: Any) -> None:  # client thread
            inbox.post(done)

        for chunk in chunks:
            try:
                _send_async(producer, b"[" + b",".join(chunk) + b"]", sent, properties={"eb-event": "batch"})
            except pulsar.PulsarException as err:  # e.g. the producer was closed
                _log.debug("%d replies to %s not sent: %s", len(chunk), topic, err)
                done()
        if not chunks:
            self._in_flight.discard(topic)


class PulsarActionQueue:
    """The planner's and the executor's end of the action queue on Pulsar.

    It answers the same JSON requests as the Zenoh queue service (``submit``, ``get``,
    ``cancel``, ``backlog``, ``dlq``; ``lease``, ``extend``, ``checkpoint``, ``ack``, ``nack``),
    computed locally against Pulsar topics, so :class:`~embodied_bus.actions.Planner` and
    :class:`~embodied_bus.actions.Executor` work unchanged on both engines.

    Args:
        engine: An open Pulsar engine.
        policy: Retry policy (backoff, attempt limit).
        prefetch: Executor side: messages the client fetches ahead per priority level
            (``receiver_queue_size``; None: :data:`RECEIVER_QUEUE_SIZE`).
    """

    def __init__(
        self, engine: PulsarEngine, policy: RetryPolicy = DEFAULT_RETRY, *, prefetch: int | None = None
    ) -> None:
        if prefetch is not None and prefetch < 1:
            raise ValueError(f"prefetch must be >= 1 (or None for the default), got {prefetch}")
        self.engine = engine
        #: Messages the client fetches ahead per priority level (the consumers' receiver queue).
        self.prefetch = RECEIVER_QUEUE_SIZE if prefetch is None else prefetch
        self.policy = policy
        self.topics = ActionTopics.of(engine)
        self.state = StateLog.acquire(engine, self.topics)
        self.name = uuid.uuid4().hex[:12]
        self._client = engine.client
        self._producers = _Producers(engine, block_if_queue_full=True)
        self._replies_out = _Replies.acquire(engine)
        self._started = False
        self._closed = False
        self._kinds_ready: set[str] = set()
        self._kind_lock = asyncio.Lock()
        self._start_lock = asyncio.Lock()
        self._reply_consumer: Any = None
        self._listeners: dict[str, list[Callable[[str, Any], None]]] = {}
        self._result_listener: Callable[[list[tuple[str, Any]]], None] | None = None
        self._wake_callbacks: list[Callable[[], None]] = []
        # executor side
        self._consumers: dict[int, Any] = {}
        self._ready: list[tuple[int, int, Any]] = []  # (-priority, seq, message)
        self._ready_lock = threading.Lock()
        self._inbox: _LoopInbox | None = None  # the executor's loop, for re-asking a level
        self._held: dict[str, tuple[Any, Action, str, Any]] = {}  # id -> (msg, action, reply, consumer)
        self._seq = 0
        self._pull_threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._handbacks: dict[str, int] = {}
        self.live_executors: Callable[[str], list[str]] = lambda _kind: []

    # ------------------------------------------------------------------ set-up
    async def start(self) -> None:
        """Open the state log and make sure the durable subscriptions exist (idempotent)."""
        if self._started:
            return
        async with self._start_lock:
            if self._started:
                return
            await self._ensure_subscriptions()
            await self.state.open()
            self._started = True

    async def _ensure_subscriptions(self) -> None:
        """Create the durable subscriptions before anything is published (Pulsar keeps messages
        only for existing subscriptions)."""
        await self._subscribe_all([(self.topics.state, STATE_KEEPER), (self.topics.dlq, DLQ_SUBSCRIPTION)])

    async def _ensure_kind(self, kind: str) -> None:
        """The executors' subscriptions on a kind's priority topics, before its first message."""
        if kind in self._kinds_ready:
            return
        async with self._kind_lock:
            if kind not in self._kinds_ready:
                await self._subscribe_all(
                    [(self.topics.queue(p, kind), EXECUTOR_SUBSCRIPTION) for p in PRIORITY_LEVELS]
                )
                self._kinds_ready.add(kind)

    async def _subscribe_all(self, wanted: list[tuple[str, str]]) -> None:
        def create() -> None:
            for topic, sub in wanted:
                # a zero queue: the broker dispatches nothing to this consumer (one that took a
                # message and closed would send it back to be redelivered out of turn)
                c = self._client.subscribe(
                    topic,
                    sub,
                    consumer_type=pulsar.ConsumerType.Shared,
                    initial_position=pulsar.InitialPosition.Earliest,
                    receiver_queue_size=0,
                )
                c.close()

        try:
            await asyncio.to_thread(create)
        except pulsar.PulsarException as err:
            raise _to_thread_error("creating the queue subscriptions", err) from err

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for t in self._pull_threads:
            await asyncio.to_thread(t.join, 2.0)
        handles = [*self._consumers.values(), self._reply_consumer]
        for h in handles:
            if h is not None:
                await close_handle(h, self.engine)
        await self._producers.close()
        await self._replies_out.release()
        await self.state.release()

    # ------------------------------------------------------------------ the JSON requests
    async def call(self, req: dict[str, Any]) -> dict[str, Any]:
        """Answer one queue request (the same ops as the Zenoh queue service).

        Raises:
            ActionError: An invalid request or action (the message says why).
            BusConnectionError: Pulsar did not answer.
        """
        await self.start()
        op = req.get("op")
        handler = getattr(self, f"_op_{op}", None)
        if handler is None:
            raise ActionError(f"unknown request {op!r}")
        out: dict[str, Any] = await handler(req)
        return {"ok": True, **out}

    async def _op_submit(self, req: dict[str, Any]) -> dict[str, Any]:
        return await self.submit([action_from_dict(env) for env in req["actions"]])

    async def submit(self, actions: list[Action]) -> dict[str, Any]:
        """Queue validated actions (this queue's own objects: they are changed); every one is on
        the state log and its priority topic when this returns. Answers as ``submit`` does.

        Raises:
            BusConnectionError: Pulsar did not persist them.
        """
        await self.start()
        if any(a.idempotency_key for a in actions):
            await self.state.sync()
        out = []
        now = time.time_ns()
        reply_to = self.topics.reply(self.name)
        fresh: list[Action] = []
        for a in actions:
            key = a.idempotency_key
            first_id = self.state.idem.get(key) if key else None
            if first_id is None and key and any(f.idempotency_key == key for f in fresh):
                first_id = next(f.id for f in fresh if f.idempotency_key == key)
            if first_id is not None:
                first = self.state.get(first_id)
                status = first.status.value if first else ActionStatus.QUEUED.value
                out.append({"id": first_id, "duplicate": True, "status": status})
                continue
            a.status = ActionStatus.QUEUED
            a.created_ns = a.created_ns or now
            a.attempts = []
            fresh.append(a)
            out.append({"id": a.id, "duplicate": False, "status": a.status.value})
        # the state log and the priority topics, pipelined; both persisted before this returns
        producers: dict[str, Any] = {}
        for a in fresh:
            topic = self.topics.queue(a.priority, a.kind)
            if topic not in producers:
                await self._ensure_kind(a.kind)
                producers[topic] = await self._producers.get(topic)
        records: list[tuple[str, str, bytes]] = []
        runs: dict[Any, list[tuple[bytes, str, dict[str, str]]]] = {}
        for a in fresh:
            data = encode_action(a)
            records.append((a.id, "snapshot", data))
            props = {"eb-attempts": "0", "eb-reply-to": reply_to, "eb-kind": a.kind}
            runs.setdefault(producers[self.topics.queue(a.priority, a.kind)], []).append((data, a.id, props))
        await asyncio.gather(self.state._enqueue_records(records), _send_runs(runs))
        for a in fresh:
            if a.idempotency_key:
                self.state.idem.setdefault(a.idempotency_key, a.id)
        return {"ok": True, "actions": out}

    async def _enqueue(
        self, a: Action, reply_to: str, deliver_after_s: float = 0.0, *, encoded: bytes | None = None
    ) -> None:
        await self._ensure_kind(a.kind)
        producer = await self._producers.get(self.topics.queue(a.priority, a.kind))
        props = {"eb-attempts": str(a.attempt_count), "eb-reply-to": reply_to, "eb-kind": a.kind}
        kwargs: dict[str, Any] = {"partition_key": a.id, "properties": props}
        if deliver_after_s > 0:
            # the broker delays by whole ticks (delayedDeliveryTickTimeMillis, 1 s by default) and
            # delivers shorter delays at once; the executor waits out the rest (eb-not-before-ns)
            kwargs["deliver_after"] = timedelta(seconds=deliver_after_s)
            props["eb-not-before-ns"] = str(time.time_ns() + int(deliver_after_s * 1e9))
        await _send(producer, encode_action(a) if encoded is None else encoded, **kwargs)

    async def _op_get(self, req: dict[str, Any]) -> dict[str, Any]:
        await self.state.sync()
        a = self.state.get(str(req["id"]))
        return {"action": json.loads(encode_action(a)) if a else None}

    async def _op_get_many(self, req: dict[str, Any]) -> dict[str, Any]:
        await self.state.sync()
        ended = self.state.ended([str(i) for i in req["ids"]])
        return {"done": [json.loads(encode_action(a)) for a in ended]}

    async def _op_cancel(self, req: dict[str, Any]) -> dict[str, Any]:
        aid = str(req["id"])
        await self.state.sync()
        if self.state.get(aid) is None:
            return {"action": None}
        await self.state.publish_event(aid, "cancel")
        await self.state.sync()
        a = self.state.get(aid)
        if a is not None and a.status in (ActionStatus.QUEUED, ActionStatus.RETRYING):
            # Removed from the queue: its message is skipped (acknowledged) by whichever
            # executor receives it; a snapshot that says otherwise comes too late to count.
            a.status = ActionStatus.CANCELED
            await self.state.publish(a)
            if self._result_listener is not None:
                self._result_listener([(aid, a.copy())])
        return {"action": json.loads(encode_action(a)) if a else None}

    async def _op_backlog(self, _req: dict[str, Any]) -> dict[str, Any]:
        await self.state.sync()
        backlog: dict[str, dict[str, int]] = {}
        stats: dict[str, int] = {}
        redeliveries = 0  # attempts started beyond each action's first, over the kept actions
        for a in self.state.snapshot():
            stats[a.status.value] = stats.get(a.status.value, 0) + 1
            started = sum(1 for at in a.attempts if at.executor)  # not an expiry mark
            redeliveries += max(0, started - 1)
            if a.status in (ActionStatus.SUCCEEDED, ActionStatus.CANCELED):
                continue
            name = {"running": "leased"}.get(a.status.value, a.status.value)
            row = backlog.setdefault(
                f"{a.kind}/p{a.priority}", {"queued": 0, "leased": 0, "retrying": 0, "dead": 0}
            )
            row[name] += 1
        return {"backlog": backlog, "stats": stats, "redeliveries": redeliveries}

    async def _op_dlq(self, req: dict[str, Any]) -> dict[str, Any]:
        what = req.get("what", "list")
        await self.state.sync()
        dead = sorted(
            (a for a in self.state.snapshot() if a.status is ActionStatus.DEAD), key=lambda a: a.created_ns
        )
        if what == "list":
            return {"actions": [json.loads(encode_action(a)) for a in dead]}
        if what == "requeue":
            aid = str(req["id"])
            found = [a for a in dead if a.id == aid]
            if not found:
                raise ActionError(f"action {aid} is not in the dead-letter queue")
            a = found[0]
            now = time.time_ns()
            a.status = ActionStatus.QUEUED
            a.deadline_ns = 0 if a.deadline_ns and a.deadline_ns < now else a.deadline_ns
            a.budget_from = a.attempt_count
            a.cancel_requested = False
            await self.state.publish(a, "requeue")
            await self._enqueue(a, self.topics.reply(self.name))
            await asyncio.to_thread(self._ack_dead_letters, {aid})
            return {"id": a.id}
        if what == "purge":
            ids = [a.id for a in dead]
            await self.state.publish_event("purge", "purge", json.dumps(ids).encode())
            await asyncio.to_thread(self._ack_dead_letters, set(ids))
            await self.state.sync()
            return {"purged": len(ids)}
        raise ActionError(f"unknown dlq request {what!r}")

    def _ack_dead_letters(self, ids: set[str]) -> None:
        """Acknowledge the given actions on the DLQ subscription (others stay)."""
        c = self._client.subscribe(
            self.topics.dlq,
            DLQ_SUBSCRIPTION,
            consumer_type=pulsar.ConsumerType.Shared,
            receiver_queue_size=100,
        )
        try:
            while True:
                try:
                    msg = c.receive(timeout_millis=300)
                except pulsar.Timeout:
                    return
                if msg.partition_key() in ids:
                    c.acknowledge(msg)
        finally:
            c.close()

    # ------------------------------------------------------------------ replies (planner side)
    async def listen_results(self, callback: Callable[[list[tuple[str, Any]]], None]) -> None:
        """Results of this planner's actions: ``callback([(action_id, Action), ...])`` on a
        receiving thread, once per reply message."""
        self._result_listener = callback
        await self._open_replies()

    async def listen_feedback(
        self, action_id: str, callback: Callable[[str, Any], None]
    ) -> Callable[[], None]:
        """Feedback and result of one action: ``callback(topic, parsed JSON)`` with topic
        ``actions/fb/<id>`` or ``actions/result/<id>``; returns a function that stops listening."""
        self._listeners.setdefault(action_id, []).append(callback)
        await self._open_replies()

        def stop() -> None:
            cbs = self._listeners.get(action_id, [])
            if callback in cbs:
                cbs.remove(callback)
            if not cbs:
                self._listeners.pop(action_id, None)

        return stop

    async def _open_replies(self) -> None:
        await self.start()
        if self._reply_consumer is not None:
            return

        def on_reply(msg: Any) -> None:
            props = msg.properties()
            if props.get("eb-event", "batch") == "batch":
                records = _parse_records(msg.data())
            else:  # one reply per message (embodied_bus before 2026-12-03)
                records = [_legacy_record(msg, props.get("eb-id", ""), props.get("eb-event", ""))]
            if self._result_listener is not None:
                results = []
                for rec in records:
                    if rec.e == "result":
                        try:
                            results.append((rec.k, _snapshot(rec.d)))
                        except ActionError as err:
                            _log.warning("ignored a malformed result of %s: %s", rec.k, err)
                if results:
                    self._result_listener(results)
            if self._listeners:
                for rec in records:
                    cbs = self._listeners.get(rec.k)
                    if cbs:
                        topic = f"actions/{'result' if rec.e == 'result' else 'fb'}/{rec.k}"
                        data = msgspec.json.decode(rec.d)
                        for cb in list(cbs):
                            cb(topic, data)

        def receive(consumer: Any) -> None:
            # A plain thread that stops with the queue (closed before the bus): no client thread
            # calls into Python after close.
            while not self._stop.is_set():
                try:
                    msg = consumer.receive(timeout_millis=200)
                except pulsar.Timeout:
                    continue
                except pulsar.PulsarException:
                    if self._stop.is_set() or self.engine._closed:
                        return
                    self._stop.wait(0.2)
                    continue
                try:
                    consumer.acknowledge(msg)
                    on_reply(msg)
                except Exception as err:  # a closed loop or a bad reply never stops the thread
                    _log.debug("reply not delivered: %s", err)

        try:
            self._reply_consumer = await asyncio.to_thread(
                self._client.subscribe,
                self.topics.reply(self.name),
                f"eb-planner-{self.name}",
                consumer_type=pulsar.ConsumerType.Exclusive,
            )
            t = threading.Thread(
                target=receive, args=(self._reply_consumer,), name="eb-actions-replies", daemon=True
            )
            self._pull_threads.append(t)
            t.start()
        except pulsar.PulsarException as err:
            raise _to_thread_error("opening the reply topic", err) from err

    def _reply(self, reply_to: str, action_id: str, event: str, data: bytes) -> None:
        """Send a reply (``data``: JSON) to a planner, batched with the other replies to it (a
        JSON array of records, as on the state log)."""
        if reply_to:
            self._replies_out.add(reply_to, _record(action_id, event, data))

    async def feedback(self, action_id: str, data: bytes) -> None:
        """Executor side: send feedback to the planner that submitted ``action_id``."""
        held = self._held.get(action_id)
        if held is not None:
            self._reply(held[2], action_id, "fb", data)

    # ------------------------------------------------------------------ executor side
    async def listen_wake(self, callback: Callable[[], None], kinds: list[str]) -> None:
        """Take actions of ``kinds``; call ``callback`` (on a receiving thread) when one is ready
        to lease."""
        self._wake_callbacks.append(callback)
        await self.start()
        await self._open_consumers(kinds)

    async def _open_consumers(self, kinds: list[str]) -> None:
        if self._consumers or not kinds:
            return
        for kind in kinds:
            await self._ensure_kind(kind)

        def subscribe(priority: int) -> Any:
            return self._client.subscribe(
                [self.topics.queue(priority, k) for k in sorted(kinds)],
                EXECUTOR_SUBSCRIPTION,
                consumer_type=pulsar.ConsumerType.Shared,
                receiver_queue_size=self.prefetch,
                negative_ack_redelivery_delay_ms=NACK_REDELIVERY_MS,
                initial_position=pulsar.InitialPosition.Earliest,
                consumer_name=self.name,
            )

        try:
            for p in sorted(PRIORITY_LEVELS, reverse=True):
                self._consumers[p] = await asyncio.to_thread(subscribe, p)
        except pulsar.PulsarException as err:
            raise _to_thread_error("subscribing to the priority topics", err) from err
        self._inbox = _LoopInbox.of(asyncio.get_running_loop())
        for priority in self._consumers:
            self._arm(priority)

    def _arm(self, priority: int) -> None:
        """Ask a level's consumer for one message (``receive_async``; no thread per level).

        A level has at most one message received and not yet leased, plus those the client
        prefetched (``prefetch``, :data:`RECEIVER_QUEUE_SIZE` by default): a backlog stays with
        the broker, which hands it to whichever executor asks next; the executor leases the
        highest level it holds first.
        The next message of a level is asked for when :meth:`take` takes this one.
        """
        if self._stop.is_set():
            return
        consumer = self._consumers[priority]

        def got(result: Any, msg: Any) -> None:  # a client thread (or this one)
            if result != pulsar.Result.Ok:
                if self._stop.is_set() or self.engine._closed:
                    return
                _log.warning("receive from priority %d failed: %s", priority, result)
                if self._inbox is not None:
                    self._inbox.post(self._rearm_later, priority)
                return
            with self._ready_lock:
                self._seq += 1
                heapq.heappush(self._ready, (-priority, self._seq, (consumer, msg, time.monotonic())))
            for cb in self._wake_callbacks:
                cb()

        try:
            consumer._consumer.receive_async(got)
        except pulsar.PulsarException as err:  # closed meanwhile
            if not self._stop.is_set():
                _log.warning("receive from priority %d failed: %s", priority, err)
                if self._inbox is not None:
                    self._inbox.post(self._rearm_later, priority)

    def _rearm_later(self, priority: int) -> None:
        asyncio.get_running_loop().call_later(REARM_AFTER_S, self._arm, priority)

    def _slot_freed(self, action_id: str) -> None:
        with self._ready_lock:
            self._held.pop(action_id, None)

    def take(self, limit: int) -> list[tuple[Any, Any, float]]:
        """Pop up to ``limit`` received messages, highest priority first (no waiting); each
        must then go through :meth:`begin`."""
        out: list[tuple[Any, Any, float]] = []
        levels = []
        with self._ready_lock:
            while self._ready and len(out) < limit:
                neg_priority, _, item = heapq.heappop(self._ready)
                levels.append(-neg_priority)
                out.append(item)
        for priority in levels:  # outside the lock: a prefetched message comes back at once
            self._arm(priority)
        return out

    async def begin(
        self, item: tuple[Any, Any, float], executor: str, kinds: set[str], labels: dict[str, str]
    ) -> Action | None:
        """Start an attempt on a message from :meth:`take` (persisted on the state log when this
        returns), or settle it; None when there is nothing to run. If Pulsar fails meanwhile the
        message is handed back (negative ack) for a later delivery.

        Raises:
            BusConnectionError: The attempt could not be recorded (the message was handed back).
        """
        consumer, msg, received_mono = item
        try:
            return await self._start(consumer, msg, executor, kinds, labels, received_mono)
        except BaseException:  # incl. cancellation of a stopping executor
            try:
                consumer.negative_acknowledge(msg)
            except pulsar.PulsarException as nack_err:  # the consumer is gone: Pulsar redelivers
                _log.debug("hand-back after a failed start: %s", nack_err)
            raise

    async def _op_lease(self, req: dict[str, Any]) -> dict[str, Any]:
        await self._open_consumers(list(req["kinds"]))
        executor = str(req["executor"])
        kinds = set(req["kinds"])
        labels = req.get("labels") or {}
        taken = self.take(int(req.get("max", 1)))
        started = await asyncio.gather(*(self.begin(item, executor, kinds, labels) for item in taken))
        out = [json.loads(encode_action(a)) for a in started if a is not None]
        return {"action": out[0] if out else None, "actions": out}

    async def _start(
        self,
        consumer: Any,
        msg: Any,
        executor: str,
        kinds: set[str],
        labels: dict[str, str],
        received_mono: float,
    ) -> Action | None:
        """Turn a received message into a started attempt, or settle it (skip, expire, hand back)."""
        props = msg.properties()
        reply_to = props.get("eb-reply-to", "")
        try:
            env = decode_action(msg.data())
        except ActionError as err:
            _log.warning("dead-lettered an unreadable queue message: %s", err)
            await _send(
                await self._producers.get(self.topics.dlq), msg.data(), properties={"eb-error": str(err)}
            )
            consumer.acknowledge(msg)
            return None
        age_s = time.time() - msg.publish_timestamp() / 1000
        if msg.redelivery_count() > 0 or age_s > SYNC_AFTER_S:
            # An earlier delivery may have started it (Pulsar does not count a crashed
            # consumer's deliveries): read the state log up to its receipt before deciding
            # (its start was persisted before that executor ran it, so before this receipt; one
            # round serves every message received before it began).
            await self.state.caught_up(received_mono)
        now = time.time_ns()
        with self.state.peek(env.id) as view:  # not copied unless it is what runs
            if view is not None and view.status.terminal and view.budget_from >= env.budget_from:
                settled = True
            else:
                settled = False
                newer = view is not None and (view.budget_from, len(view.attempts)) > (
                    env.budget_from,
                    len(env.attempts),
                )
                if view is not None and newer:
                    a = view.copy()  # a redelivery: the state log knows more (attempts, checkpoint)
                else:
                    a = env  # the message is at least as new as this executor's view
                    a.cancel_requested = a.cancel_requested or bool(view and view.cancel_requested)
        if settled:
            consumer.acknowledge(msg)  # already settled (a duplicate delivery, or canceled)
            return None
        if a.kind not in kinds or not all(labels.get(k) == v for k, v in a.selector.items()):
            consumer.negative_acknowledge(msg)  # another executor serves this kind or selector
            return None
        for i, att in enumerate(a.attempts):  # an attempt left open: its executor died
            if att.ended_ns == 0:
                a.attempts[i] = replace(
                    att,
                    ended_ns=now,
                    outcome="lost",
                    reason=f"executor {att.executor} stopped answering (disconnected or process died)",
                )
        if a.cancel_requested:
            a.status = ActionStatus.CANCELED
            await self._settle(a, msg, consumer, reply_to)
            return None
        if a.deadline_ns and a.deadline_ns < now:
            a.attempts.append(
                Attempt(
                    a.attempt_count + 1, "", now, now, "expired", "deadline passed before the action started"
                )
            )
            a.status = ActionStatus.DEAD
            await self._settle(a, msg, consumer, reply_to)
            return None
        if self.policy.exhausted(a.attempt_count - a.budget_from):
            a.status = ActionStatus.DEAD
            await self._settle(a, msg, consumer, reply_to)
            return None
        tried = a.executors_tried()
        if (
            executor in tried
            and self._handbacks.get(a.id, 0) < MAX_HANDBACKS
            and set(self.live_executors(a.kind)) - tried - {executor}  # asked only when it matters
        ):
            if len(self._handbacks) > 10_000:  # actions handed back and then run elsewhere
                self._handbacks.clear()
            self._handbacks[a.id] = self._handbacks.get(a.id, 0) + 1
            consumer.negative_acknowledge(msg)  # a live executor that has not failed it retries it
            return None
        self._handbacks.pop(a.id, None)
        wait_s = (int(props.get("eb-not-before-ns", "0") or 0) - time.time_ns()) / 1e9
        if wait_s > 0:  # the rest of a retry backoff the broker rounded away
            await asyncio.sleep(wait_s)
            now = time.time_ns()
        a.attempts.append(Attempt(a.attempt_count + 1, executor, now))
        a.status = ActionStatus.RUNNING
        await self.state.publish(a)  # the attempt is counted before the handler runs
        with self._ready_lock:
            self._held[a.id] = (msg, a, reply_to, consumer)
        return a.copy()

    async def _settle(self, a: Action, msg: Any, consumer: Any, reply_to: str) -> None:
        """A terminal state: dead-letter topic (if dead), state log, reply, then ack."""
        data = encode_action(a)
        if a.status is ActionStatus.DEAD:
            dlq = await self._producers.get(self.topics.dlq)
            await _send(dlq, data, partition_key=a.id, properties={"eb-attempts": str(a.attempt_count)})
        await self.state.publish(a, encoded=data)
        self._reply(reply_to, a.id, "result", data)
        consumer.acknowledge(msg)

    def _holding(self, req: dict[str, Any]) -> tuple[Any, Action, str, Any]:
        held = self._held.get(str(req["id"]))
        if held is None or held[1].attempts[-1].executor != req["executor"]:
            raise ActionError(f"{req['executor']} does not hold action {req['id']}")
        return held

    async def _op_extend(self, req: dict[str, Any]) -> dict[str, Any]:
        a = self._holding(req)[1]  # Pulsar holds the message while the consumer lives
        return {"cancel_requested": self.state.cancel_requested(a.id)}

    async def _op_checkpoint(self, req: dict[str, Any]) -> dict[str, Any]:
        a = self._holding(req)[1]
        a.checkpoint = req.get("state")
        await self.state.publish(a)
        return {}

    def _close_ok(self, req: dict[str, Any]) -> tuple[Any, Action, str, Any]:
        """Close the held attempt of an ack request as ``ok`` and set the outcome (no I/O)."""
        held = self._holding(req)
        a = held[1]
        a.attempts[-1] = a.attempts[-1].ended(time.time_ns(), "ok")
        result = req.get("result")
        cancelled = self.state.cancel_requested(a.id)
        a.status = ActionStatus.CANCELED if cancelled and result is None else ActionStatus.SUCCEEDED
        a.result = result
        return held

    async def _op_ack(self, req: dict[str, Any]) -> dict[str, Any]:
        msg, a, reply_to, consumer = self._close_ok(req)
        try:
            await self._settle(a, msg, consumer, reply_to)
        finally:
            self._slot_freed(a.id)
        return {"status": a.status.value}

    async def _op_ack_many(self, req: dict[str, Any]) -> dict[str, Any]:
        """Acks of one executor's loop turn: their state records go out together, and each is
        acknowledged on Pulsar (and its result sent) once its record is persisted."""
        answers: list[dict[str, Any]] = []
        settling: list[tuple[int, bytes, tuple[Any, Action, str, Any]]] = []
        for item in req["acks"]:
            try:
                held = self._close_ok(item)
            except (ActionError, KeyError) as err:
                answers.append({"ok": False, "error": str(err)})
                continue
            a = held[1]
            settling.append((len(answers), encode_action(a), held))
            answers.append({"ok": True, "status": a.status.value})
        persisted = self.state._enqueue_records([(h[1].id, "snapshot", data) for _, data, h in settling])
        try:
            await persisted
            failed = None
        except BusConnectionError as err:
            failed = str(err)
        for i, data, (msg, a, reply_to, consumer) in settling:
            self._slot_freed(a.id)
            if failed is not None:
                answers[i] = {"ok": False, "error": failed}
                continue  # not acknowledged: Pulsar redelivers it (at least once)
            self._reply(reply_to, a.id, "result", data)
            consumer.acknowledge(msg)
        return {"answers": answers}

    async def _op_nack(self, req: dict[str, Any]) -> dict[str, Any]:
        msg, a, reply_to, consumer = self._holding(req)
        now = time.time_ns()
        permanent = bool(req.get("permanent"))
        a.attempts[-1] = replace(
            a.attempts[-1],
            ended_ns=now,
            outcome="rejected" if permanent else "nack",
            reason=str(req.get("reason", "")),
        )
        try:
            if self.state.cancel_requested(a.id):
                a.status = ActionStatus.CANCELED
                await self._settle(a, msg, consumer, reply_to)
            elif permanent or self.policy.exhausted(a.attempt_count - a.budget_from):
                a.status = ActionStatus.DEAD
                await self._settle(a, msg, consumer, reply_to)
            else:
                a.status = ActionStatus.RETRYING
                await self.state.publish(a)
                # retry-letter pattern: the retry is a new message after the backoff, then the ack
                await self._enqueue(a, reply_to, self.policy.backoff_s(a.attempt_count))
                consumer.acknowledge(msg)
        finally:
            self._slot_freed(a.id)
        return {"status": a.status.value}
