"""Engines: Zenoh and Apache Pulsar behind one small interface, chosen from a URL."""

from embodied_bus.engines.base import Engine, EnginePublisher, EngineSubscriber, MessageSink
from embodied_bus.engines.urls import (
    DEFAULT_URL,
    PulsarSettings,
    ZenohSettings,
    parse_bus_url,
)

__all__ = [
    "DEFAULT_URL",
    "Engine",
    "EnginePublisher",
    "EngineSubscriber",
    "MessageSink",
    "PulsarSettings",
    "ZenohSettings",
    "open_engine",
    "parse_bus_url",
]


async def open_engine(settings: ZenohSettings | PulsarSettings) -> Engine:
    """Open the engine the settings describe (imports only that engine's client)."""
    if isinstance(settings, ZenohSettings):
        from embodied_bus.engines.zenoh import ZenohEngine

        return await ZenohEngine.open(settings)
    from embodied_bus.engines.pulsar import PulsarEngine

    return await PulsarEngine.open(settings)
