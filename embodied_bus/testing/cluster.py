"""A real Apache Pulsar cluster on this machine: ZooKeeper, bookies and brokers, each its own
process on free loopback ports, from the distribution the tests already fetch.

Sized for a 2-core, few-GiB machine: each JVM gets a small heap, and ledgers are written to
every bookie (ensemble, write and ack quorum 2 with 2 bookies), so a bookie lost loses nothing
acknowledged. Brokers give up a dead broker's topics after :data:`SESSION_TIMEOUT_MS`.

Command line::

    python -m embodied_bus.testing.pulsar cluster --brokers 2 --bookies 2
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embodied_bus.testing.distribution import (
    LOW_LATENCY_CONF,
    ensure_pulsar_distribution,
    hs256_token,
    write_conf,
)
from embodied_bus.testing.ports import free_ports
from embodied_bus.testing.reaper import watch_group

__all__ = ["SESSION_TIMEOUT_MS", "Member", "PulsarCluster"]

#: How long a member's metadata session outlives its process: a killed broker's topics move to
#: another broker after this (Pulsar's default is 30 s), ms.
SESSION_TIMEOUT_MS = 6000
_TOKEN_PROVIDER = "org.apache.pulsar.broker.authentication.AuthenticationProviderToken"
_MEM = {
    "zookeeper": "-Xms64m -Xmx192m",
    "bookie": "-Xms128m -Xmx384m -XX:MaxDirectMemorySize=384m",
    "broker": "-Xms128m -Xmx512m -XX:MaxDirectMemorySize=512m",
}


@dataclass
class Member:
    """One process of the cluster."""

    role: str
    name: str
    conf: Path
    ports: dict[str, int]
    proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class PulsarCluster:
    """ZooKeeper, ``bookies`` bookies and ``brokers`` brokers of one cluster (``test``).

    Args:
        brokers: Brokers (each its own process).
        bookies: Bookies; ledgers go to ``min(bookies, 2)`` of them.
        data_dir: Where every member keeps its data (default: a temporary directory).
        auth: Token authentication and authorization on the brokers (HS256 tokens signed with a
            secret made here; role ``admin`` is the superuser): clients need
            :meth:`client_url`, robots get their own namespace from :meth:`add_robot`.
        listener: Also advertise each broker under this listener name at a port reserved here
            (:attr:`Member.ports` ``["listener"]``, where a test puts a link to the broker's
            service port); clients of :meth:`listener_url` are given those addresses.
    """

    def __init__(
        self,
        brokers: int = 2,
        bookies: int = 2,
        data_dir: Path | None = None,
        *,
        auth: bool = False,
        listener: str | None = None,
    ) -> None:
        self.listener = listener
        self.home = ensure_pulsar_distribution()
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="eb-pulsar-cluster-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._secret = secrets.token_bytes(32) if auth else None
        auth_conf: dict[str, str] = {}
        if self._secret is not None:
            key = self.data_dir / "token-secret.key"
            key.write_bytes(self._secret)
            key.chmod(0o600)
            auth_conf = {
                "authenticationEnabled": "true",
                "authenticationProviders": _TOKEN_PROVIDER,
                "tokenSecretKey": f"file://{key}",
                "authorizationEnabled": "true",
                "superUserRoles": "admin",
                "brokerClientAuthenticationPlugin": "org.apache.pulsar.client.impl.auth.AuthenticationToken",
                "brokerClientAuthenticationParameters": f"token:{self.token('admin')}",
            }
        (zk_port,) = free_ports(1)
        self.zk_url = f"127.0.0.1:{zk_port}"
        conf = self.home / "conf"
        quorum = str(min(bookies, 2))
        self.zookeeper = Member(
            "zookeeper",
            "zookeeper",
            write_conf(
                conf / "zookeeper.conf",
                self.data_dir / "zookeeper.conf",
                {
                    "dataDir": str(self.data_dir / "zk"),
                    "clientPort": str(zk_port),
                    "admin.enableServer": "false",
                    "metricsProvider.className": "org.apache.zookeeper.metrics.impl.NullMetricsProvider",
                },
            ),
            {"client": zk_port},
        )
        self.bookies: list[Member] = []
        for i in range(bookies):
            (port,) = free_ports(1)
            values = {
                "bookiePort": str(port),
                "advertisedAddress": "127.0.0.1",
                "allowLoopback": "true",
                "journalDirectory": str(self.data_dir / f"bookie{i}" / "journal"),
                "ledgerDirectories": str(self.data_dir / f"bookie{i}" / "ledgers"),
                "metadataServiceUri": f"zk+hierarchical://{self.zk_url}/ledgers",
                "zkServers": self.zk_url,
                "httpServerEnabled": "false",
                "statsProviderClass": "org.apache.bookkeeper.stats.NullStatsProvider",
                "dbStorage_writeCacheMaxSizeMb": "64",
                "dbStorage_readAheadCacheMaxSizeMb": "64",
                "zkTimeout": str(SESSION_TIMEOUT_MS),
                "journalFlushWhenQueueEmpty": LOW_LATENCY_CONF["journalFlushWhenQueueEmpty"],
            }
            path = write_conf(conf / "bookkeeper.conf", self.data_dir / f"bookie{i}.conf", values)
            self.bookies.append(Member("bookie", f"bookie{i}", path, {"bookie": port}))
        self.brokers: list[Member] = []
        for i in range(brokers):
            service, web, outside = free_ports(3)
            listeners: dict[str, str] = {}
            if listener:
                listeners = {
                    "advertisedListeners": f"internal:pulsar://127.0.0.1:{service},"
                    f"{listener}:pulsar://127.0.0.1:{outside}",
                    "internalListenerName": "internal",
                }
            values = {
                "metadataStoreUrl": f"zk:{self.zk_url}",
                "configurationMetadataStoreUrl": f"zk:{self.zk_url}",
                "clusterName": "test",
                "brokerServicePort": str(service),
                "webServicePort": str(web),
                "bindAddress": "127.0.0.1",
                "advertisedAddress": "127.0.0.1",
                "metadataStoreSessionTimeoutMillis": str(SESSION_TIMEOUT_MS),
                "managedLedgerDefaultEnsembleSize": quorum,
                "managedLedgerDefaultWriteQuorum": quorum,
                "managedLedgerDefaultAckQuorum": quorum,
                "functionsWorkerEnabled": "false",
                "brokerDeduplicationEnabled": "false",
                # topics move only when their broker dies: a bundle shed to the other broker
                # while a test kills a member would be a second, unplanned failover
                "loadBalancerSheddingEnabled": "false",
                "managedLedgerNewEntriesCheckDelayInMillis": LOW_LATENCY_CONF[
                    "managedLedgerNewEntriesCheckDelayInMillis"
                ],
                **auth_conf,
                **listeners,
            }
            path = write_conf(conf / "broker.conf", self.data_dir / f"broker{i}.conf", values)
            ports = {"service": service, "web": web, "listener": outside}
            self.brokers.append(Member("broker", f"broker{i}", path, ports))

    # ------------------------------------------------------------------ addresses
    @property
    def service_url(self) -> str:
        """Every broker, as a client lists them."""
        return "pulsar://" + ",".join(f"127.0.0.1:{b.ports['service']}" for b in self.brokers)

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.brokers[0].ports['web']}"

    def listener_url(self, role: str = "admin", **query: str) -> str:
        """Every broker's listener address, for a client outside (see ``listener``)."""
        if not self.listener:
            raise RuntimeError("this cluster has no listener (PulsarCluster(listener=...))")
        query = {"listener": self.listener, **query}
        if self._secret is not None:
            query = {"token": self.token(role), **query}
        hosts = ",".join(f"127.0.0.1:{b.ports['listener']}" for b in self.brokers)
        return f"pulsar://{hosts}?" + urllib.parse.urlencode(query)

    # ------------------------------------------------------------------ credentials
    def token(self, role: str) -> str:
        """A token for ``role`` (an empty string when the cluster has no authentication)."""
        return hs256_token(self._secret, role) if self._secret is not None else ""

    def client_url(self, role: str = "admin", **query: str) -> str:
        """:attr:`service_url` for a client of ``role`` (its token inline), with URL options."""
        if self._secret is not None:
            query = {"token": self.token(role), **query}
        return self.service_url + ("?" + urllib.parse.urlencode(query) if query else "")

    def add_robot(self, robot: str, tenant: str = "fleet") -> str:
        """Give ``robot`` its own Pulsar namespace ``<tenant>/<robot>``, where only role
        ``robot-<robot>`` (and the superuser) may produce and consume; returns its token."""
        try:
            self.admin("PUT", f"/admin/v2/tenants/{tenant}", {"adminRoles": [], "allowedClusters": ["test"]})
        except urllib.error.HTTPError as err:
            if err.code != 409:  # 409: the tenant exists
                raise
        self.admin("PUT", f"/admin/v2/namespaces/{tenant}/{robot}")
        role = f"robot-{robot}"
        self.admin(
            "POST", f"/admin/v2/namespaces/{tenant}/{robot}/permissions/{role}", ["produce", "consume"]
        )
        return self.token(role)

    def describe(self) -> dict[str, Any]:
        """The JSON line printed when the cluster is ready."""
        return {
            "service_url": self.service_url,
            **({"admin_token": self.token("admin")} if self._secret is not None else {}),
            "admin_url": self.admin_url,
            "brokers": [
                {
                    "service_url": f"pulsar://127.0.0.1:{b.ports['service']}",
                    "admin_url": f"http://127.0.0.1:{b.ports['web']}",
                    "pid": b.pid,
                }
                for b in self.brokers
            ],
            "bookies": [{"pid": b.pid, "port": b.ports["bookie"]} for b in self.bookies],
            "zookeeper": {"pid": self.zookeeper.pid, "url": self.zk_url},
        }

    # ------------------------------------------------------------------ processes
    def _env(self, member: Member) -> dict[str, str]:
        env = dict(os.environ)
        env["PULSAR_MEM"] = _MEM[member.role]
        env["PULSAR_LOG_DIR"] = str(self.data_dir / "logs")
        env["PULSAR_GC"] = "-XX:+UseSerialGC"
        env[
            {
                "zookeeper": "PULSAR_ZK_CONF",
                "bookie": "PULSAR_BOOKKEEPER_CONF",
                "broker": "PULSAR_BROKER_CONF",
            }[member.role]
        ] = str(member.conf)
        return env

    def start_member(self, member: Member) -> None:
        """Start (or start again) one member; returns once its process runs."""
        log = open(self.data_dir / f"{member.name}.log", "ab")  # noqa: SIM115 - the child's
        member.proc = subprocess.Popen(
            [str(self.home / "bin" / "pulsar"), member.role],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self._env(member),
            start_new_session=True,
        )
        log.close()
        watch_group(member.proc.pid)  # killed with the process that started it, also a crashed one

    def kill(self, member: Member) -> None:
        """SIGKILL a member (a crash)."""
        if member.alive():
            assert member.proc is not None
            os.killpg(member.proc.pid, signal.SIGKILL)
            member.proc.wait(30)

    def restore(self, timeout_s: float = 120.0) -> None:
        """Start again every member that is not running; wait until the brokers serve."""
        deadline = time.monotonic() + timeout_s
        down = [m for m in [self.zookeeper, *self.bookies, *self.brokers] if not m.alive()]
        for member in down:
            self.start_member(member)
        for member in down:
            self.wait_member(member, max(1.0, deadline - time.monotonic()))

    def tail(self, member: Member, lines: int = 30) -> str:
        try:
            text = (self.data_dir / f"{member.name}.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def start(self, timeout_s: float = 300.0) -> None:
        """Start every member and wait until each broker serves ``public/default``.

        Raises:
            RuntimeError: A member exited or the cluster was not ready in time (logs included).
        """
        deadline = time.monotonic() + timeout_s
        self.start_member(self.zookeeper)
        self._wait_port(self.zookeeper, self.zookeeper.ports["client"], deadline)
        init = subprocess.run(
            [
                str(self.home / "bin" / "pulsar"),
                "initialize-cluster-metadata",
                "--cluster",
                "test",
                "--metadata-store",
                f"zk:{self.zk_url}",
                "--configuration-metadata-store",
                f"zk:{self.zk_url}",
                "--web-service-url",
                self.admin_url,
                "--broker-service-url",
                self.service_url,
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "PULSAR_MEM": "-Xmx256m", "PULSAR_LOG_DIR": str(self.data_dir / "logs")},
            timeout=max(10.0, deadline - time.monotonic()),
            check=False,
        )
        if init.returncode != 0:
            raise RuntimeError(
                f"initialize-cluster-metadata failed:\n{init.stdout[-3000:]}\n{init.stderr[-3000:]}"
            )
        for bookie in self.bookies:
            self.start_member(bookie)
        for bookie in self.bookies:
            self._wait_port(bookie, bookie.ports["bookie"], deadline)
        for broker in self.brokers:
            self.start_member(broker)
        for broker in self.brokers:
            self.wait_broker(broker, deadline)

    def wait_member(self, member: Member, timeout_s: float) -> None:
        """Wait until a (re)started member serves: a broker its health check, ZooKeeper its
        port, a bookie its port and then every running broker's health check (a write and a
        read through the bookies). Raises RuntimeError with the end of its log if it exits or
        is late."""
        deadline = time.monotonic() + timeout_s
        if member in self.brokers:
            self.wait_broker(member, deadline)
        elif member in self.bookies:
            self._wait_port(member, member.ports["bookie"], deadline)
            for broker in self.brokers:
                if broker.alive():
                    self.wait_broker(broker, deadline)
        else:
            self._wait_port(member, member.ports["client"], deadline)

    def _wait_port(self, member: Member, port: int, deadline: float) -> None:
        import socket

        while time.monotonic() < deadline:
            if not member.alive():
                raise RuntimeError(f"{member.name} exited:\n{self.tail(member)}")
            with socket.socket() as s:
                s.settimeout(0.5)
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.3)
        raise RuntimeError(f"{member.name} did not listen on {port} in time:\n{self.tail(member)}")

    def wait_broker(self, broker: Member, deadline: float) -> None:
        """Wait until ``broker`` answers its health check and knows ``public/default``."""
        web = f"http://127.0.0.1:{broker.ports['web']}"
        while time.monotonic() < deadline:
            if not broker.alive():
                raise RuntimeError(f"{broker.name} exited:\n{self.tail(broker)}")
            try:
                for path in ("/admin/v2/brokers/health", "/admin/v2/namespaces/public/default"):
                    with urllib.request.urlopen(self._request(web + path), timeout=2) as resp:
                        resp.read()
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"{broker.name} not ready in time:\n{self.tail(broker)}")

    def admin(self, method: str, path: str, body: object = None, timeout_s: float = 10.0) -> object:
        """Call the admin REST API of the first live broker; the decoded JSON answer."""
        broker = next(b for b in self.brokers if b.alive())
        data = None if body is None else json.dumps(body).encode()
        req = self._request(f"http://127.0.0.1:{broker.ports['web']}{path}", data=data, method=method)
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            answer = resp.read()
        return json.loads(answer) if answer else None

    def _request(self, url: str, data: bytes | None = None, method: str = "GET") -> urllib.request.Request:
        req = urllib.request.Request(url, data=data, method=method)
        if self._secret is not None:
            req.add_header("Authorization", f"Bearer {self.token('admin')}")
        return req

    def owner(self, topic: str) -> Member:
        """The broker that serves ``topic`` now (``persistent://tenant/ns/name``)."""
        path = "/lookup/v2/topic/" + topic.replace("://", "/")
        found = self.admin("GET", path)
        url = str(found["brokerUrl"])  # type: ignore[index]
        return next(b for b in self.brokers if url.endswith(f":{b.ports['service']}"))

    def stop(self) -> None:
        """Stop brokers, then bookies, then ZooKeeper (SIGTERM, SIGKILL after 20 s)."""
        for member in [*self.brokers, *self.bookies, self.zookeeper]:
            if member.alive():
                assert member.proc is not None
                os.killpg(member.proc.pid, signal.SIGTERM)
        for member in [*self.brokers, *self.bookies, self.zookeeper]:
            if member.proc is not None and member.proc.poll() is None:
                try:
                    member.proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(member.proc.pid, signal.SIGKILL)
                    member.proc.wait(10)

    def cleanup(self) -> None:
        """Kill every member and delete the data directory if this cluster made it (nothing
        of it is kept, so nothing needs a clean shutdown); keeps it, stopped cleanly, otherwise."""
        if not self._own_dir:
            self.stop()
            return
        for member in [*self.brokers, *self.bookies, self.zookeeper]:
            self.kill(member)
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> PulsarCluster:
        try:
            self.start()
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
