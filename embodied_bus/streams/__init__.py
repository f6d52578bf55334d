"""Sensor streams: publishers, subscriptions, backpressure and sequence tracking."""

from embodied_bus.streams.backpressure import BoundedBuffer
from embodied_bus.streams.publisher import Publisher
from embodied_bus.streams.stats import StreamStats
from embodied_bus.streams.subscriber import Subscription
from embodied_bus.streams.tracker import SequenceTracker, Verdict

__all__ = [
    "BoundedBuffer",
    "Publisher",
    "SequenceTracker",
    "StreamStats",
    "Subscription",
    "Verdict",
]
