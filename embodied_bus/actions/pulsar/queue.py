"""The action queue on Apache Pulsar: no queue service, the queue is Pulsar's topics.

Planners submit to the priority topics and the state log (both persisted before ``submit``
returns; a batch is not atomic), read actions back from the state log (a planner that was away
finds its results there) and receive results and feedback on a non-persistent reply topic of
their own. Dead letters go to the dead-letter topic and the log with the reason of every
attempt; ``requeue`` gives one a fresh attempt budget.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import pulsar

from embodied_bus.actions import lifecycle
from embodied_bus.actions.model import Action, ActionError, ActionStatus, encode_action
from embodied_bus.actions.policy import RetryPolicy
from embodied_bus.actions.pulsar.connection import QueueConnection
from embodied_bus.actions.pulsar.records import Event, parse_records, parse_snapshot
from embodied_bus.actions.pulsar.sending import (
    send_runs,
    unavailable,
)
from embodied_bus.actions.pulsar.sessions import advance
from embodied_bus.actions.pulsar.topics import (
    DLQ_SUBSCRIPTION,
)
from embodied_bus.actions.pulsar.worker import PulsarWorker
from embodied_bus.actions.queue import (
    ActionQueue,
    Backlog,
    ExecutorSpec,
    PulsarQueueOptions,
    QueueOptions,
    Submitted,
    WorkerLink,
)
from embodied_bus.engines.pulsar import PulsarEngine, close_handle
from embodied_bus.errors import BusConfigError

__all__ = ["PulsarQueue", "open_pulsar_queue"]

_log = logging.getLogger("embodied_bus.actions.pulsar")


def open_pulsar_queue(bus: Any, options: QueueOptions) -> ActionQueue:
    """The action queue of a Pulsar bus.

    Raises:
        BusConfigError: Options of another backend were given, e.g. sealed queue messages
            (:class:`~embodied_bus.actions.queue.ZenohQueueOptions`): on Pulsar the broker
            authenticates each party and authorizes it per topic (see the security page).
    """
    try:
        pulsar_options = options.backend_options(PulsarQueueOptions, "Pulsar")
    except BusConfigError as err:
        raise BusConfigError(
            f"{err}; on Pulsar give each planner and executor its own broker credentials "
            "(token=...) and grant their roles per topic"
        ) from None
    return PulsarQueue(bus.engine, prefetch=pulsar_options.prefetch)


class PulsarQueue(ActionQueue):
    """The planner's end of the action queue on Pulsar, and the maker of executors' links.

    Args:
        engine: An open Pulsar engine.
        prefetch: Its executors' actions per priority level fetched ahead of a free slot
            (None: :data:`~embodied_bus.actions.pulsar.worker.RECEIVER_QUEUE_SIZE`).

    Retry policies are records in the state log (:meth:`set_policy`): every executor of the
    queue applies the same one to a kind.
    """

    def __init__(self, engine: PulsarEngine, *, prefetch: int | None = None) -> None:
        #: What this planner side and the executors' links share.
        self.conn = QueueConnection(engine)
        self.engine = engine
        self.prefetch = prefetch
        self.topics = self.conn.topics
        self.state = self.conn.state
        self.producers = self.conn.producers
        #: This planner's reply topic is ``topics.reply(name)``.
        self.name = uuid.uuid4().hex[:12]
        self._closed = False
        self._reply_consumer: Any = None
        self._reply_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._on_result: Callable[[Action], None] | None = None
        self._feedback: dict[str, list[tuple[Callable[[Any], None], Callable[[], None]]]] = {}

    # ------------------------------------------------------------------ set-up
    async def start(self) -> None:
        """Create the durable subscriptions and open the state log (idempotent)."""
        await self.conn.start()

    async def ensure_kind(self, kind: str) -> None:
        """The executors' subscriptions on a kind's priority topics."""
        await self.conn.ensure_kind(kind)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._reply_thread is not None:
            await asyncio.to_thread(self._reply_thread.join, 2.0)
        if self._reply_consumer is not None:
            await close_handle(self._reply_consumer, self.engine)
        await self.conn.close()

    # ------------------------------------------------------------------ planner side
    async def submit(self, actions: Sequence[Action]) -> list[Submitted]:
        await self.start()
        if any(a.idempotency_key for a in actions):
            await self.state.sync()
        out: list[Submitted] = []
        now = time.time_ns()
        reply_to = self.topics.reply(self.name)
        fresh: list[Action] = []
        for a in actions:
            known = self._known(a, fresh)
            if known is not None:
                out.append(known)
                continue
            a.status = ActionStatus.QUEUED
            a.created_ns = a.created_ns or now
            a.attempts = []
            fresh.append(a)
            out.append(Submitted(a.id, False, a.status))
        # the state log and the priority topics, pipelined; both persisted before this returns
        producers: dict[str, Any] = {}
        for a in fresh:
            topic = self.topics.queue(a.priority, a.kind)
            if topic not in producers:
                await self.ensure_kind(a.kind)
                producers[topic] = await self.producers.get(topic)
        records: list[tuple[str, Event, bytes]] = []
        runs: dict[Any, list[tuple[bytes, str, dict[str, str]]]] = {}
        for a in fresh:
            data = encode_action(a)
            records.append((a.id, Event.SNAPSHOT, data))
            if a.session is not None:  # it goes on its topic when it is its session's next (advance)
                records.append((a.id, Event.ROUTE, msgspec.json.encode(reply_to)))
                continue
            props = {"eb-attempts": "0", "eb-reply-to": reply_to, "eb-kind": a.kind}
            runs.setdefault(producers[self.topics.queue(a.priority, a.kind)], []).append((data, a.id, props))
        logged, _ = await asyncio.gather(self.state.enqueue(records), send_runs(runs))
        for a in fresh:
            if a.idempotency_key:
                self.state.idem.setdefault(a.idempotency_key, a.id)
        sessions = {a.session for a in fresh if a.session is not None}
        if sessions:
            await self.state.read_back(logged)
            # together: their messages and records are sent pipelined, not one round trip each
            await asyncio.gather(*(advance(self.conn, session, reply_to) for session in sessions))
        return out

    def _known(self, a: Action, fresh: list[Action]) -> Submitted | None:
        """The answer for an action submitted before (same id, or same idempotency key)."""
        first_id = a.id if self.state.get(a.id) is not None else None
        key = a.idempotency_key
        if first_id is None and key:
            first_id = self.state.idem.get(key) or next(
                (f.id for f in fresh if f.idempotency_key == key), None
            )
        if first_id is None:
            return None
        first = self.state.get(first_id)
        return Submitted(first_id, True, first.status if first else ActionStatus.QUEUED)

    async def set_policy(self, policy: RetryPolicy, kind: str | None = None) -> None:
        await self.conn.set_policy(policy, kind)

    async def enqueue(self, a: Action, reply_to: str, deliver_after_s: float = 0.0) -> None:
        """Put ``a`` on its priority topic (a retry after ``deliver_after_s``, a requeue)."""
        await self.conn.enqueue(a, reply_to, deliver_after_s)

    async def get(self, action_id: str) -> Action | None:
        await self.start()
        await self.state.sync()
        return self.state.get(action_id)

    async def ended(self, action_ids: Sequence[str]) -> list[Action]:
        await self.start()
        await self.state.sync()
        return self.state.ended(list(action_ids))

    async def cancel(self, action_id: str) -> Action | None:
        await self.start()
        await self.state.sync()
        if self.state.get(action_id) is None:
            return None
        await self.state.enqueue([(action_id, Event.CANCEL, b"")])
        await self.state.sync()
        a = self.state.get(action_id)
        if a is not None and a.status in (ActionStatus.QUEUED, ActionStatus.RETRYING):
            # removed from the queue: its message is settled by whichever executor receives it
            lifecycle.cancel(a)
            logged = await self.state.publish(a)
            if self._on_result is not None:
                self._on_result(a.copy())
            if a.session is not None:  # skipped: its session goes on
                await self.state.read_back(logged)
                await advance(self.conn, a.session, self.topics.reply(self.name))
        return a

    async def _dead(self) -> list[Action]:
        await self.start()
        await self.state.sync()
        return sorted(
            (a for a in self.state.snapshot() if a.status is ActionStatus.DEAD), key=lambda a: a.created_ns
        )

    async def dead_letters(self) -> list[Action]:
        return await self._dead()

    async def requeue(self, action_id: str) -> Action:
        found = [a for a in await self._dead() if a.id == action_id]
        if not found:
            raise ActionError(f"action {action_id} is not in the dead-letter queue")
        a = found[0]
        lifecycle.requeue(a, time.time_ns())
        # the message first: a waiting action on the log always has a message to run it
        await self.enqueue(a, self.topics.reply(self.name))
        await self.state.publish(a, Event.REQUEUE)
        if a.session is not None:
            await self.state.enqueue([(a.id, Event.RELEASE, b"")])
        await asyncio.to_thread(self._ack_dead_letters, {action_id})
        return a

    async def purge_dead(self) -> int:
        dead = await self._dead()
        ids = [a.id for a in dead]
        await self.state.enqueue([("purge", Event.PURGE, msgspec.json.encode(ids))])
        await asyncio.to_thread(self._ack_dead_letters, set(ids))
        await self.state.sync()
        for session in {a.session for a in dead if a.session is not None}:  # held ones go on
            await advance(self.conn, session, self.topics.reply(self.name))
        return len(ids)

    def _ack_dead_letters(self, ids: set[str]) -> None:
        """Acknowledge the given actions on the dead-letter subscription (others stay)."""
        c = self.engine.client.subscribe(
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

    async def backlog(self) -> Backlog:
        await self.start()
        await self.state.sync()
        actions = self.state.snapshot()
        # attempts started beyond each action's first, over the actions the view keeps
        redeliveries = sum(max(0, sum(1 for t in a.attempts if t.executor) - 1) for a in actions)
        released = self.state.released
        blocked = {
            a.id
            for a in actions
            if a.session is not None
            and a.status is ActionStatus.QUEUED
            and not a.attempts
            and a.id not in released
        }
        return Backlog.count(actions, redeliveries=redeliveries, blocked=blocked)

    # ------------------------------------------------------------------ replies
    async def watch_results(self, on_result: Callable[[Action], None]) -> None:
        self._on_result = on_result
        await self._open_replies()

    async def watch_feedback(
        self, action_id: str, on_feedback: Callable[[Any], None], on_end: Callable[[], None]
    ) -> Callable[[], None]:
        entry = (on_feedback, on_end)
        self._feedback.setdefault(action_id, []).append(entry)
        await self._open_replies()

        def stop() -> None:
            entries = self._feedback.get(action_id, [])
            if entry in entries:
                entries.remove(entry)
            if not entries:
                self._feedback.pop(action_id, None)

        return stop

    def _on_reply(self, data: bytes) -> None:
        """One reply message (loop thread)."""
        try:
            records = parse_records(data)
        except ActionError as err:
            _log.warning("ignored a malformed reply: %s", err)
            return
        for rec in records:
            if rec.e == Event.RESULT:
                try:
                    action = parse_snapshot(rec.d)
                except ActionError as err:
                    _log.warning("ignored a malformed result of %s: %s", rec.k, err)
                    continue
                if self._on_result is not None:
                    self._on_result(action)
                for _, on_end in list(self._feedback.get(rec.k, [])):
                    on_end()
            elif rec.e == Event.FEEDBACK:
                entries = self._feedback.get(rec.k)
                if entries:
                    try:
                        value = msgspec.json.decode(rec.d)
                    except (msgspec.DecodeError, RecursionError):
                        continue
                    for on_feedback, _ in list(entries):
                        on_feedback(value)

    async def _open_replies(self) -> None:
        await self.start()
        if self._reply_consumer is not None:
            return
        loop = asyncio.get_running_loop()

        def receive(consumer: Any) -> None:
            # a plain thread that stops with the queue (closed before the bus): no client thread
            # calls into Python after close
            while not self._stop.is_set():
                try:
                    msg = consumer.receive(timeout_millis=200)
                except pulsar.Timeout:
                    continue
                except pulsar.PulsarException:
                    if self._stop.is_set() or self.engine.closed:
                        return
                    self._stop.wait(0.2)
                    continue
                try:
                    consumer.acknowledge(msg)
                    loop.call_soon_threadsafe(self._on_reply, msg.data())
                except Exception as err:  # a closed loop or a bad reply never stops the thread
                    _log.debug("reply not delivered: %s", err)

        try:
            self._reply_consumer = await asyncio.to_thread(
                self.engine.client.subscribe,
                self.topics.reply(self.name),
                f"eb-planner-{self.name}",
                consumer_type=pulsar.ConsumerType.Exclusive,
            )
        except pulsar.PulsarException as err:
            raise unavailable("opening the reply topic", err) from err
        self._reply_thread = threading.Thread(
            target=receive, args=(self._reply_consumer,), name="eb-actions-replies", daemon=True
        )
        self._reply_thread.start()

    # ------------------------------------------------------------------ executors
    def worker(self, spec: ExecutorSpec) -> WorkerLink:
        return PulsarWorker(self.conn, spec, prefetch=self.prefetch)
