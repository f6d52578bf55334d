"""State tables on Pulsar: one compacted topic per table.

The key is the message key and an empty message a delete, so the broker's compaction keeps the
latest message of every key and drops deleted keys. A table reads the topic with
``read_compacted`` from its start (the compacted ledger, then what came after) on a thread of
its own, and keeps following it. Writes are batched (a late reader takes a batch per read).

Compaction runs when the operator's threshold policy says so (``pulsar-admin topics
set-compaction-threshold``, or the namespace's); until then a late reader reads every write.
A durable subscription (``eb-state-keeper``) keeps the writes the compaction has not covered;
the namespace's retention policy bounds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pulsar

from embodied_bus.engines.blocking import call_bounded
from embodied_bus.engines.pulsar import PulsarEngine, close_handle
from embodied_bus.engines.pulsar.native import native_reader, send_async
from embodied_bus.errors import BusConfigError, BusConnectionError, EmbodiedBusError, PublishError
from embodied_bus.state.codec import decode_pulsar_value, encode_pulsar_value
from embodied_bus.state.model import StateEntry
from embodied_bus.state.table import ApplyFn, StateOptions

if TYPE_CHECKING:
    from embodied_bus.bus import Bus

__all__ = ["KEEPER", "PulsarState", "open_pulsar_state", "state_topic"]

_log = logging.getLogger("embodied_bus.state")
#: Durable subscription that keeps a table's writes until compaction covers them.
KEEPER = "eb-state-keeper"
#: Entries the reading thread hands to the loop at once, at most.
HAND_OVER = 10_000
#: A reading thread's wait for the next write, ms (how soon it notices it should stop).
READ_WAIT_MS = 200
#: While loading, a gap this long between messages makes the reader ask whether it reached the
#: end of the topic, ms.
LOAD_WAIT_MS = 20


def state_topic(engine: PulsarEngine, table: str) -> str:
    """The compacted topic of ``table`` (outside the stream topics' ``eb.`` prefix)."""
    s = engine.settings
    return f"persistent://{s.tenant}/{s.pulsar_namespace}/eb-state.{s.namespace}.{table}"


class PulsarState:
    """One table on its compacted topic."""

    def __init__(self, engine: PulsarEngine, table: str, options: StateOptions) -> None:
        self.engine = engine
        self.topic = state_topic(engine, table)
        self.options = options
        self._reader: Any = None
        self._producer: Any = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._apply: ApplyFn | None = None
        self._lock = threading.Lock()
        self._echoes: dict[tuple[str, int], asyncio.Future[None]] = {}

    async def load(self, apply: ApplyFn) -> list[StateEntry]:
        loop = asyncio.get_running_loop()
        try:
            self._reader = await call_bounded(
                lambda: self.engine.client.create_reader(
                    self.topic,
                    pulsar.MessageId.earliest,
                    is_read_compacted=True,
                    receiver_queue_size=HAND_OVER,
                ),
                self.options.request_timeout_s,
                name="eb-state-reader",
            )
        except (pulsar.PulsarException, TimeoutError) as err:
            raise BusConnectionError(f"cannot read state topic {self.topic}: {err or 'timed out'}") from err
        loaded: asyncio.Future[list[StateEntry]] = loop.create_future()
        self._apply = apply
        self._thread = threading.Thread(
            target=self._follow,
            args=(loop, loaded),
            name=f"eb-state-{self.topic.rsplit('.')[-1]}",
            daemon=True,
        )
        self._thread.start()
        return await loaded

    def _entry(self, msg: Any) -> StateEntry | None:
        key = msg.partition_key()
        try:
            return decode_pulsar_value(key, msg.data())
        except BusConfigError as err:
            _log.warning("state topic %s: %s (ignored)", self.topic, err)
            return None

    def _read_burst(self, reader: Any, first: StateEntry | None, wait_ms: int = 0) -> list[StateEntry]:
        """What the reader has at hand (after ``first``; waiting ``wait_ms`` for each next
        message), up to :data:`HAND_OVER` entries."""
        out = [first] if first is not None else []
        while len(out) < HAND_OVER:
            try:
                entry = self._entry(reader.read_next(wait_ms))
            except pulsar.Timeout:
                break
            if entry is not None:
                out.append(entry)
        return out

    def _read_all(self, reader: Any) -> list[StateEntry]:
        """The latest entry of every key with a value, reading the topic to its end now."""
        table: dict[str, StateEntry] = {}
        while True:
            batch = self._read_burst(reader, None, LOAD_WAIT_MS)
            for entry in batch:
                if entry.deleted:
                    table.pop(entry.key, None)
                else:
                    table[entry.key] = entry
            if not batch and not reader.has_message_available():
                return list(table.values())

    def _follow(self, loop: asyncio.AbstractEventLoop, loaded: asyncio.Future[list[StateEntry]]) -> None:
        reader = native_reader(self._reader)
        try:
            loop.call_soon_threadsafe(_settle, loaded, self._read_all(reader))
        except (pulsar.PulsarException, RuntimeError) as err:
            with contextlib.suppress(RuntimeError):  # RuntimeError: the loop is gone
                error = BusConnectionError(f"reading state topic {self.topic} failed: {err}")
                loop.call_soon_threadsafe(_fail, loaded, error)
            return
        while not self._stop.is_set():
            try:
                batch = self._read_burst(reader, self._entry(reader.read_next(READ_WAIT_MS)))
            except pulsar.Timeout:
                continue
            except pulsar.AlreadyClosed:
                return
            except pulsar.PulsarException as err:  # the client reconnects by itself: read on
                if not self._stop.is_set():
                    _log.warning("state topic %s: %s (reading on)", self.topic, err)
                    self._stop.wait(READ_WAIT_MS / 1000)
                continue
            if batch:
                try:
                    loop.call_soon_threadsafe(self._arrived, batch)
                except RuntimeError:  # the loop is gone
                    return

    def _arrived(self, entries: list[StateEntry]) -> None:
        if self._apply is not None:
            self._apply(entries)
        for e in entries:
            fut = self._echoes.pop((e.key, e.stamp_ns), None)
            if fut is not None and not fut.done():
                fut.set_result(None)

    async def _producer_ready(self) -> Any:
        if self._producer is None:
            client = self.engine.client

            def create() -> Any:
                client.subscribe(
                    self.topic, KEEPER, initial_position=pulsar.InitialPosition.Earliest
                ).close()  # keeps what compaction has not covered yet
                return client.create_producer(
                    self.topic,
                    batching_enabled=True,
                    batching_max_publish_delay_ms=1,
                    block_if_queue_full=True,
                    max_pending_messages=HAND_OVER,
                )

            try:
                timeout_s = self.options.request_timeout_s
                self._producer = await call_bounded(create, timeout_s, name="eb-state-producer")
            except (pulsar.PulsarException, TimeoutError) as err:
                why = err or "timed out"
                raise BusConnectionError(f"cannot write state topic {self.topic}: {why}") from err
        return self._producer

    async def put(self, entries: Sequence[StateEntry]) -> list[StateEntry]:
        producer = await self._producer_ready()
        loop = asyncio.get_running_loop()
        last = entries[-1]
        mark = (last.key, 0 if last.deleted else last.stamp_ns)  # a delete reads back without its stamp
        echo: asyncio.Future[None] = loop.create_future()
        self._echoes[mark] = echo
        try:
            await asyncio.to_thread(_send_all, producer, entries)
        except BaseException:
            self._echoes.pop(mark, None)
            raise
        try:  # stored; wait (briefly) until this table has read it back, so reads see it
            await asyncio.wait_for(echo, self.options.request_timeout_s)
            return []
        except TimeoutError:
            self._echoes.pop(mark, None)
            return list(entries)

    async def close(self) -> None:
        self._apply = None
        self._stop.set()
        if self.engine.closed:
            return
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, (READ_WAIT_MS / 1000) * 5)
        for handle in (self._producer, self._reader):
            if handle is not None:
                await close_handle(handle, self.engine)


