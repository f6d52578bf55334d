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
import logging
import time
import uuid
from functools import partial
from typing import Any

import pulsar

from embodied_bus.engines.base import (
    Engine,
    EnginePublisher,
    EngineSubscriber,
    GroupMembership,
    MembershipCallback,
    MessageSink,
)
from embodied_bus.engines.blocking import call_bounded
from embodied_bus.engines.capabilities import Membership
from embodied_bus.engines.pulsar.group import PulsarGroup
from embodied_bus.engines.pulsar.handles import close_handle
from embodied_bus.engines.pulsar.logs import native_logger
from embodied_bus.engines.pulsar.native import (
    subscribe_pattern,
)
from embodied_bus.engines.pulsar.publisher import PulsarPublisher
from embodied_bus.engines.pulsar.subscriber import PulsarSubscriber, decode_batch_message
from embodied_bus.engines.pulsar.topics import BATCH_PROPERTY, group_topic, stream_pattern, stream_topic
from embodied_bus.engines.pulsar.tuning import MAX_PENDING_CHUNKED, SEEK_RETRY_S
from embodied_bus.engines.urls import PulsarSettings
from embodied_bus.errors import (
    BusClosedError,
    BusConnectionError,
    HeaderError,
)
from embodied_bus.model.header import Header
from embodied_bus.model.properties import decode_properties
from embodied_bus.model.qos import Backpressure, PublisherOptions, SubscriptionOptions

_logger = logging.getLogger("embodied_bus.pulsar")


class PulsarEngine(Engine, Membership):
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
            "logger": native_logger(),
        }
        if settings.service_url.startswith("pulsar+ssl"):
            kwargs["use_tls"] = True
            kwargs["tls_trust_certs_file_path"] = settings.tls_trust_certs_file
            kwargs["tls_allow_insecure_connection"] = settings.tls_allow_insecure
        if settings.listener:
            kwargs["listener_name"] = settings.listener
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
        except pulsar.AuthorizationError as err:
            await close_handle(client)
            raise BusConnectionError(
                f"Pulsar broker at {settings.service_url}: this client's role is not authorized on "
                f"namespace {settings.tenant}/{settings.pulsar_namespace} (a robot's token serves its "
                f"own namespace only): {err}"
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
        return PulsarPublisher(producer, stream, options)

    async def create_subscriber(
        self, stream: str | tuple[str, ...] | None, sink: MessageSink, options: SubscriptionOptions
    ) -> EngineSubscriber:
        self._check()
        group = options.failover_group
        if group is not None:  # one durable subscription shared by the group's members
            name = options.subscription_name or f"failover-{group}"
        else:
            name = options.subscription_name or f"eb-{uuid.uuid4().hex[:12]}"
        ephemeral = options.subscription_name is None and group is None
        topic: Any
        if stream is None:
            topic = stream_pattern(self.settings)
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
        if group is not None:
            # the broker makes the consumer whose name sorts first active, and moves the
            # subscription to a newcomer that sorts before it: names sort by join time, so the
            # oldest member stays active and a member that joins later stands by
            kwargs["consumer_type"] = pulsar.ConsumerType.Failover
            kwargs["consumer_name"] = f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"
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
        return PulsarSubscriber(consumer, sink, name, ephemeral, single_topic=isinstance(stream, str))

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
        topic = group_topic(self.settings, group)
        try:
            consumer = await asyncio.to_thread(
                self.client.subscribe,
                topic,
                f"eb-watch-{uuid.uuid4().hex[:12]}",
                consumer_type=pulsar.ConsumerType.Exclusive,
            )
        except pulsar.PulsarException as err:
            raise BusConnectionError(f"cannot watch group {group!r} on Pulsar: {err}") from err
        return PulsarGroup(self, group, on_change, consumer)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (the client, and every handle of it, is closed)."""
        return self._closed

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await close_handle(self.client)
