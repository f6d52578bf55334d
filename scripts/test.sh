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
# Most tests wait on the engines, so two pytest workers (each with its own Pulsar standalone)
# share two cores well (a module's tests stay on one worker: module fixtures such as the Pulsar
# cluster start once); the tests marked serial (processes killed, real-time replays, ROS
# launches) then run alone. Each run is bounded, so a hang fails fast instead of eating CI's hour.
status=0
timeout --kill-after=60s 30m .venv/bin/python -m pytest -n 2 --dist loadfile -m "not serial" --durations=15 "$@" || status=$?
[ "$status" -eq 5 ] && status=0  # nothing selected (arguments naming serial tests only)
serial=0
timeout --kill-after=60s 30m .venv/bin/python -m pytest -m serial --durations=15 "$@" || serial=$?
[ "$serial" -eq 5 ] && serial=0
[ "$status" -ne 0 ] && exit "$status"
exit "$serial"