def _send_all(producer: Any, entries: Sequence[StateEntry]) -> None:
    """Send ``entries`` in order and wait until the broker stored all (a worker thread)."""
    done = threading.Event()
    left = [len(entries)]
    failures: list[str] = []
    lock = threading.Lock()

    def sent(result: Any, _msg_id: Any) -> None:
        with lock:
            if result != pulsar.Result.Ok:
                failures.append(str(result))
            left[0] -= 1
            if left[0] == 0:
                done.set()

    try:
        for e in entries:
            send_async(producer, encode_pulsar_value(e), sent, partition_key=e.key)
        producer.flush()
    except pulsar.PulsarException as err:
        raise PublishError(f"state write failed: {err}") from err
    done.wait()
    if failures:
        raise PublishError(f"{len(failures)} state write(s) failed: {failures[0]}")


def _settle(fut: asyncio.Future[list[StateEntry]], value: list[StateEntry]) -> None:
    if not fut.done():
        fut.set_result(value)


def _fail(fut: asyncio.Future[Any], err: EmbodiedBusError) -> None:
    if not fut.done():
        fut.set_exception(err)


def open_pulsar_state(bus: Bus, table: str, options: StateOptions) -> PulsarState:
    """The Pulsar backend of :func:`~embodied_bus.state.open_state`."""
    if not isinstance(bus.engine, PulsarEngine):
        raise BusConfigError(f"the Pulsar state backend needs a Pulsar bus, got {bus.engine.name!r}")
    return PulsarState(bus.engine, table, options)
