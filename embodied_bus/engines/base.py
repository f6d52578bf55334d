"""The one small interface every engine implements.

An engine moves a header and a payload between named streams. It knows nothing about
sequence tracking or buffering: it decodes the header with the codec of its wire form and
hands the result to a :class:`MessageSink`, from its own threads.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Callable, Sequence
from typing import Protocol

from embodied_bus.errors import HeaderError
from embodied_bus.model.batches import HeaderRun
from embodied_bus.model.header import Header
from embodied_bus.model.qos import PublisherOptions, SubscriptionOptions

__all__ = [
    "AckFn",
    "Engine",
    "EngineBuffer",
    "EnginePublisher",
    "EngineSubscriber",
    "FastSend",
    "FastSendMany",
    "GroupMembership",
    "MembershipCallback",
    "MessageSink",
    "SharedAck",
    "hand_over_batch",
]

#: Acknowledges one delivered message to the engine (no-op where the engine has no acks).
AckFn = Callable[[], None]
#: Sends one sample given the header fields that vary: ``(seq, stamp_ns, bucket, publish_ns,
#: payload)``; returns the publisher's backlog after it (as :meth:`EnginePublisher.backlog`),
#: or -1 if the sample was dropped (see :meth:`EnginePublisher.fast_sender`).
FastSend = Callable[[int, int, int, int, bytes], int]
#: Sends a run of samples given what varies: ``(seqs, stamps_ns, buckets, publish_ns,
#: payloads)`` (one publish time for the run); returns how many were not dropped (see
#: :meth:`EnginePublisher.fast_sender_many`).
FastSendMany = Callable[[range, Sequence[int], Sequence[int], int, Sequence[bytes]], int]


class EngineBuffer(Protocol):
    """A received payload still owned by the engine (e.g. a Zenoh ``ZBytes``)."""

    def __len__(self) -> int: ...

    def to_bytes(self) -> bytes:
        """Copy the payload out."""
        ...


class MessageSink(Protocol):
    """Receives what an engine delivers; called from engine threads."""

    def deliver(self, header: Header, payload: bytes | EngineBuffer, ack: AckFn | None) -> None:
        """A well-formed message. An :class:`EngineBuffer` payload is copied by the sink when
        the application takes the sample, in the application's thread."""

    def deliver_batch(self, items: list[tuple[Header, bytes]], ack: AckFn | None = None) -> None:
        """Well-formed samples that came together (a batch), in order. ``ack`` (Pulsar) is
        called once per sample, as ``deliver``'s is for its message; it acknowledges the
        batch message after the last."""

    def deliver_run(self, run: HeaderRun, ack: AckFn | None = None) -> None:
        """:meth:`deliver_batch` of a batch of one publisher's same-shape headers, as columns
        (``run.pairs()`` are its items)."""

    def reject(self, error: Exception, ack: AckFn | None) -> None:
        """A message whose header could not be decoded; ``error`` says why."""


class SharedAck:
    """Acknowledges a batch message once each of its ``count`` samples has been acknowledged
    (taken, dropped or skipped as a duplicate), from whichever thread does the last one."""

    __slots__ = ("_ack", "_count", "_seen")

    def __init__(self, count: int, ack: AckFn) -> None:
        self._ack = ack
        self._count = count
        self._seen = itertools.count(1)  # next() is atomic: no lock needed

    def __call__(self) -> None:
        if next(self._seen) == self._count:
            self._ack()


def hand_over_batch(
    sink: MessageSink,
    where: str,
    decode: Callable[[], tuple[HeaderRun | list[tuple[Header, bytes]], list[HeaderError]]],
    ack: AckFn | None,
) -> None:
    """Decode a batch with ``decode`` and hand its samples to ``sink``.

    A batch that cannot be read counts as one malformed message (``ack`` acknowledges it); a
    malformed header inside costs only its own sample; the good samples share ``ack``
    (:class:`SharedAck`), so the message is acknowledged after the last of them.

    Args:
        sink: Where the samples go.
        where: Names the source in error messages (key expression, topic).
        decode: Returns the well-formed samples (pairs, or a :class:`HeaderRun`) and an
            error per malformed one, or raises :class:`HeaderError`.
        ack: Acknowledges the whole message (None where the engine has no acks).
    """
    try:
        entries, errors = decode()
    except HeaderError as err:
        sink.reject(HeaderError(f"batch on {where}: {err}"), ack)
        return
    for bad in errors:
        sink.reject(HeaderError(f"sample in a batch on {where}: {bad}"), None)
    if isinstance(entries, HeaderRun):
        sink.deliver_run(entries, None if ack is None else SharedAck(len(entries.payloads), ack))
    elif not entries:
        if ack is not None:
            ack()
    elif ack is None:
        sink.deliver_batch(entries)
    else:
        sink.deliver_batch(entries, SharedAck(len(entries), ack))


