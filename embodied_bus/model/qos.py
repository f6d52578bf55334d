"""Delivery options of publishers and subscriptions (engine-neutral)."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from embodied_bus.errors import BusConfigError

__all__ = [
    "DEFAULT_CAPACITY",
    "DEFAULT_MAX_PAYLOAD_BYTES",
    "FAILOVER_GROUP_RE",
    "Backpressure",
    "PublisherOptions",
    "SubscriptionOptions",
]

#: Default subscription buffer capacity, in samples.
DEFAULT_CAPACITY = 64
#: Default largest payload a publisher accepts, in bytes (64 MiB).
DEFAULT_MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
#: What a failover group may be named (it becomes part of key expressions and topic names).
FAILOVER_GROUP_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


class Backpressure(str, enum.Enum):
    """What happens when a consumer is slower than its producer.

    * ``DROP_OLDEST`` (sensor default): a full subscription buffer discards its oldest sample
      and counts it, so the latest sample wins; publishers use Zenoh congestion control ``DROP``
      and Pulsar ``block_if_queue_full=False`` (a full producer queue counts a drop).
    * ``BLOCK`` (lossless): a full subscription buffer makes the delivering engine thread wait;
      publishers use Zenoh ``BLOCK`` and Pulsar ``block_if_queue_full=True``.
    """

    DROP_OLDEST = "drop_oldest"
    BLOCK = "block"

    @classmethod
    def parse(cls, value: str | Backpressure) -> Backpressure:
        """Parse a policy from its value (``drop_oldest`` / ``block``)."""
        try:
            return cls(value)
        except ValueError as err:
            raise BusConfigError(
                f"unknown backpressure policy {value!r}; expected 'drop_oldest' or 'block'"
            ) from err


@dataclass(frozen=True, slots=True)
class PublisherOptions:
    """How a publisher hands samples to the engine.

    Args:
        backpressure: ``DROP_OLDEST`` (never wait, count drops) or ``BLOCK`` (lossless).
        max_payload_bytes: Largest payload accepted; bigger ones raise PayloadTooLargeError.
        chunking: Pulsar only: split payloads over the broker's message size limit into chunks.
            When False, a payload over that limit raises PayloadTooLargeError.
        shm: Zenoh only: write payloads of at least ``shm_threshold_bytes`` into this
            publisher's shared-memory pool (one copy; processes on the same host read it from
            there, Zenoh copies it for other hosts). None means the engine default: on unless
            the session's shared memory is off (``zenoh:?shm=0``). A payload that finds the
            pool full goes the ordinary way; the publisher never waits for the pool.
        shm_threshold_bytes: Smallest payload sent through shared memory (samples batched
            with others never are).
        send_timeout_s: Pulsar only: how long a sample may wait for the broker (a broker
            failover takes seconds) before it is given up: under DROP_OLDEST it is dropped and
            subscribers see the gap; under BLOCK the next publish raises. 0 waits forever
            (None: 0 for BLOCK, 30 s for DROP_OLDEST).
    """

    backpressure: Backpressure = Backpressure.DROP_OLDEST
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    chunking: bool = True
    shm: bool | None = None
    shm_threshold_bytes: int = 64 * 1024
    send_timeout_s: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "backpressure", Backpressure.parse(self.backpressure))
        if self.max_payload_bytes <= 0:
            raise BusConfigError(f"max_payload_bytes must be positive, got {self.max_payload_bytes}")


@dataclass(frozen=True, slots=True)
class SubscriptionOptions:
    """How a subscription buffers samples for the application.

    Args:
        capacity: Bounded buffer size in samples.
        backpressure: ``DROP_OLDEST`` (latest wins, drops counted) or ``BLOCK`` (lossless).
        subscription_name: Pulsar only: a durable subscription name to resume from after a
            restart. None creates an ephemeral subscription removed on close.
        deliver_duplicates: Deliver samples whose sequence number was already seen (counted
            either way).
        auto_ack: Acknowledge each sample when the application takes it (default). With False
            the application calls ``sample.ack()`` when done (Pulsar redelivers unacknowledged
            samples to another consumer if this one goes away).
        key_shared_ranges: Pulsar only: share the stream(s) among the consumers of
            ``subscription_name`` with Key_Shared in STICKY mode, this consumer taking the
            given inclusive hash ranges of [0, 65535]; the same ranges apply on every topic.
        max_payload_bytes: Larger samples are rejected and counted as malformed (a hostile or
            broken publisher cannot fill the buffer with huge payloads).
        failover_group: Active/standby: of the subscriptions with this group name (in any
            process), exactly one live member receives the stream; when it goes away another
            takes over. Zenoh: the oldest member is active; standbys hold what it has not yet
            reported handled (up to ``capacity`` samples) and deliver that when they take over,
            so a takeover repeats at most the last 100 ms. Pulsar: a Failover subscription named
            ``subscription_name`` (default ``failover-<group>``) whose active consumer the broker
            picks (a member that joins may become it); what the active member had not
            acknowledged is redelivered to the next.
    """

    capacity: int = DEFAULT_CAPACITY
    backpressure: Backpressure = Backpressure.DROP_OLDEST
    subscription_name: str | None = None
    deliver_duplicates: bool = False
    auto_ack: bool = True
    key_shared_ranges: tuple[tuple[int, int], ...] | None = None
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    failover_group: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "backpressure", Backpressure.parse(self.backpressure))
        if self.max_payload_bytes <= 0:
            raise BusConfigError(f"max_payload_bytes must be positive, got {self.max_payload_bytes}")
        if self.capacity < 1:
            raise BusConfigError(f"subscription capacity must be >= 1, got {self.capacity}")
        if self.key_shared_ranges is not None:
            for lo, hi in self.key_shared_ranges:
                if not 0 <= lo <= hi <= 65535:
                    raise BusConfigError(f"key_shared_ranges: ({lo}, {hi}) is not within [0, 65535]")
            if self.subscription_name is None:
                raise BusConfigError("key_shared_ranges needs a subscription_name shared by the consumers")
        if self.failover_group is not None:
            if not FAILOVER_GROUP_RE.match(self.failover_group):
                raise BusConfigError(
                    f"failover_group {self.failover_group!r}: use letters, digits, '_', '-' and '.'"
                )
            if self.key_shared_ranges is not None:
                raise BusConfigError("a subscription is Key_Shared or failover, not both")
