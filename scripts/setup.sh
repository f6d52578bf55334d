#!/usr/bin/env bash
# Set up everything embodied_bus needs on a fresh Debian/Ubuntu machine, idempotently:
# Debian packages (libusb for open3d, Java 17 + Maven to fetch and run Apache Pulsar for tests),
# a virtual environment in .venv and the package with the requested extras.
# Usage: scripts/setup.sh [EXTRAS]   (default: pulsar)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-pulsar}"

need=()
dpkg -s libusb-1.0-0 >/dev/null 2>&1 || need+=(libusb-1.0-0)
if [[ ",$extras," == *",test,"* ]]; then
  command -v java >/dev/null 2>&1 || need+=(openjdk-17-jre-headless)
  command -v mvn >/dev/null 2>&1 || need+=(maven)
fi
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
if ((${#need[@]})); then
  sudo=""; [[ "$(id -u)" == 0 ]] || sudo="sudo"
  echo "installing Debian packages: ${need[*]}" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi

if [[ ! -x .venv/bin/python ]]; then
  python3 -m venv .venv
fi
stamp=".venv/.eb-installed-$extras-$(cat setup.py | sha1sum | cut -c1-12)"
if [[ ! -f "$stamp" ]]; then
  # pip's output goes to a log, shown only if it fails (an editable install prints a
  # setuptools banner that reads like a problem and is not one)
  log=".venv/pip-install.log"
  echo "installing embodied_bus[$extras] and its Python packages into .venv (log: $log)" >&2
  if ! { .venv/bin/python -m pip install -q --upgrade pip &&
    .venv/bin/python -m pip install -q -e ".[$extras]"; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "setup.sh: pip install failed (the log above is also in $log)" >&2
    exit 1
  fi
  touch "$stamp"
fi
