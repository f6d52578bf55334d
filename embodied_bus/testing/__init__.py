"""Helpers for tests and benchmarks that need real engines (Apache Pulsar standalone, free ports)."""

from embodied_bus.testing.ports import free_port, free_ports
from embodied_bus.testing.pulsar import PulsarStandalone, ensure_pulsar_distribution

__all__ = ["PulsarStandalone", "ensure_pulsar_distribution", "free_port", "free_ports"]
