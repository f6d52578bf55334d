"""Helpers for tests and benchmarks that need real engines.

* :mod:`embodied_bus.testing.pulsar`: Apache Pulsar standalone from Maven Central.
* :mod:`embodied_bus.testing.ports`: free loopback ports.
"""

__all__: list[str] = []
