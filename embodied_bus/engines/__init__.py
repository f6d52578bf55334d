"""Engines: Zenoh and Apache Pulsar behind one small interface, chosen by a URL's scheme."""

from embodied_bus.engines.base import Engine, EnginePublisher, EngineSubscriber, MessageSink
from embodied_bus.engines.registry import open_engine, register_engine
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
    "register_engine",
]
