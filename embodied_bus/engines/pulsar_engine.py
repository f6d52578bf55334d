"""Apache Pulsar engine.

Topic layout: one persistent topic per stream,
``persistent://<tenant>/<pulsar_namespace>/eb.<namespace>.<stream with '/' as '.'>``.
The bucket id (decimal) is the message key and the bucket start (ms) the event time; the header
fields travel as message properties. Because every topic keys its messages by the same bucket
id, a fusion worker that subscribes to all modality topics with ``Key_Shared`` in ``STICKY`` mode
and the same hash ranges on each topic receives every modality of its buckets.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import re
import stat
import threading
import time
import uuid
from collections import deque
from functools import partial
from typing import Any

import pulsar

from embodied_bus.engines._blocking import call_bounded, resolve_none
from embodied_bus.engines.base import (
    AckFn,
    Engine,
    EnginePublisher,
    EngineSubscriber,
    GroupMembership,
    MembershipCallback,
    MessageSink,
    hand_over_batch,
)
from embodied_bus.engines.pulsar_native import (
    MessageBuilder,
    native_consumer,
    native_producer,
    subscribe_pattern,
)
from embodied_bus.engines.urls import PulsarSettings
from embodied_bus.errors import (
    BusClosedError,
    BusConnectionError,
    EmbodiedBusError,
    HeaderError,
    PayloadTooLargeError,
    PublishError,
)
from embodied_bus.model.qos import Backpressure, PublisherOptions, SubscriptionOptions
from embodied_bus.model.wire import (
    BATCH_LAYOUT,
    Header,
    HeaderRun,
    decode_batch_runs,
    decode_properties,
    encode_batch,
    encode_header,
    encode_header_text,
)

__all__ = [
    "BATCH_PROPERTY",
    "PULSAR_MAX_MESSAGE_BYTES",
    "PulsarEngine",
    "decode_batch_message",
    "stream_topic",
]

#: Pulsar's default ``maxMessageSize`` (5 MiB) less the client's metadata reserve (10 KiB).
PULSAR_MAX_MESSAGE_BYTES = 5 * 1024 * 1024 - 10 * 1024
#: Chunked messages that may be assembled at once per consumer (several producers interleave).
MAX_PENDING_CHUNKED = 64

_logger = logging.getLogger("embodied_bus.pulsar")
#: The C++ client logs natively (warnings and errors; see ``_native_logger``). A Python logger would be called
#: from the client's I/O threads, also while the interpreter shuts down, and a thread that needs
#: the GIL then is ended by Python mid-C++ frame: the process aborts (std::terminate).
_client_log_level = pulsar.LoggerLevel.Warn


def _native_logger() -> Any:
    """The client's own (C++) logger, on stderr where that can be opened as a stream.

    pulsar-client's ``ConsoleLogger`` writes to *stdout*, where it would mix with the JSON the CLI
    and the benchmarks print; its ``FileLogger`` opens a path (for appending), and
    ``/dev/stderr`` can be opened anew for a pipe, a terminal or a regular file. A regular file
    opened without ``O_APPEND`` (``2> file``) is switched to appending first, or Python's writes
    at its own offset would overwrite the client's lines. Only a socket (which cannot be opened)
    keeps the console logger. Not a Python logger: the client calls it, taking the GIL, on
    every log-level check of its I/O threads (halves small-message rates), and from those
    threads during interpreter exit (aborted processes now and then).
    """
    try:
        mode = os.fstat(2).st_mode
    except OSError:
        mode = 0
    if not os.path.exists("/dev/stderr"):
        return pulsar.ConsoleLogger(_client_log_level)
    if stat.S_ISREG(mode):
        try:
            fcntl.fcntl(2, fcntl.F_SETFL, fcntl.fcntl(2, fcntl.F_GETFL) | os.O_APPEND)
        except OSError:
            return pulsar.ConsoleLogger(_client_log_level)
    elif not (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)):
        return pulsar.ConsoleLogger(_client_log_level)
    return pulsar.FileLogger(_client_log_level, "/dev/stderr")


def stream_topic(settings: PulsarSettings, stream: str) -> str:
    """Pulsar topic of a stream."""
    name = stream.replace("/", ".")
    return f"persistent://{settings.tenant}/{settings.pulsar_namespace}/eb.{settings.namespace}.{name}"


def _pattern(settings: PulsarSettings) -> re.Pattern[str]:
    """Every stream topic of the bus namespace: not the action queue's topics (its state log,
    dead letters and priority levels share the prefix; stream names that would map onto them
    are reserved). Without the ``persistent://`` domain, which the client only warns about:
    a pattern subscription reads persistent topics by default."""
    prefix = f"{settings.tenant}/{settings.pulsar_namespace}/eb.{settings.namespace}."
    return re.compile(re.escape(prefix) + r"(?!actions\.(?:q[0-9]\.|state$|dlq$))[A-Za-z0-9_\-.]+")


#: A BLOCK publisher's ``publish`` starts to await once this many samples await the broker's
#: confirmation (the client's own send queue holds 1,000: the event loop never blocks in a full
#: one) ...
PULSAR_HIGH_WATER = 800
#: ... and resumes once no more than this many do.
PULSAR_LOW_WATER = 400
#: Unconfirmed payload bytes count as messages of this many bytes each (64 MiB / 800): a BLOCK
#: publisher of large samples awaits above ~64 MiB unconfirmed, not 800 messages (6 GiB of
#: 8 MiB clouds), and every send this large carries its own completion callback.
PULSAR_SLOT_BYTES = 64 * 1024 * 1024 // PULSAR_HIGH_WATER
#: Longest wait of a subscriber's receive, milliseconds: acknowledgements queued by the
#: application are sent at least this often.
ACK_FLUSH_MS = 100
#: Every this many sends of a publisher, one carries a completion callback (see
#: ``_PulsarPublisher``).
CONFIRM_EVERY = 16
#: A BLOCK publisher on the event loop batches samples while at least this many of its sends
#: await the broker's confirmation (the broker is behind): the samples published meanwhile go
#: out as one message (see ``_PulsarPublisher``). Below it, every sample is sent at once.
BATCH_WHEN_UNCONFIRMED = 64
#: A batch holds samples up to this size (header and payload), bytes ...
PULSAR_BATCH_ITEM_MAX_BYTES = 16 * 1024
#: ... and at most this many bytes, and samples of one bucket only (the message key).
PULSAR_BATCH_MAX_BYTES = 64 * 1024
#: Pause before asking a reader again while it reconnects after a seek, seconds.
SEEK_RETRY_S = 0.05
#: Property that marks a batch message: ``"<layout>|<length of the batch head>"``; the message
#: data is the head (the Zenoh batch attachment, see ``wire.encode_batch``) then the payloads.
BATCH_PROPERTY = "eb.b"


class _PulsarPublisher(EnginePublisher):
    """One producer. Every :data:`CONFIRM_EVERY`-th send carries a completion callback: the
    client completes one producer's sends in order, so that callback confirms the ones before
    it too (a Python callback on every send, taking the GIL from the client's I/O thread, cost
    about 40 % of the throughput of 1 KiB samples).

    A BLOCK publisher whose sends the broker has not confirmed yet (at least
    :data:`BATCH_WHEN_UNCONFIRMED` of them) batches small samples of one bucket published on
    the event loop: they go out as one message when the batch is full, the bucket changes, a
    large sample follows, or the loop turn ends (``call_soon``), so a batch adds no wait of its
    own. A message, not a sample, is what the broker stores, dispatches and acknowledges, and
    each costs ~60 µs of client and broker CPU; a stream of 1 KiB samples that outruns the
    broker went at ~0.6 times the rate of bare pulsar-client sends before batching.
    """

    def __init__(self, producer: Any, stream: str, options: PublisherOptions) -> None:
        self._producer = producer
        native = native_producer(producer)
        self._native_send: Any = native.send_async if native is not producer else None
        self._stream = stream
        self._chunking = options.chunking
        self.max_payload_bytes = None if options.chunking else PULSAR_MAX_MESSAGE_BYTES
        self._block = options.backpressure is Backpressure.BLOCK
        self.high_water = PULSAR_HIGH_WATER
        self._lock = threading.Lock()
        self._sent = 0  # sends the client accepted (written by the sending thread only)
        self._confirmed = 0  # of those, how many the broker confirmed (or failed)
        self._sent_bytes = 0  # their payload bytes, cumulative (as ``_sent``)
        self._confirmed_bytes = 0
        self._errors: list[str] = []
        self._closed = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        # the batch being filled (BLOCK publishers, event loop thread only)
        self._loop = asyncio.get_running_loop() if self._block else None
        self._loop_thread = threading.get_ident()  # created on the loop: batches only there
        self._batch: list[tuple[bytes, bytes | bytearray]] = []
        self._batch_header: Header | None = None  # its first sample's header
        self._batch_bytes = 0
        self._batch_scheduled = False
        #: Batch messages sent (several samples in one message).
        self.batches = 0

    def _on_confirmed(self, upto: int, upto_bytes: int, result: Any, _msg_id: Any) -> None:
        with self._lock:
            self._confirmed = max(self._confirmed, upto)
            self._confirmed_bytes = max(self._confirmed_bytes, upto_bytes)
            if result != pulsar.Result.Ok:
                self._errors.append(str(result))
            self._wake()

    def _wake(self) -> None:  # under the lock
        if self._waiters and self._unconfirmed() <= PULSAR_LOW_WATER:
            waiters, self._waiters = self._waiters, []
            for loop, fut in waiters:
                try:
                    loop.call_soon_threadsafe(resolve_none, fut)
                except RuntimeError:  # that loop is closed
                    pass

    def backlog(self) -> int:
        # BLOCK: messages (a batch is one) the broker has not confirmed yet. ``publish`` awaits
        # above its high water mark, so the event loop never blocks in the client's full queue.
        return self._unconfirmed() if self._block else 0

    def _unconfirmed(self) -> int:
        """Unconfirmed sends, or slots of :data:`PULSAR_SLOT_BYTES` if their bytes are more."""
        return max(
            self._sent - self._confirmed, (self._sent_bytes - self._confirmed_bytes) // PULSAR_SLOT_BYTES
        )

    async def wait_writable(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._unconfirmed() <= PULSAR_LOW_WATER or self._closed:
                return
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.append((loop, fut))
        await fut

    def _raise_errors(self) -> None:
        if not self._errors:
            return
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise PublishError(
                f"Pulsar failed to persist sample(s) of {self._stream!r}: {errors[0]}"
                + (f" (and {len(errors) - 1} more failures)" if len(errors) > 1 else "")
            )

    def send(self, header: Header, payload: bytes | bytearray) -> bool:
        if self._closed:
            raise BusClosedError(f"publisher for {self._stream!r} is closed")
        self._raise_errors()
        on_loop = threading.get_ident() == self._loop_thread
        if self._block and on_loop and self._sent - self._confirmed >= BATCH_WHEN_UNCONFIRMED:
            enc = encode_header(header)
            size = len(enc) + len(payload)
            if size <= PULSAR_BATCH_ITEM_MAX_BYTES:
                first = self._batch_header
                if first is not None and (
                    first.bucket != header.bucket or self._batch_bytes + size > PULSAR_BATCH_MAX_BYTES
                ):
                    self._send_batch()
                if self._batch_header is None:
                    self._batch_header = header
                    if not self._batch_scheduled:
                        self._batch_scheduled = True
                        assert self._loop is not None
                        self._loop.call_soon(self._send_scheduled)
                self._batch.append((enc, payload if type(payload) is bytes else bytes(payload)))
                self._batch_bytes += size
                return True
        if self._batch and on_loop:
            self._send_batch()
        return self._send_one(header, payload)

    def send_from_thread(self, header: Header, payload: bytes | bytearray) -> bool:
        # a worker thread's samples are never batched (the batch belongs to the loop thread)
        if self._closed:
            raise BusClosedError(f"publisher for {self._stream!r} is closed")
        self._raise_errors()
        return self._send_one(header, payload)

    def _send_scheduled(self) -> None:
        self._batch_scheduled = False
        if self._batch:
            try:
                self._send_batch()
            except EmbodiedBusError as err:  # reported on the next send or flush
                self._errors.append(str(err))

    def _send_batch(self) -> None:
        """Send the batch being filled: one message (a lone sample in the one-sample layout)."""
        batch, first = self._batch, self._batch_header
        self._batch = []
        self._batch_header = None
        self._batch_bytes = 0
        assert first is not None
        if len(batch) == 1:
            self._send_one(first, batch[0][1])
            return
        head, body = encode_batch(batch)
        prop = (BATCH_PROPERTY, f"{BATCH_LAYOUT}|{len(head)}")
        if self._send_message(head + body, prop, first, f"a batch of {len(batch)} samples"):
            self.batches += 1

    def _send_one(self, header: Header, payload: bytes | bytearray) -> bool:
        data = payload if type(payload) is bytes else bytes(payload)
        prop = ("eb.h", encode_header_text(header))
        return self._send_message(data, prop, header, f"payload of {len(payload)} bytes")

    def _send_message(self, data: bytes, prop: tuple[str, str], header: Header, what: str) -> bool:
        """One message with one property: ``header``'s sample, or a batch whose first sample
        is ``header`` (the key and event time are its bucket's)."""
        start_ms = header.bucket_start_ns // 1_000_000
        n = self._sent + 1
        total = self._sent_bytes + len(data)
        done = (
            partial(self._on_confirmed, n, total)
            if n % CONFIRM_EVERY == 0 or len(data) >= PULSAR_SLOT_BYTES
            else None
        )
        try:
            native_send = self._native_send
            if native_send is not None:
                mb = MessageBuilder().content(data).property(*prop)
                mb.partition_key(str(header.bucket))
                if start_ms > 0:
                    mb.event_timestamp(start_ms)
                native_send(mb.build(), done)
            else:
                self._producer.send_async(
                    data,
                    done,
                    properties=dict([prop]),
                    partition_key=str(header.bucket),
                    event_timestamp=start_ms if start_ms > 0 else None,
                )
        except pulsar.ProducerQueueIsFull:
            return False
        except pulsar.MessageTooBig as err:
            raise PayloadTooLargeError(
                f"{what} on stream {self._stream!r} exceeds Pulsar's "
                f"message size limit and chunking is disabled (PublisherOptions(chunking=True))"
            ) from err
        except pulsar.PulsarException as err:
            raise PublishError(f"Pulsar send on {self._stream!r} failed: {err}") from err
        self._sent = n
        self._sent_bytes = total
        return True

    def _wait_idle(self) -> None:
        upto, upto_bytes = self._sent, self._sent_bytes
        self._producer.flush()  # returns once every send before it is persisted (or failed)
        with self._lock:
            self._confirmed = max(self._confirmed, upto)
            self._confirmed_bytes = max(self._confirmed_bytes, upto_bytes)
            self._wake()

    async def flush(self) -> None:
        if self._batch:
            self._send_batch()
        try:
            await asyncio.to_thread(self._wait_idle)
        except pulsar.PulsarException as err:
            raise PublishError(f"Pulsar flush on {self._stream!r} failed: {err}") from err
        self._raise_errors()

    async def close(self) -> None:
        if self._closed:
            return
        try:
            await self.flush()
        finally:
            self._closed = True
            await close_handle(self._producer)


def decode_batch_message(prop: str, data: bytes) -> tuple[list[tuple[Header, bytes]], list[HeaderError]]:
    """The samples of a batch message (property :data:`BATCH_PROPERTY` = ``prop``).

    Returns:
        The well-formed samples in order, and an error for each malformed one.

    Raises:
        HeaderError: The message is not a readable batch (the message says why).
    """
    decoded, errors = _decode_batch_message_runs(prop, data)
    return (decoded.pairs() if isinstance(decoded, HeaderRun) else decoded), errors


def _decode_batch_message_runs(
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


class _PulsarSubscriber(EngineSubscriber):
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
            loop.call_soon_threadsafe(_resolve, fut)

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
        hand_over_batch(self._sink, msg.topic_name(), lambda: _decode_batch_message_runs(prop, data), ack)

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


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


#: Longest wait for a client, producer, consumer or reader to close, seconds (one that cannot
#: reconnect after a broker crash can block its close; it is then left behind on a daemon thread).
CLOSE_TIMEOUT_S = 5.0


async def close_handle(handle: Any, engine: PulsarEngine | None = None) -> None:
    """Close a Pulsar client, producer, consumer or reader, bounded by :data:`CLOSE_TIMEOUT_S`.

    Errors (already closed, broker gone) and a close that does not finish are logged at debug level
    and otherwise ignored: the caller is shutting down. With the ``engine`` the handle belongs
    to, nothing is done once that engine is closed: closing its client closed the handle, and
    closing it again only makes the C++ client log an error (e.g. an executor that stops after
    its bus was closed under it).
    """
    if engine is not None and engine.closed:
        return
    try:
        await call_bounded(handle.close, CLOSE_TIMEOUT_S, name="eb-pulsar-close")
    except (pulsar.PulsarException, TimeoutError, ValueError) as err:  # ValueError: closed before
        _logger.debug("close did not finish: %s", err or type(err).__name__)


#: Heartbeat period of group members, seconds.
GROUP_HEARTBEAT_S = 0.25
#: A member unheard of for this long has left, seconds.
GROUP_EXPIRY_S = 3.0


class _PulsarGroup(GroupMembership):
    """Group membership over a non-persistent heartbeat topic (Pulsar has no liveliness).

    A member that announced itself also hears its own heartbeats: while they do not come back
    (the broker restarts, the network drops) this view is not healthy, and no other member is
    taken to have left; when they come back, every member gets a fresh
    :data:`GROUP_EXPIRY_S` to be heard again.
    """

    def __init__(
        self, engine: PulsarEngine, group: str, on_change: MembershipCallback, consumer: Any
    ) -> None:
        self._engine = engine
        self._topic = _group_topic(engine.settings, group)
        self._on_change = on_change
        self._consumer = consumer
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._producer: Any = None
        self._me: tuple[str, str] | None = None
        self._self_seen = float("-inf")  # when our own heartbeat last came back
        self._healthy_since: float | None = time.monotonic()  # watchers that never announce
        self._threads = [threading.Thread(target=self._listen, name=f"eb-group-{group}", daemon=True)]
        self._threads[0].start()

    def _listen(self) -> None:
        next_check = time.monotonic() + GROUP_HEARTBEAT_S
        while not self._stop.is_set():
            try:
                msg = self._consumer.receive(timeout_millis=int(GROUP_HEARTBEAT_S * 1000))
                props = msg.properties()
                member, value, state = props.get("member"), props.get("value"), props.get("state")
                if member and value is not None:
                    self._saw(member, value, state != "left")
            except pulsar.Timeout:
                pass
            except pulsar.AlreadyClosed:
                return  # the consumer or the whole client was closed: nothing more will come
            except pulsar.PulsarException as err:
                if self._stop.is_set():
                    return
                _logger.warning("group heartbeat receive failed: %s", err)
                self._stop.wait(0.2)
            now = time.monotonic()
            if now >= next_check:
                next_check = now + GROUP_HEARTBEAT_S
                self._expire(now)

    def _expire(self, now: float) -> None:
        with self._lock:
            if self._me is not None and now - self._self_seen > GROUP_EXPIRY_S / 2:
                self._healthy_since = None  # our own heartbeats stopped coming back
            if self._healthy_since is None:
                return
            expired = [(m, v) for m, (v, t) in self._seen.items() if now - t > GROUP_EXPIRY_S]
            for m, _ in expired:
                del self._seen[m]
        for m, v in expired:
            self._on_change(m, v, False)

    def _saw(self, member: str, value: str, alive: bool) -> None:
        now = time.monotonic()
        with self._lock:
            if self._me == (member, value) and alive:
                self._self_seen = now
                if self._healthy_since is None:  # back: everyone gets a fresh expiry
                    self._healthy_since = now
                    self._seen = {m: (v, now) for m, (v, _) in self._seen.items()}
            known = self._seen.get(member)
            if alive:
                self._seen[member] = (value, now)
            elif known is not None:
                del self._seen[member]
        if alive and (known is None or known[0] != value):
            self._on_change(member, value, True)
        elif not alive and known is not None:
            self._on_change(member, known[0], False)

    def healthy(self) -> bool:
        with self._lock:
            if self._me is None:
                return True
            return time.monotonic() - self._self_seen <= GROUP_EXPIRY_S / 2

    def settled(self) -> bool:
        now = time.monotonic()
        with self._lock:
            since = self._healthy_since
            if since is None or now - since < GROUP_EXPIRY_S + GROUP_HEARTBEAT_S:
                return False  # not up to date long enough to tell
            return self._me is None or now - self._self_seen <= GROUP_EXPIRY_S / 2

    def _beat(self) -> None:
        assert self._me is not None
        member, value = self._me
        # a closed client takes sends without complaint (and without sending): stop beating
        while not self._stop.wait(GROUP_HEARTBEAT_S) and not self._engine.closed:
            try:
                self._producer.send_async(
                    b"", None, properties={"member": member, "value": value, "state": "alive"}
                )
            except pulsar.AlreadyClosed:
                return  # the client was closed: this member is gone
            except pulsar.PulsarException as err:
                _logger.warning("group heartbeat send failed: %s", err)

    def members(self) -> dict[str, str]:
        with self._lock:
            return {m: v for m, (v, _) in self._seen.items()}

    async def announce(self, member: str, value: str) -> None:
        self._producer = await asyncio.to_thread(self._engine.client.create_producer, self._topic)
        with self._lock:
            self._me = (member, value)
            self._self_seen = time.monotonic()  # counted healthy until its beats are due back
        await asyncio.to_thread(
            self._producer.send, b"", properties={"member": member, "value": value, "state": "alive"}
        )
        t = threading.Thread(target=self._beat, name=f"eb-heartbeat-{member}", daemon=True)
        self._threads.append(t)
        t.start()

    async def leave(self) -> None:
        self._stop.set()
        if self._producer is not None and self._me is not None:
            # Asynchronous send with a bounded wait: a blocking send on a client that is being
            # closed can hang forever (the others then see this member expire instead).
            sent = threading.Event()
            try:
                self._producer.send_async(
                    b"",
                    lambda *_: sent.set(),
                    properties={"member": self._me[0], "value": self._me[1], "state": "left"},
                )
            except pulsar.PulsarException:
                pass  # the client is closed already, and with it this producer
            else:
                await asyncio.to_thread(sent.wait, 2.0)
                await close_handle(self._producer, self._engine)
        for t in self._threads:
            await asyncio.to_thread(t.join, 2.0)
        await close_handle(self._consumer, self._engine)


def _group_topic(settings: PulsarSettings, group: str) -> str:
    return (
        f"non-persistent://{settings.tenant}/{settings.pulsar_namespace}/"
        f"eb.{settings.namespace}.group.{group.replace('/', '.')}"
    )


class PulsarEngine(Engine):
    """A pulsar-client ``Client`` used as a bus engine."""

    name = "pulsar"

    def __init__(self, settings: PulsarSettings, client: Any) -> None:
        self.settings = settings
        self.client = client
        self._closed = False

    @classmethod
    async def open(cls, settings: PulsarSettings) -> PulsarEngine:
        """Create the client and check that the broker answers.

        Raises:
            BusConnectionError: The broker did not answer within ``connect_timeout_s``.
        """
        kwargs: dict[str, Any] = {
            "operation_timeout_seconds": max(1, round(settings.connect_timeout_s)),
            "connection_timeout_ms": int(settings.connect_timeout_s * 1000),
            "logger": _native_logger(),
        }
        if settings.service_url.startswith("pulsar+ssl"):
            kwargs["use_tls"] = True
            kwargs["tls_trust_certs_file_path"] = settings.tls_trust_certs_file
            kwargs["tls_allow_insecure_connection"] = settings.tls_allow_insecure
        if settings.token:
            kwargs["authentication"] = pulsar.AuthenticationToken(settings.token)
        client = pulsar.Client(settings.service_url, **kwargs)
        probe = stream_topic(settings, "_probe")
        try:
            await call_bounded(
                lambda: client.get_topic_partitions(probe),
                settings.connect_timeout_s + 2.0,
                name="eb-pulsar-probe",
            )
        except pulsar.AuthenticationError as err:
            await close_handle(client)
            raise BusConnectionError(
                f"Pulsar broker at {settings.service_url} refused our credentials "
                f"({'token' if settings.token else 'no token given'}): {err}"
            ) from err
        except (pulsar.PulsarException, TimeoutError) as err:
            await close_handle(client)
            raise BusConnectionError(
                f"cannot reach Pulsar broker at {settings.service_url} within "
                f"{settings.connect_timeout_s:g} s: {err or type(err).__name__}"
            ) from err
        return cls(settings, client)

    def _check(self) -> None:
        if self._closed:
            raise BusClosedError("the Pulsar bus is closed")

    async def create_publisher(self, stream: str, options: PublisherOptions) -> EnginePublisher:
        self._check()
        block = options.backpressure is Backpressure.BLOCK
        send_timeout_s = options.send_timeout_s
        if send_timeout_s is None:
            send_timeout_s = 0.0 if block else 30.0
        try:
            producer = await asyncio.to_thread(
                self.client.create_producer,
                stream_topic(self.settings, stream),
                chunking_enabled=options.chunking,
                batching_enabled=False,
                block_if_queue_full=block,
                send_timeout_millis=int(send_timeout_s * 1000),
            )
        except pulsar.PulsarException as err:
            raise BusConnectionError(f"cannot create Pulsar producer for {stream!r}: {err}") from err
        return _PulsarPublisher(producer, stream, options)

    async def create_subscriber(
        self, stream: str | tuple[str, ...] | None, sink: MessageSink, options: SubscriptionOptions
    ) -> EngineSubscriber:
        self._check()
        ephemeral = options.subscription_name is None
        name = options.subscription_name or f"eb-{uuid.uuid4().hex[:12]}"
        topic: Any
        if stream is None:
            topic = _pattern(self.settings)
        elif isinstance(stream, tuple):
            topic = [stream_topic(self.settings, s) for s in stream]
        else:
            topic = stream_topic(self.settings, stream)
        kwargs: dict[str, Any] = {
            "consumer_type": pulsar.ConsumerType.Exclusive,
            "initial_position": pulsar.InitialPosition.Latest,
            "receiver_queue_size": max(1, min(1000, options.capacity)),
            "max_pending_chunked_message": MAX_PENDING_CHUNKED,
            "auto_ack_oldest_chunked_message_on_queue_full": False,
        }
        if options.key_shared_ranges is not None:
            kwargs["consumer_type"] = pulsar.ConsumerType.KeyShared
            kwargs["key_shared_policy"] = pulsar.ConsumerKeySharedPolicy(
                key_shared_mode=pulsar.KeySharedMode.Sticky,
                sticky_ranges=list(options.key_shared_ranges),
            )
        what = "all streams" if stream is None else ", ".join(stream) if isinstance(stream, tuple) else stream
        subscribe = partial(subscribe_pattern, self.client) if stream is None else self.client.subscribe
        try:
            consumer = await asyncio.to_thread(subscribe, topic, name, **kwargs)
        except pulsar.PulsarException as err:
            raise BusConnectionError(f"cannot subscribe to {what!r} on Pulsar: {err}") from err
        return _PulsarSubscriber(consumer, sink, name, ephemeral, single_topic=isinstance(stream, str))

    async def stored_headers(self, stream: str, *, since_ns: int, timeout_s: float) -> list[Header]:
        """See :meth:`Engine.stored_headers`: a Reader seeks to ``since_ns`` (ms resolution)
        and reads to the topic's last message; malformed headers are skipped."""
        self._check()
        topic = stream_topic(self.settings, stream)

        deadline = time.monotonic() + timeout_s

        def available(reader: Any) -> bool:
            # a seek makes the broker drop the reader's consumer and the client reconnect it:
            # asked meanwhile, the broker answers "Consumer not found" (BrokerMetadataError)
            while True:
                try:
                    return bool(reader.has_message_available())
                except pulsar.BrokerMetadataError:
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(SEEK_RETRY_S)

        def _scan() -> list[Header]:
            reader = self.client.create_reader(topic, pulsar.MessageId.latest)
            try:
                reader.seek(max(0, since_ns // 1_000_000))
                out: list[Header] = []
                while available(reader):
                    msg = reader.read_next(max(1, int(timeout_s * 1000)))
                    props = msg.properties()
                    try:
                        batch = props.get(BATCH_PROPERTY)
                        if batch is None:
                            out.append(decode_properties(props))
                        else:
                            out.extend(h for h, _ in decode_batch_message(batch, msg.data())[0])
                    except HeaderError:
                        continue
                return out
            finally:
                reader.close()

        try:
            return await call_bounded(_scan, timeout_s, name="eb-pulsar-scan")
        except pulsar.PulsarException as err:
            raise BusConnectionError(f"cannot read what Pulsar stored for {stream!r}: {err}") from err

    async def watch_group(self, group: str, on_change: MembershipCallback) -> GroupMembership:
        self._check()
        topic = _group_topic(self.settings, group)
        try:
            consumer = await asyncio.to_thread(
                self.client.subscribe,
                topic,
                f"eb-watch-{uuid.uuid4().hex[:12]}",
                consumer_type=pulsar.ConsumerType.Exclusive,
            )
        except pulsar.PulsarException as err:
            raise BusConnectionError(f"cannot watch group {group!r} on Pulsar: {err}") from err
        return _PulsarGroup(self, group, on_change, consumer)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (the client, and every handle of it, is closed)."""
        return self._closed

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await close_handle(self.client)
