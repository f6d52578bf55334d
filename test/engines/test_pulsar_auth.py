"""Apache Pulsar with TLS and token authentication: a second standalone broker started by this
module with authentication and authorization on, certificates and tokens generated here."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from embodied_bus import open_bus
from embodied_bus.errors import BusConnectionError
from embodied_bus.testing.certs import Pki, make_pki
from embodied_bus.testing.ports import free_port
from embodied_bus.testing.pulsar import PulsarStandalone, hs256_token


class Secured:
    def __init__(self, broker: PulsarStandalone, tls_port: int, pki: Pki, secret: bytes, tmp: Path) -> None:
        self.broker, self.tls_port, self.pki, self.secret, self.tmp = broker, tls_port, pki, secret, tmp

    def token_file(self, role: str, secret: bytes | None = None) -> Path:
        p = self.tmp / f"{role}-{secrets.token_hex(4)}.token"
        p.write_text(hs256_token(secret or self.secret, role))
        return p

    def tls_url(self, query: str) -> str:
        return f"pulsar+ssl://localhost:{self.tls_port}?{query}&timeout=5"


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    if os.environ.get("EMBODIED_BUS_SKIP_PULSAR_AUTH"):
        pytest.skip("EMBODIED_BUS_SKIP_PULSAR_AUTH is set")
    tmp = tmp_path_factory.mktemp("pulsar-auth")
    pki = make_pki(tmp / "pki")
    secret = secrets.token_bytes(32)
    (tmp / "secret.key").write_bytes(secret)
    admin = hs256_token(secret, "admin")
    tls_port = free_port()
    broker = PulsarStandalone(
        tmp / "data",
        admin_token=admin,
        extra_conf={
            "authenticationEnabled": "true",
            "authenticationProviders": "org.apache.pulsar.broker.authentication.AuthenticationProviderToken",
            "tokenSecretKey": f"file://{tmp / 'secret.key'}",
            "authorizationEnabled": "true",
            "superUserRoles": "admin",
            "brokerClientAuthenticationPlugin": "org.apache.pulsar.client.impl.auth.AuthenticationToken",
            "brokerClientAuthenticationParameters": f"token:{admin}",
            "brokerServicePortTls": str(tls_port),
            "tlsCertificateFilePath": str(pki.server_cert),
            "tlsKeyFilePath": str(pki.server_key),
            "tlsTrustCertsFilePath": str(pki.ca),
        },
    )
    broker.start()
    try:
        yield Secured(broker, tls_port, pki, secret, tmp)
    finally:
        broker.stop()


async def test_a_client_with_tls_and_a_valid_token_streams_samples(secured: Secured) -> None:
    url = secured.tls_url(f"tls_ca={secured.pki.ca}&token_file={secured.token_file('admin')}")
    async with open_bus(url, namespace="secure") as a, open_bus(url, namespace="secure") as b:
        pub = await a.publisher("lidar")
        sub = await b.subscribe("lidar")
        await pub.publish(b"scan over tls", stamp_ns=1)
        assert bytes((await sub.recv(timeout_s=20)).payload) == b"scan over tls"


@pytest.mark.parametrize(
    "credentials",
    ["no token", "forged token", "untrusted broker certificate", "plaintext port"],
)
async def test_clients_without_valid_credentials_are_refused(secured: Secured, credentials: str) -> None:
    good_token = secured.token_file("admin")
    url = {
        "no token": secured.tls_url(f"tls_ca={secured.pki.ca}"),
        "forged token": secured.tls_url(
            f"tls_ca={secured.pki.ca}&token_file={secured.token_file('admin', secrets.token_bytes(32))}"
        ),
        "untrusted broker certificate": secured.tls_url(
            f"tls_ca={secured.pki.rogue_cert}&token_file={good_token}"
        ),
        "plaintext port": f"pulsar://127.0.0.1:{secured.broker.broker_port}?timeout=5",
    }[credentials]
    with pytest.raises(BusConnectionError):
        async with open_bus(url, namespace="secure") as bus:
            pub = await bus.publisher("lidar")  # authorization is checked here at the latest
            await pub.publish(b"x", stamp_ns=1)


async def test_a_role_without_permissions_cannot_publish(secured: Secured) -> None:
    url = secured.tls_url(f"tls_ca={secured.pki.ca}&token_file={secured.token_file('visitor')}")
    with pytest.raises(BusConnectionError):
        async with open_bus(url, namespace="secure") as bus:
            await bus.publisher("lidar")
