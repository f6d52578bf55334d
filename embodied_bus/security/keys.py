"""Ed25519 keys: generate, save (private key file mode 0600), load, fingerprint."""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from embodied_bus.errors import BusConfigError

__all__ = [
    "KeyFileError",
    "generate_private_key",
    "key_id",
    "load_private_key",
    "load_public_key",
    "public_key_b64",
    "save_private_key",
]


class KeyFileError(BusConfigError):
    """A key file or key string cannot be used; the message says which and why."""


def generate_private_key() -> Ed25519PrivateKey:
    """A fresh Ed25519 private key."""
    return Ed25519PrivateKey.generate()


def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def public_key_b64(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """The raw 32-byte public key, base64 (what allow-lists hold)."""
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return base64.b64encode(_raw_public(pub)).decode()


def key_id(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    """Fingerprint: the first 16 hex digits of SHA-256 of the raw public key."""
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return hashlib.sha256(_raw_public(pub)).hexdigest()[:16]


def load_public_key(b64: str) -> Ed25519PublicKey:
    """A public key from its base64 raw form.

    Raises:
        KeyFileError: Not base64 of 32 bytes.
    """
    try:
        raw = base64.b64decode(b64, validate=True)
        return Ed25519PublicKey.from_public_bytes(raw)
    except (ValueError, TypeError) as err:
        raise KeyFileError(
            f"public key {b64[:12]!r}...: not base64 of a 32-byte Ed25519 key ({err})"
        ) from None


def save_private_key(key: Ed25519PrivateKey, path: str | Path) -> Path:
    """Write a PKCS#8 PEM private key readable by its owner only (0600); refuses to overwrite."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise KeyFileError(f"{p} exists; refusing to overwrite a private key (use 'keys rotate')") from None
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return p


def load_private_key(path: str | Path) -> Ed25519PrivateKey:
    """Load a PEM private key written by :func:`save_private_key`.

    Raises:
        KeyFileError: Unreadable, not PEM, or not Ed25519.
    """
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except OSError as err:
        raise KeyFileError(f"cannot read private key {str(path)!r}: {err}") from err
    except (ValueError, TypeError, UnsupportedAlgorithm) as err:
        raise KeyFileError(f"{str(path)!r} is not a PEM private key: {err}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{str(path)!r} is not an Ed25519 key")
    return key
