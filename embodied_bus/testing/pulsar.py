"""Run a real Apache Pulsar standalone broker for tests, benchmarks and demos.

The distribution comes from Maven Central and is cached (see
:mod:`embodied_bus.testing.distribution`), so a second run does not download again.

Command line::

    python -m embodied_bus.testing.pulsar fetch          # download and unpack only
    python -m embodied_bus.testing.pulsar run            # start, print the URL, run until Ctrl-C
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from embodied_bus.testing.distribution import (
    LOW_LATENCY_CONF,
    PULSAR_VERSION,
    ensure_pulsar_distribution,
    hs256_token,
    write_conf,
)
from embodied_bus.testing.ports import free_ports
from embodied_bus.testing.reaper import watch_group

__all__ = [
    "LOW_LATENCY_CONF",
    "PULSAR_VERSION",
    "PulsarStandalone",
    "ensure_pulsar_distribution",
    "hs256_token",
    "write_conf",
]

#: JVM memory for the standalone broker.
PULSAR_MEM = "-Xms256m -Xmx1g -XX:MaxDirectMemorySize=1g"
#: How long a freshly started broker is watched for a flapping bookie registration, in s.
REGISTRATION_WATCH_S = 2.0
#: Registration events within the watch above that mean the registration is flapping.
REGISTRATION_FLAP_EVENTS = 50
#: Clean restarts tried when the bookie registration flaps after a start.
REGISTRATION_FLAP_RETRIES = 3
_REGISTRATION_EVENT = b"PulsarRegistrationClient - Bookie "
#: The standalone bookie turns read-only once its disk is 99 % full (``diskUsageThreshold`` in
#: ``standalone.conf``) and every topic then fails with "Not enough non-faulty bookies": refuse
#: to start below this share of free disk ...
MIN_FREE_DISK_FRACTION = 0.02
#: ... or below this many free bytes (a test session writes a few hundred MB).
MIN_FREE_DISK_BYTES = 1024**3


class PulsarStandalone:
    """One Apache Pulsar standalone process on free loopback ports.

    Args:
        data_dir: Where metadata and ledgers live; kept across :meth:`restart`.
        home: Pulsar home (default: :func:`ensure_pulsar_distribution`).
        extra_conf: ``standalone.conf`` keys to override (applied after the defaults, which
            include :data:`LOW_LATENCY_CONF`).
        admin_token: Token for the admin API (when the broker has authentication enabled).
        listener: Also advertise the broker under this listener name at
            ``127.0.0.1:<listener_port>`` (a port reserved here, on which nothing listens until
            a test puts a link there, e.g. a :class:`~embodied_bus.testing.linkproxy.LinkProxy`
            to :attr:`broker_port`); clients with ``?listener=<name>`` are given that address.
    """

    def __init__(
        self,
        data_dir: Path | None = None,
        *,
        home: Path | None = None,
        extra_conf: dict[str, str] | None = None,
        admin_token: str | None = None,
        listener: str | None = None,
    ) -> None:
        self.admin_token = admin_token
        self.listener = listener
        self.home = home or ensure_pulsar_distribution()
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="eb-pulsar-"))
        self.broker_port, self.web_port, self.bk_port, self.listener_port = free_ports(4)
        self.extra_conf = dict(extra_conf or {})
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Broker service URL."""
        return f"pulsar://127.0.0.1:{self.broker_port}"

    @property
    def listener_url(self) -> str:
        """The service URL of a client that reaches the broker through :attr:`listener_port`."""
        return f"pulsar://127.0.0.1:{self.listener_port}?listener={self.listener}"

    @property
    def web_url(self) -> str:
        """Admin REST URL."""
        return f"http://127.0.0.1:{self.web_port}"

    def _write_conf(self) -> Path:
        conf = {
            "brokerServicePort": str(self.broker_port),
            "webServicePort": str(self.web_port),
            "advertisedAddress": "127.0.0.1",
            "bindAddress": "127.0.0.1",
            "brokerDeduplicationEnabled": "false",
            **LOW_LATENCY_CONF,
            **self.extra_conf,
        }
        if self.listener:
            conf["advertisedListeners"] = (
                f"internal:pulsar://127.0.0.1:{self.broker_port},"
                f"{self.listener}:pulsar://127.0.0.1:{self.listener_port}"
            )
            conf["internalListenerName"] = "internal"
        return write_conf(self.home / "conf" / "standalone.conf", self.data_dir / "standalone.conf", conf)

    def start(self, timeout_s: float = 180.0) -> None:
        """Start the broker and wait until it serves lookups and can create ledgers.

        After the admin API answers, the bookie registration is watched for
        :data:`REGISTRATION_WATCH_S`; a registration caught in a delete/re-create loop (a Pulsar
        standalone fault after a crash) is cleared by a clean restart.

        Raises:
            RuntimeError: It did not become ready in time, or its bookie registration kept
                flapping; the end of its log is included.
        """
        self._check_disk()
        self._launch(timeout_s)
        for _ in range(REGISTRATION_FLAP_RETRIES):
            if not self.registration_flapping():
                return
            # Pulsar 4.0 standalone keeps its bookie registration in its RocksDB metadata store;
            # after a kill -9 the stale entry sometimes sets off an endless delete/re-create loop
            # of that entry (thousands of events a second, seen in about one restart in four),
            # and while it lasts creating any ledger fails with "Not enough non-faulty bookies".
            # A clean stop removes the entry, so the next start registers once.
            self.stop()
            self._launch(timeout_s)
        if self.registration_flapping():
            raise RuntimeError(f"Pulsar standalone's bookie registration keeps flapping:\n{self.tail()}")

    def _check_disk(self) -> None:
        """Raise a clear error when the data directory's disk is too full for the bookie."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        usage = shutil.disk_usage(self.data_dir)
        if usage.free < MIN_FREE_DISK_BYTES or usage.free < MIN_FREE_DISK_FRACTION * usage.total:
            leftovers = sorted(self.data_dir.parent.glob("eb-pulsar-*"))
            raise RuntimeError(
                f"not enough free disk for Pulsar standalone in {self.data_dir.parent}: "
                f"{usage.free / 1024**3:.1f} GiB of {usage.total / 1024**3:.0f} GiB free "
                f"(its bookie turns read-only at 99 % use; need {MIN_FREE_DISK_BYTES / 1024**3:.0f} GiB "
                f"and {MIN_FREE_DISK_FRACTION:.0%} free). {len(leftovers)} broker data directories "
                f"(eb-pulsar-*) are there; those of brokers no longer running can be deleted."
            )

    def registration_flapping(self) -> bool:
        """Whether the bookie registration is being deleted and re-created in a loop."""
        start = self.log_path.stat().st_size
        time.sleep(REGISTRATION_WATCH_S)
        with open(self.log_path, "rb") as log:
            log.seek(start)
            events = log.read().count(_REGISTRATION_EVENT)
        return events >= REGISTRATION_FLAP_EVENTS

    def _launch(self, timeout_s: float) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        conf = self._write_conf()
        env = {
            **os.environ,
            "PULSAR_MEM": PULSAR_MEM,
            "PULSAR_LOG_DIR": str(self.data_dir / "logs"),
            "PULSAR_GC_LOG": "-Xlog:disable",
        }
        self.log_path = self.data_dir / "standalone.out"
        log = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the child's lifetime
        self.proc = subprocess.Popen(
            [
                str(self.home / "bin" / "pulsar"),
                "standalone",
                "-nfw",
                "-nss",
                "-c",
                str(conf),
                "--bookkeeper-port",
                str(self.bk_port),
                "--metadata-dir",
                str(self.data_dir / "metadata"),
                "--bookkeeper-dir",
                str(self.data_dir / "bookkeeper"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        log.close()
        watch_group(self.proc.pid)  # killed with its test process, also one that crashed
        self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        """Poll the admin API until the broker and the public/default namespace answer."""
        deadline = time.monotonic() + timeout_s
        checks = ["/admin/v2/brokers/health", "/admin/v2/namespaces/public/default"]
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"Pulsar standalone exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                for path in checks:
                    req = urllib.request.Request(self.web_url + path)
                    if self.admin_token:
                        req.add_header("Authorization", f"Bearer {self.admin_token}")
                    with urllib.request.urlopen(req, timeout=2) as resp:
                        resp.read()
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"Pulsar standalone not ready after {timeout_s:g} s:\n{self.tail()}")

    def admin(self, method: str, path: str, body: object = None, timeout_s: float = 10.0) -> object:
        """Call the admin REST API (``path`` from ``/admin/v2/...``) with a JSON body; return the
        decoded JSON answer (None when empty).

        Raises:
            urllib.error.HTTPError: The broker refused (its status and message).
        """
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.web_url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.admin_token:
            req.add_header("Authorization", f"Bearer {self.admin_token}")
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            answer = resp.read()
        return json.loads(answer) if answer else None

    def tail(self, lines: int = 40) -> str:
        """The end of the broker's console log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except (OSError, AttributeError):
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL the broker (a crash, not a clean shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.proc = None

    def stop(self) -> None:
        """Stop the broker (SIGTERM, then SIGKILL after 20 s)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None

    def restart(self, *, crash: bool = True, timeout_s: float = 180.0) -> None:
        """Kill (or stop) and start again on the same ports and data."""
        if crash:
            self.kill()
        else:
            self.stop()
        self.start(timeout_s)

    def cleanup(self) -> None:
        """Stop and remove the data directory if it was created here."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> PulsarStandalone:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def main(argv: list[str] | None = None) -> int:
    """``python -m embodied_bus.testing.pulsar fetch|run|cluster``."""
    parser = argparse.ArgumentParser(prog="python -m embodied_bus.testing.pulsar")
    parser.add_argument("command", choices=["fetch", "run", "cluster"])
    parser.add_argument("--brokers", type=int, default=2, help="cluster: brokers (default 2)")
    parser.add_argument("--bookies", type=int, default=2, help="cluster: bookies (default 2)")
    parser.add_argument(
        "--auth",
        action="store_true",
        help="cluster: token authentication (the JSON line gives the admin token)",
    )
    args = parser.parse_args(argv)
    home = ensure_pulsar_distribution()
    if args.command == "fetch":
        print(home)
        return 0

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    # A broker's data directory grows to gigabytes: SIGTERM and SIGHUP remove it too, as Ctrl-C
    # does (a `kill` would otherwise leave one behind in /tmp).
    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGHUP, terminate)
    if args.command == "cluster":
        return _run_cluster(args.brokers, args.bookies, auth=args.auth)
    broker = PulsarStandalone(home=home)
    try:
        broker.start()
        print(f"data: {broker.data_dir} (removed when this stops)", file=sys.stderr, flush=True)
        print(broker.url, flush=True)
        assert broker.proc is not None
        code = broker.proc.wait()
        print(f"the broker exited by itself with {code}:\n{broker.tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        broker.cleanup()


def _run_cluster(brokers: int, bookies: int, *, auth: bool) -> int:
    """Start a cluster, print its JSON line, run until SIGTERM or Ctrl-C, then stop it."""
    from embodied_bus.testing.cluster import PulsarCluster

    cluster = PulsarCluster(brokers, bookies, auth=auth)
    try:
        cluster.start()
        print(json.dumps(cluster.describe()), flush=True)
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, SystemExit):
        return 0
    finally:
        cluster.cleanup()


if __name__ == "__main__":
    sys.exit(main())
