#!/usr/bin/env bash
# The main job: set up, then run the demo on embedded defaults (Zenoh, no server to install).
# Extra arguments go to `embodied-bus demo` (e.g. --duration 5 --json).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh pulsar,view
exec .venv/bin/embodied-bus demo "$@"
