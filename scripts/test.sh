#!/usr/bin/env bash
# The whole test suite from a fresh clone: set up, lint, type-check, check the layers, build the
# docs, then pytest against real
# engines (Zenoh on loopback; Apache Pulsar standalone fetched from Maven Central, cached under
# ~/.cache/embodied_bus and started by the test session). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh pulsar,test
.venv/bin/python -m embodied_bus.testing.pulsar fetch >/dev/null
# real ROS 2 Jazzy (rclpy over Fast DDS, launch, the ros2 tools, rmw_zenoh_cpp) for the ROS tests,
# built once into ~/.cache/embodied_bus from the ROS 2 wheels beside the clone where they are (else they skip)
.venv/bin/python -m embodied_bus.testing.ros2 setup
.venv/bin/ruff check embodied_bus test bench examples
.venv/bin/mypy embodied_bus
.venv/bin/lint-imports                    # the layers of docs/architecture.md
.venv/bin/mkdocs build --strict --quiet   # the documentation, warnings as errors
# A bound on the whole pytest run (normally 5-10 min): a hang fails fast instead of eating CI's hour.
exec timeout --kill-after=60s 45m .venv/bin/python -m pytest --durations=30 "$@"
