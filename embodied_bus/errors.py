"""The error hierarchy of embodied_bus: one root, a few precise subclasses.

Foreign errors (zenoh, pulsar-client, rosbags) are translated at the boundary where they
occur, with the original chained (``raise BusConnectionError(msg) from err``).
"""

from __future__ import annotations

__all__ = [
    "BusClosedError",
    "BusConfigError",
    "BusConnectionError",
    "EmbodiedBusError",
    "EncodingError",
    "HeaderError",
    "PayloadTooLargeError",
    "PublishError",
]


class EmbodiedBusError(Exception):
    """Root of every error raised by embodied_bus."""


class BusConfigError(EmbodiedBusError, ValueError):
    """A bus URL, option or config file is invalid; the message names the offending key."""


class BusConnectionError(EmbodiedBusError, ConnectionError):
    """The engine (Zenoh router, Pulsar broker) could not be reached in time."""


class BusClosedError(EmbodiedBusError):
    """An operation was attempted on a closed bus, publisher or subscription."""


class HeaderError(EmbodiedBusError, ValueError):
    """A wire header is malformed (bad magic, version, length or field value)."""


class EncodingError(EmbodiedBusError, ValueError):
    """A payload does not match its declared encoding (e.g. a broken ``npy`` blob)."""


class PayloadTooLargeError(EmbodiedBusError, ValueError):
    """A payload exceeds the configured or engine limit (e.g. Pulsar without chunking)."""


class PublishError(EmbodiedBusError):
    """The engine refused or failed to deliver a published sample."""
