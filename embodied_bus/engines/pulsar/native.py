"""The one place that reaches into pulsar-client's native (C++) layer.

pulsar-client's Python wrappers check every argument and build a wrapper object per call; the
stream engine and the Pulsar action queue send, receive and acknowledge through the native
objects behind them instead (our arguments have known types). Each helper falls back to the
public API when a client version lacks what it uses.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pulsar

__all__ = [
    "PATTERN_DISCOVERY_S",
    "MessageBuilder",
    "last_message_id_async",
    "native_consumer",
    "native_producer",
    "native_reader",
    "receive_async",
    "send_async",
    "subscribe_pattern",
]

_log = logging.getLogger("embodied_bus.pulsar")

#: The client's native message builder, or None if this client version lacks it.
MessageBuilder: Any = getattr(getattr(pulsar, "_pulsar", None), "MessageBuilder", None)


def _native(handle: Any, attr: str) -> Any:
    inner = getattr(handle, attr, None) if MessageBuilder is not None else None
    return handle if inner is None else inner


def native_producer(producer: Any) -> Any:
    """A producer's native producer where the fast path is available, else the producer."""
    return _native(producer, "_producer")


def native_consumer(consumer: Any) -> Any:
    """A consumer's native consumer where the fast path is available, else the consumer."""
    return _native(consumer, "_consumer")


def native_reader(reader: Any) -> Any:
    """A reader's native reader where the fast path is available, else the reader (both have
    ``read_next`` and ``has_message_available``; native messages have ``data()`` and
    ``partition_key()`` as the wrappers do)."""
    return _native(reader, "_reader")


def send_async(
    producer: Any,
    data: bytes,
    callback: Callable[[Any, Any], None] | None,
    *,
    partition_key: str | None = None,
    properties: dict[str, str] | None = None,
    deliver_after: timedelta | None = None,
) -> None:
    """``producer.send_async`` through the native message builder when there is one."""
    native = native_producer(producer)
    if native is producer:
        producer.send_async(
            data, callback, partition_key=partition_key, properties=properties, deliver_after=deliver_after
        )
        return
    mb = MessageBuilder().content(data)
    for k, v in (properties or {}).items():
        mb.property(k, v)
    if partition_key:
        mb.partition_key(partition_key)
    if deliver_after is not None:
        mb.deliver_after(deliver_after)
    native.send_async(mb.build(), callback)


def receive_async(consumer: Any, callback: Callable[[Any, Any], None]) -> None:
    """Ask a consumer for its next message: ``callback(result, message)`` on a client thread."""
    inner = getattr(consumer, "_consumer", None)
    if inner is None:
        raise pulsar.PulsarException("this pulsar-client has no asynchronous receive")
    inner.receive_async(callback)


def last_message_id_async(consumer: Any, callback: Callable[[Any, Any], None]) -> None:
    """Ask the broker for a consumer's topic's last message id: ``callback(result, id)``."""
    inner = getattr(consumer, "_consumer", None)
    if inner is None:
        raise pulsar.PulsarException("this pulsar-client cannot ask for the last message id asynchronously")
    inner.get_last_message_id_async(callback)


#: A subscription to every stream looks for new stream topics this often, seconds.
PATTERN_DISCOVERY_S = 1


def subscribe_pattern(client: pulsar.Client, pattern: re.Pattern[str], name: str, **kwargs: Any) -> Any:
    """``client.subscribe(pattern, name, **kwargs)`` with the topic discovery period set to
    :data:`PATTERN_DISCOVERY_S`: pulsar-client-python checks its ``pattern_auto_discovery_period``
    argument and never passes it on (apache/pulsar-client-python#171), so a subscription to
    every stream would find a stream that started after it only within the client's default
    60 s. Falls back to the public call (and its 60 s) if the client's native API differs."""
    native = getattr(pulsar, "_pulsar", None)
    try:
        conf = native.ConsumerConfiguration()  # type: ignore[union-attr]
        conf.consumer_type(kwargs.get("consumer_type", pulsar.ConsumerType.Exclusive))
        conf.receiver_queue_size(kwargs.get("receiver_queue_size", 1000))
        conf.subscription_initial_position(kwargs.get("initial_position", pulsar.InitialPosition.Latest))
        conf.max_pending_chunked_message(kwargs.get("max_pending_chunked_message", 10))
        conf.auto_ack_oldest_chunked_message_on_queue_full(
            kwargs.get("auto_ack_oldest_chunked_message_on_queue_full", False)
        )
        if "key_shared_policy" in kwargs:
            conf.key_shared_policy(kwargs["key_shared_policy"].policy())
        if "consumer_name" in kwargs:
            conf.consumer_name(kwargs["consumer_name"])
        schema = pulsar.schema.BytesSchema()
        conf.schema(schema.schema_info())
        conf.pattern_auto_discovery_period(PATTERN_DISCOVERY_S)
        consumer = pulsar.Consumer()
        consumer._consumer = client._client.subscribe_pattern(pattern.pattern, name, conf)
    except (AttributeError, TypeError) as err:
        _log.debug("native pattern subscription unavailable (%s): the public call", err)
        return client.subscribe(pattern, name, **kwargs)
    consumer._client = client
    consumer._schema = schema
    schema.attach_client(client._client)
    client._consumers.append(consumer)
    return consumer
