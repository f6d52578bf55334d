"""The Apache Pulsar distribution the tests, benchmarks and demos run: fetched once from Maven
Central (``org.apache.pulsar:pulsar-server-distribution:<version>:tar.gz:bin``) through ``mvn
dependency:copy``, cached under ``$EMBODIED_BUS_CACHE`` (default ``~/.cache/embodied_bus``), and
the helpers a standalone broker and a cluster share (configuration files, tokens)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

__all__ = [
    "LOW_LATENCY_CONF",
    "PULSAR_VERSION",
    "cache_dir",
    "ensure_pulsar_distribution",
    "hs256_token",
    "write_conf",
]

#: Apache Pulsar version used by tests (4.0 LTS: Key_Shared with PIP-379).
PULSAR_VERSION = os.environ.get("EMBODIED_BUS_PULSAR_VERSION", "4.0.8")
#: Broker and bookie settings for latency, which robot work depends on (``standalone.conf`` keys;
#: on a cluster the first goes in ``broker.conf``, the second in ``bookkeeper.conf``). Neither
#: weakens durability; both are what Pulsar's own comments advise for latency-sensitive use.
#:
#: * ``managedLedgerNewEntriesCheckDelayInMillis`` 10 -> 0: a consumer that has read everything
#:   otherwise waits up to 10 ms before the broker looks for new entries, on every hop.
#: * ``journalFlushWhenQueueEmpty`` false -> true: the bookie writes and fsyncs its journal as
#:   soon as nothing more is queued instead of waiting up to ``journalMaxGroupWaitMSec`` (2 ms)
#:   to group writes (under load the queue is rarely empty and writes still group).
#:
#: Both cut the latency of a persisted send (and so of an action's start, its redelivery and
#: a small stream sample) several times over, with throughput unchanged: see
#: docs/performance.md.
LOW_LATENCY_CONF = {
    "managedLedgerNewEntriesCheckDelayInMillis": "0",
    "journalFlushWhenQueueEmpty": "true",
}


def hs256_token(secret: bytes, subject: str) -> str:
    """A Pulsar JWT (HS256, ``sub`` = role) signed with ``secret`` (as ``tokenSecretKey``)."""

    def b64(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    head = b64(json.dumps({"alg": "HS256"}, separators=(",", ":")).encode())
    body = b64(json.dumps({"sub": subject}, separators=(",", ":")).encode())
    sig = hmac.new(secret, f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{b64(sig)}"


def write_conf(template: Path, out: Path, values: dict[str, str]) -> Path:
    """Write ``template`` (a Pulsar ``key=value`` file) to ``out`` with ``values`` set: each
    replaces its line, the others are added at the end; returns ``out``."""
    lines, seen = [], set()
    for line in template.read_text().splitlines():
        key = line.split("=", 1)[0].strip()
        if not line.startswith("#") and key in values:
            lines.append(f"{key}={values[key]}")
            seen.add(key)
        else:
            lines.append(line)
    lines.extend(f"{k}={v}" for k, v in values.items() if k not in seen)
    out.write_text("\n".join(lines) + "\n")
    return out


def cache_dir() -> Path:
    """Where downloads are cached."""
    return Path(os.environ.get("EMBODIED_BUS_CACHE", Path.home() / ".cache" / "embodied_bus"))


def ensure_pulsar_distribution(version: str = PULSAR_VERSION) -> Path:
    """Return the unpacked Pulsar home, downloading it with Maven on first use.

    Raises:
        RuntimeError: Maven is missing or the download failed; the message says what to do.
    """
    root = cache_dir() / "pulsar"
    home = root / f"apache-pulsar-{version}"
    if (home / "bin" / "pulsar").exists():
        return home
    root.mkdir(parents=True, exist_ok=True)
    tgz = root / f"pulsar-server-distribution-{version}-bin.tar.gz"
    if not tgz.exists():
        mvn = shutil.which("mvn")
        if mvn is None:
            raise RuntimeError("Apache Maven (mvn) is needed to fetch Apache Pulsar; apt-get install maven")
        artifact = f"org.apache.pulsar:pulsar-server-distribution:{version}:tar.gz:bin"
        print(f"fetching Apache Pulsar {version} from Maven Central ...", file=sys.stderr, flush=True)
        proc = subprocess.run(
            [mvn, "-q", "-B", "dependency:copy", f"-Dartifact={artifact}", f"-DoutputDirectory={root}"],
            capture_output=True,
            text=True,
            cwd=root,
            check=False,
        )
        if proc.returncode != 0 or not tgz.exists():
            raise RuntimeError(f"mvn dependency:copy {artifact} failed:\n{proc.stdout}\n{proc.stderr}")
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        with tarfile.open(tgz) as tar:
            tar.extractall(tmp, filter="tar")
        (Path(tmp) / home.name).rename(home)
    return home
