"""Topic names of streams and groups on Pulsar, and the property that marks a batch."""

from __future__ import annotations

import logging
import re

from embodied_bus.engines.urls import PulsarSettings

_logger = logging.getLogger("embodied_bus.pulsar")


def stream_topic(settings: PulsarSettings, stream: str) -> str:
    """Pulsar topic of a stream."""
    name = stream.replace("/", ".")
    return f"persistent://{settings.tenant}/{settings.pulsar_namespace}/eb.{settings.namespace}.{name}"


def stream_pattern(settings: PulsarSettings) -> re.Pattern[str]:
    """Every stream topic of the bus namespace: not the action queue's topics (its state log,
    dead letters and priority levels share the prefix; stream names that would map onto them
    are reserved). Without the ``persistent://`` domain, which the client only warns about:
    a pattern subscription reads persistent topics by default."""
    prefix = f"{settings.tenant}/{settings.pulsar_namespace}/eb.{settings.namespace}."
    return re.compile(re.escape(prefix) + r"(?!actions\.(?:q[0-9]\.|state$|dlq$))[A-Za-z0-9_\-.]+")


def group_topic(settings: PulsarSettings, group: str) -> str:
    return (
        f"non-persistent://{settings.tenant}/{settings.pulsar_namespace}/"
        f"eb.{settings.namespace}.group.{group.replace('/', '.')}"
    )


#: Property that marks a batch message: ``"<layout>|<length of the batch head>"``; the message
#: data is the head (the Zenoh batch attachment, see ``wire.encode_batch``) then the payloads.
BATCH_PROPERTY = "eb.b"
