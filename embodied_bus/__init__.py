"""embodied_bus: robot middleware for ordered, time-bucketed sensor streams over Zenoh and
Apache Pulsar.

Quick start::

    import asyncio, time
    from embodied_bus import open_bus

    async def main():
        async with open_bus("zenoh:") as bus:
            sub = await bus.subscribe("imu")
            pub = await bus.publisher("imu", modality="imu")
            await pub.publish(b"...", stamp_ns=time.time_ns())
            print(await sub.recv(timeout_s=2))

    asyncio.run(main())
"""

from embodied_bus.bus import Bus, open_bus
from embodied_bus.errors import (
    BusClosedError,
    BusConfigError,
    BusConnectionError,
    EmbodiedBusError,
    EncodingError,
    HeaderError,
    PayloadTooLargeError,
    PublishError,
)
from embodied_bus.model import (
    BucketClock,
    Header,
    HeaderFlags,
    Modality,
    Sample,
)
from embodied_bus.model.qos import Backpressure, PublisherOptions, SubscriptionOptions
from embodied_bus.streams import Publisher, Subscription
from embodied_bus.sync import SyncActionHandle, SyncBus, SyncPlanner

__version__ = "0.1.0"

__all__ = [
    "Backpressure",
    "BucketClock",
    "Bus",
    "BusClosedError",
    "BusConfigError",
    "BusConnectionError",
    "EmbodiedBusError",
    "EncodingError",
    "Header",
    "HeaderError",
    "HeaderFlags",
    "Modality",
    "PayloadTooLargeError",
    "PublishError",
    "Publisher",
    "PublisherOptions",
    "Sample",
    "Subscription",
    "SubscriptionOptions",
    "SyncActionHandle",
    "SyncBus",
    "SyncPlanner",
    "__version__",
    "open_bus",
]
