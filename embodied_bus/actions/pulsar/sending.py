"""Sending on Pulsar from the event loop: sends that complete futures when the broker has
persisted them, producers opened on first use, and replies to planners batched per topic.

Client callbacks come from the client's threads; :class:`LoopInbox` hands them to the event
loop with one wake-up per burst.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pulsar

from embodied_bus.actions.pulsar.records import Event, chunks, encode_record
from embodied_bus.actions.queue import QueueUnavailable
from embodied_bus.engines.pulsar import PulsarEngine, close_handle
from embodied_bus.engines.pulsar.native import send_async
from embodied_bus.errors import BusConnectionError

__all__ = [
    "REPLY_PRODUCERS",
    "LoopInbox",
    "Producers",
    "Replies",
    "deliver_after",
    "send",
    "send_runs",
    "send_settling",
    "unavailable",
]

_log = logging.getLogger("embodied_bus.actions.pulsar")

#: Producers to planners' reply topics a process keeps open.
REPLY_PRODUCERS = 64


def unavailable(what: str, err: Exception) -> QueueUnavailable:
    """The error for a Pulsar call that failed (the broker is away or refused it)."""
    return QueueUnavailable(f"Pulsar action queue: {what} failed: {err}")


class LoopInbox:
    """Calls from client threads into one event loop, with one wake-up of the loop per burst
    (``call_soon_threadsafe`` per call wakes it once per persisted message)."""

    _of: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopInbox] = weakref.WeakKeyDictionary()

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> LoopInbox:
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


def send_settling(
    producer: Any,
    data: bytes,
    futs: list[asyncio.Future[Any]],
    *,
    on_done: Callable[[], None] | None = None,
    **kwargs: Any,
) -> None:
    """Send; complete ``futs`` (of the running loop) with the message id when the broker has
    persisted the message, or fail them with :class:`QueueUnavailable`; ``on_done`` is
    called (on the loop) first."""
    loop = asyncio.get_running_loop()

    def settle(error: BusConnectionError | None, msg_id: Any) -> None:
        if on_done is not None:
            on_done()
        for fut in futs:
            if fut.done():
                continue
            if error is None:
                fut.set_result(msg_id)
            else:
                fut.set_exception(error)

    inbox = LoopInbox.of(loop)

    def sent(result: Any, msg_id: Any) -> None:  # client thread
        error = None
        if result != pulsar.Result.Ok:
            error = unavailable("persisting an action message", RuntimeError(str(result)))
        inbox.post(settle, error, msg_id)

    try:
        send_async(producer, data, sent, **kwargs)
    except pulsar.PulsarException as err:
        settle(unavailable("sending an action message", err), None)


async def send(producer: Any, data: bytes, **kwargs: Any) -> Any:
    """Send and wait for the broker's acknowledgement without blocking the event loop; returns
    the message id."""
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    send_settling(producer, data, [fut], **kwargs)
    return await fut


def send_runs(runs: dict[Any, list[tuple[bytes, str, dict[str, str]]]]) -> asyncio.Future[None]:
    """Send runs of messages, each ``(data, key, properties)``, one run per producer; the future
    completes when the broker has persisted them all (or fails with
    :class:`QueueUnavailable`). Only the last message of a run carries a callback: the client
    completes one producer's sends in order and fails the ones pending after a failed one, so
    that callback confirms the run."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    left = [len(runs)]
    inbox = LoopInbox.of(loop)

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
            error = unavailable("persisting an action message", RuntimeError(str(result)))
        inbox.post(settle, error)

    if not runs:
        done.set_result(None)
    for producer, run in runs.items():
        last = len(run) - 1
        try:
            for i, (data, key, props) in enumerate(run):
                send_async(producer, data, sent if i == last else None, partition_key=key, properties=props)
        except pulsar.PulsarException as err:
            settle(unavailable("sending an action message", err))
    return done


class Producers:
    """Producers created on first use, closed together (``limit``: the most kept open)."""

    def __init__(self, engine: PulsarEngine, *, limit: int | None = None, **options: Any) -> None:
        self._engine = engine
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
                        self._engine.client.create_producer, topic, batching_enabled=False, **self._options
                    )
                except pulsar.PulsarException as err:
                    raise unavailable(f"creating a producer on {topic}", err) from err
                while self._limit is not None and len(self._open) > self._limit:
                    _, old = self._open.popitem(last=False)
                    await close_handle(old, self._engine)
            return self._open[topic]

    async def close(self) -> None:
        for p in self._open.values():
            await close_handle(p, self._engine)
        self._open.clear()


def deliver_after(seconds: float) -> timedelta:
    """A ``deliver_after`` of ``seconds``."""
    return timedelta(seconds=seconds)


class Replies:
    """Replies to planners from the planners and executors of one engine: the records for one
    planner's topic that gather while its previous message is being sent go out together (one
    message in flight per topic), whichever executor wrote them. :meth:`acquire` and
    :meth:`release` count the users; the last one closes the producers."""

    _shared: weakref.WeakKeyDictionary[Any, Replies] = weakref.WeakKeyDictionary()

    @classmethod
    def acquire(cls, engine: PulsarEngine) -> Replies:
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
        self._producers = Producers(engine, limit=REPLY_PRODUCERS, block_if_queue_full=False)
        self._pending: dict[str, list[bytes]] = {}  # topic -> records not sent yet
        self._in_flight: set[str] = set()  # topics with a message being sent
        self._tasks: set[asyncio.Future[None]] = set()

    def add(self, topic: str, action_id: str, event: Event, data: bytes) -> None:
        """Queue a record for ``topic`` (loop thread); sent after this turn of the loop or when
        the topic's message in flight is out."""
        if not topic:
            return
        pending = self._pending.get(topic)
        if pending is None:
            pending = self._pending[topic] = []
            if topic not in self._in_flight:
                self._schedule(topic)
        pending.append(encode_record(action_id, event, data))

    def _schedule(self, topic: str) -> None:
        task = asyncio.ensure_future(self._send(topic))  # runs after this turn
        self._tasks.add(task)  # referenced until done (the loop keeps only weak ones)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, topic: str) -> None:
        if topic in self._in_flight or topic not in self._pending:
            return
        self._in_flight.add(topic)
        try:
            producer = await self._producers.get(topic)
        except BusConnectionError as err:  # the planner's topic is gone
            records = self._pending.pop(topic, [])
            _log.debug("%d replies to %s not sent: %s", len(records), topic, err)
            self._in_flight.discard(topic)
            return
        runs = chunks(self._pending.pop(topic, []))
        inbox = LoopInbox.of(asyncio.get_running_loop())
        left = [len(runs)]

        def done() -> None:  # loop thread
            left[0] -= 1
            if left[0] == 0:
                self._in_flight.discard(topic)
                if topic in self._pending:
                    self._schedule(topic)

        def sent(_result: Any, _msg_id: Any) -> None:  # client thread
            inbox.post(done)

        for run in runs:
            try:
                send_async(producer, b"[" + b",".join(run) + b"]", sent)
            except pulsar.PulsarException as err:  # e.g. the producer was closed
                _log.debug("%d replies to %s not sent: %s", len(run), topic, err)
                done()
        if not runs:
            self._in_flight.discard(topic)
