"""The Apache Pulsar engine: one persistent topic per stream, keyed by bucket id."""

from embodied_bus.engines.pulsar.engine import PulsarEngine
from embodied_bus.engines.pulsar.handles import close_handle
from embodied_bus.engines.pulsar.subscriber import decode_batch_message
from embodied_bus.engines.pulsar.topics import BATCH_PROPERTY, stream_topic
from embodied_bus.engines.pulsar.tuning import PULSAR_MAX_MESSAGE_BYTES

__all__ = [
    "BATCH_PROPERTY",
    "PULSAR_MAX_MESSAGE_BYTES",
    "PulsarEngine",
    "close_handle",
    "decode_batch_message",
    "stream_topic",
]
