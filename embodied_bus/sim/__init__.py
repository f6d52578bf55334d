"""Synthetic sensors for demos, tests and benchmarks (no robot needed)."""

from embodied_bus.sim.synthetic import DEFAULT_SENSORS, SensorSpec, run_sensor

__all__ = ["DEFAULT_SENSORS", "SensorSpec", "run_sensor"]
