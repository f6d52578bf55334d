"""Pulsar consumers as bus subscriptions, and the decoding of batch messages."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from functools import partial
from typing import Any

import pulsar

from embodied_bus.engines.base import (
    AckFn,
    EngineSubscriber,
    MessageSink,
    hand_over_batch,
)
from embodied_bus.engines.blocking import call_bounded
from embodied_bus.engines.pulsar.handles import resolve_future
from embodied_bus.engines.pulsar.native import (
    native_consumer,
)
from embodied_bus.engines.pulsar.topics import BATCH_PROPERTY
from embodied_bus.engines.pulsar.tuning import ACK_FLUSH_MS, CLOSE_TIMEOUT_S
from embodied_bus.errors import (
    HeaderError,
)
from embodied_bus.model.batches import BATCH_LAYOUT, HeaderRun, decode_batch_runs
from embodied_bus.model.header import Header
from embodied_bus.model.properties import decode_properties

_logger = logging.getLogger("embodied_bus.pulsar")


def decode_batch_message(prop: str, data: bytes) -> tuple[list[tuple[Header, bytes]], list[HeaderError]]:
    """The samples of a batch message (property :data:`BATCH_PROPERTY` = ``prop``).

    Returns:
        The well-formed samples in order, and an error for each malformed one.

    Raises:
        HeaderError: The message is not a readable batch (the message says why).
    """
    decoded, errors = decode_batch_message_runs(prop, data)
    return (decoded.pairs() if isinstance(decoded, HeaderRun) else decoded), errors


def decode_batch_message_runs(
    prop: str, data: bytes
) -> tuple[HeaderRun | list[tuple[Header, bytes]], list[HeaderError]]:
    """:func:`decode_batch_message`, a run of same-shape headers as a :class:`HeaderRun`.

    Returns:
        The well-formed samples in order, and an error for each malformed one.

    Raises:
        HeaderError: The message is not a readable batch (the message says why).
    """
    layout, _, head_text = prop.partition("|")
    if layout != str(BATCH_LAYOUT):
        raise HeaderError(
            f"unknown batch layout {layout!r} in {BATCH_PROPERTY} (this build reads {BATCH_LAYOUT})"
        )
    try:
        head_len = int(head_text)
    except ValueError:
        raise HeaderError(f"{BATCH_PROPERTY} has no valid head length: {prop!r}") from None
    if not 0 < head_len <= len(data):
        raise HeaderError(f"batch head of {head_len} bytes in a message of {len(data)} bytes")
    return decode_batch_runs(data[:head_len], data[head_len:])


class PulsarSubscriber(EngineSubscriber):
    """A consumer drained by its own named thread (isolates BLOCK back-pressure per stream)."""

    def __init__(
        self, consumer: Any, sink: MessageSink, name: str, ephemeral: bool, *, single_topic: bool
    ) -> None:
        self._consumer = consumer
        self._single_topic = single_topic
        self._sink = sink
        self._ephemeral = ephemeral
        self._stop = threading.Event()
        # Acknowledgements are queued by whoever takes a sample (the event loop, usually) and
        # sent by this subscriber's thread between receives, so the loop never waits in the
        # client for them; the thread sends what is queued before the consumer closes.
        self._acks: deque[Any] = deque()
        # For catch_up: the topic's last message when this consumer started (None: unknown; a
        # consumer of several topics has no last message id, so it does not ask), the last
        # message handed to the sink, and waiters.
        self._baseline: Any = None
        self._last_msg: Any = None
        self._waiters: list[tuple[Any, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._lock = threading.Lock()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"eb-pulsar-{name}", daemon=True)
        self._thread.start()

    def _send_acks(self) -> None:
        acks = self._acks
        consumer = native_consumer(self._consumer)
        while acks:
            try:
                consumer.acknowledge(acks.popleft())
            except pulsar.PulsarException as err:
                _logger.warning("ack failed (message will be redelivered): %s", err)

    def _last_id(self) -> Any:
        """The topic's last stored message id, or None when the client cannot tell."""
        try:
            return self._consumer.get_last_message_id()
        except (pulsar.PulsarException, ValueError, RuntimeError) as err:
            _logger.debug("no last message id for %s: %s", self._consumer.topic(), err)
            return None

    def _passed(self, msg: Any) -> None:
        """Record that ``msg`` was handed to the sink; wake the catch-up waiters it covers (its
        id is only built then: that costs about a microsecond)."""
        with self._lock:
            self._last_msg = msg
            if not self._waiters:
                return
            msg_id = msg.message_id()
            done = [w for w in self._waiters if msg_id >= w[0]]
            self._waiters = [w for w in self._waiters if not msg_id >= w[0]]
        for _, loop, fut in done:
            loop.call_soon_threadsafe(resolve_future, fut)

    def _run(self) -> None:
        consumer = native_consumer(self._consumer)
        deliver = self._sink.deliver
        reject = self._sink.reject
        queue_ack = self._acks.append
        try:
            # what was stored before this consumer started is not delivered to it (it starts at
            # the latest message): catch_up never waits for that
            if self._single_topic:
                self._baseline = self._last_id()
            self._started.set()
            while not self._stop.is_set():
                if self._acks:
                    self._send_acks()
                try:
                    msg = consumer.receive(ACK_FLUSH_MS)
                except pulsar.Timeout:
                    continue
                except pulsar.AlreadyClosed:
                    return
                except pulsar.PulsarException as err:
                    _logger.warning("Pulsar receive failed, retrying: %s", err)
                    self._stop.wait(0.2)
                    continue
                ack: AckFn = partial(queue_ack, msg)
                props = msg.properties()
                batch = props.get(BATCH_PROPERTY)
                if batch is not None:
                    self._deliver_batch(msg, batch, ack)
                else:
                    try:
                        header = decode_properties(props)
                    except HeaderError as err:
                        reject(HeaderError(f"message on {msg.topic_name()}: {err}"), ack)
                    else:
                        deliver(header, msg.data(), ack)
                self._passed(msg)
        finally:
            self._started.set()
            self._send_acks()

    def _deliver_batch(self, msg: Any, prop: str, ack: AckFn) -> None:
        data = msg.data()
        hand_over_batch(self._sink, msg.topic_name(), lambda: decode_batch_message_runs(prop, data), ack)

    def connected(self) -> bool:
        try:
            return bool(self._consumer.is_connected())
        except (pulsar.PulsarException, AttributeError):
            return True  # closed, or a client that cannot tell

    async def catch_up(self, timeout_s: float) -> bool:
        """See :meth:`EngineSubscriber.catch_up`. One round trip to the broker for the topic's
        last message id (single-topic consumers only: others return False)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if not await asyncio.to_thread(self._started.wait, timeout_s) or self._baseline is None:
            return False
        try:
            target = await call_bounded(
                self._last_id, max(0.0, deadline - loop.time()), name="eb-pulsar-last-id"
            )
        except TimeoutError:
            return False
        if target is None:
            return False
        if target <= self._baseline:
            return True
        fut: asyncio.Future[None] = loop.create_future()
        with self._lock:
            last = self._last_msg
            if last is not None and last.message_id() >= target:
                return True
            self._waiters.append((target, loop, fut))
        try:
            await asyncio.wait_for(fut, max(0.0, deadline - loop.time()))
        except TimeoutError:
            with self._lock:
                self._waiters = [w for w in self._waiters if w[2] is not fut]
            return False
        return True

    async def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        await asyncio.to_thread(self._thread.join, 5.0)

        def _close() -> None:
            try:
                if self._ephemeral:
                    self._consumer.unsubscribe()
                else:
                    self._consumer.close()
            except pulsar.PulsarException:
                try:
                    self._consumer.close()
                except pulsar.PulsarException:
                    pass

        try:
            await call_bounded(_close, CLOSE_TIMEOUT_S, name="eb-pulsar-close")
        except TimeoutError:
            _logger.debug("closing a consumer did not finish within %g s", CLOSE_TIMEOUT_S)
