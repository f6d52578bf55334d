"""A throwaway certificate authority for tests: CA, server and client certificates (PEM files).

Used by the transport-security tests (Zenoh TLS / mutual TLS, Pulsar TLS); never for production
keys.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["Pki", "make_pki"]


@dataclass(frozen=True)
class Pki:
    """Paths of the generated PEM files."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path
    rogue_key: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path, *, pkcs8: bool = True) -> Path:
    fmt = serialization.PrivateFormat.PKCS8 if pkcs8 else serialization.PrivateFormat.TraditionalOpenSSL
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption()))
    path.chmod(0o600)
    return path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: str,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    server: bool = False,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        b = b.add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
    else:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        b = b.add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH] if server else [usage]
            ),
            critical=False,
        )
        sans: list[x509.GeneralName] = [
            x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        ]
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def make_pki(directory: str | Path) -> Pki:
    """A CA, a server certificate for ``localhost``/``127.0.0.1``, a client certificate from the
    same CA and a rogue client certificate from another CA."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ca_key, rogue_ca_key = _key(), _key()
    ca = _cert("embodied_bus test CA", ca_key, "embodied_bus test CA", ca_key, ca=True)
    srv_key, cli_key, rogue_key = _key(), _key(), _key()
    srv = _cert("localhost", srv_key, "embodied_bus test CA", ca_key, server=True)
    cli = _cert("planner", cli_key, "embodied_bus test CA", ca_key)
    rogue = _cert("planner", rogue_key, "rogue CA", rogue_ca_key)

    def pem(c: x509.Certificate, name: str) -> Path:
        p = d / name
        p.write_bytes(c.public_bytes(serialization.Encoding.PEM))
        return p

    return Pki(
        ca=pem(ca, "ca.pem"),
        server_cert=pem(srv, "server.pem"),
        server_key=_write_key(srv_key, d / "server.key"),
        client_cert=pem(cli, "client.pem"),
        client_key=_write_key(cli_key, d / "client.key"),
        rogue_cert=pem(rogue, "rogue.pem"),
        rogue_key=_write_key(rogue_key, d / "rogue.key"),
    )