class EnginePublisher(abc.ABC):
    """Publishes to one stream."""

    #: Largest payload this publisher can carry, in bytes (None: no engine limit).
    max_payload_bytes: int | None = None
    #: ``Publisher.publish`` awaits :meth:`wait_writable` once :meth:`backlog` exceeds this.
    high_water: int = 256

    @abc.abstractmethod
    def send(self, header: Header, payload: bytes | bytearray) -> bool:
        """Hand one sample to the engine without waiting for delivery.

        Returns:
            False if the engine dropped it under the DROP_OLDEST policy (queue full).

        Raises:
            PublishError: The engine refused it.
            PayloadTooLargeError: Over the engine limit.
        """

    def fast_sender(self, template: Header) -> FastSend | None:
        """A sender specialised for samples whose header equals ``template`` except in seq,
        stamp_ns, bucket and publish_ns (the common case: a publisher's own encoding and
        frame_id, no flags), or None if the engine has none (then :meth:`send` is used).

        The returned callable takes ``(seq, stamp_ns, bucket, publish_ns, payload)`` and
        behaves as :meth:`send` would with the full header; it must send what :meth:`send`
        would (same wire bytes). It returns :meth:`backlog` after the send (one call less per
        sample for a publisher that checks it), or -1 where :meth:`send` returns False.
        """
        del template
        return None

    def fast_sender_many(self, template: Header) -> FastSendMany | None:
        """Like :meth:`fast_sender`, for a run of samples handed over together (one call into
        the engine per run), or None if the engine has none (then samples go one by one).

        The returned callable takes ``(seqs, stamps_ns, buckets, publish_ns, payloads)`` and
        sends what :meth:`send` would for each sample, in order (same wire bytes).
        """
        del template
        return None

    def backlog(self) -> int:
        """Samples accepted by :meth:`send` but not yet handed to the engine's transport."""
        return 0

    async def wait_writable(self) -> None:
        """Wait until the backlog is low enough to accept more (a no-op for most engines)."""
        return None

    def has_subscribers(self) -> bool:
        """Whether a subscriber that would receive the next sample is known to exist.

        Engines with durable subscriptions (Pulsar) always return True: once ``subscribe``
        returned, the broker keeps samples for that subscription.
        """
        return True

    def send_from_thread(self, header: Header, payload: bytes | bytearray) -> bool:
        """Like :meth:`send`, called from a worker thread (never the event loop): under BLOCK
        it may wait in the calling thread instead of handing the sample to a sender thread."""
        return self.send(header, payload)

    @abc.abstractmethod
    async def flush(self) -> None:
        """Wait until every sample sent so far is accepted by the engine (Pulsar: persisted)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Flush and release the publisher."""


class EngineSubscriber(abc.ABC):
    """Delivers messages of one stream (or all streams) to a sink until closed."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop delivering and release engine resources."""

    async def catch_up(self, timeout_s: float) -> bool:
        """Wait until every message the engine had stored for this subscription when called
        (its topic's last message then) has been handed to the sink.

        Engines that store nothing (Zenoh: a sample not yet received was never stored) return
        True at once.

        Args:
            timeout_s: Longest wait, seconds.

        Returns:
            True once caught up; False if that could not be established within ``timeout_s``.
        """
        del timeout_s
        return True

    def connected(self) -> bool:
        """Whether the engine holds a live connection for this subscription now. False while a
        broker-based engine reconnects (the topic's broker died and it moves to another): what
        was stored meanwhile comes later, nothing is lost. Always True for Zenoh."""
        return True


class GroupMembership(abc.ABC):
    """A live view of a named group's members, and this process's own membership in it."""

    @abc.abstractmethod
    def members(self) -> dict[str, str]:
        """Live members: member id -> the value it announced."""

    @abc.abstractmethod
    async def announce(self, member: str, value: str) -> None:
        """Join the group as ``member`` with ``value`` (others see it while this session lives)."""

    @abc.abstractmethod
    async def leave(self) -> None:
        """Withdraw this member (others see it leave) and stop watching."""

    async def refresh(self) -> None:
        """Ask for the members alive now and add any this view missed (a join announced while
        the network was still forming); a no-op where the view cannot miss one."""
        return

    def healthy(self) -> bool:
        """Whether this view is up to date now (on engines whose membership is a heartbeat,
        this member's own heartbeats come back)."""
        return True

    def settled(self) -> bool:
        """Whether this view has been up to date for longer than a member's silence takes to
        count as leaving: a member missing from it now is surely gone (not merely unheard)."""
        return True


#: Called from engine threads with (member id, value, joined) on each membership change.
MembershipCallback = Callable[[str, str, bool], None]


class Engine(abc.ABC):
    """A connected engine session: streams. What an engine offers beyond streams it declares
    by inheriting the capabilities of :mod:`embodied_bus.engines.capabilities`."""

    #: Short engine name (``zenoh`` / ``pulsar``).
    name: str = ""

    @abc.abstractmethod
    async def create_publisher(self, stream: str, options: PublisherOptions) -> EnginePublisher:
        """Declare a publisher on a stream."""

    @abc.abstractmethod
    async def create_subscriber(
        self, stream: str | tuple[str, ...] | None, sink: MessageSink, options: SubscriptionOptions
    ) -> EngineSubscriber:
        """Subscribe to one stream, several (a tuple) or every stream of the namespace (None)."""

    async def stored_headers(self, stream: str, *, since_ns: int, timeout_s: float) -> list[Header]:
        """Headers of the samples the engine still stores for ``stream`` that were published
        since ``since_ns`` (wall clock), oldest first. Engines that store nothing (Zenoh)
        return an empty list.

        Args:
            stream: The stream.
            since_ns: Earliest publish time, ns since the epoch.
            timeout_s: Longest time to spend reading, seconds.

        Raises:
            TimeoutError: The stored samples could not be read within ``timeout_s``.
        """
        del stream, since_ns, timeout_s
        return []

    @abc.abstractmethod
    async def close(self) -> None:
        """Close the session; idempotent."""
