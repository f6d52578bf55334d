"""Signed, replay-proof actions (Ed25519) and the key allow-list.

Planners sign each action with a private key (:class:`Signer`); executors verify it against an
allow-list of public keys per action kind (:class:`Verifier`, :class:`AllowList`) and reject
unsigned, forged, tampered, expired, replayed or not-allowed actions before any handler runs.
"""

from embodied_bus.security.keys import (
    KeyFileError,
    generate_private_key,
    key_id,
    load_private_key,
    load_public_key,
    public_key_b64,
    save_private_key,
)
from embodied_bus.security.signing import (
    DEFAULT_MAX_TTL_S,
    DEFAULT_TTL_S,
    ActionRejected,
    AllowedKey,
    AllowList,
    RejectReason,
    SecurityError,
    Signer,
    Verifier,
    load_allow_list,
    save_allow_list,
    signed_bytes,
)

__all__ = [
    "DEFAULT_MAX_TTL_S",
    "DEFAULT_TTL_S",
    "ActionRejected",
    "AllowList",
    "AllowedKey",
    "KeyFileError",
    "RejectReason",
    "SecurityError",
    "Signer",
    "Verifier",
    "generate_private_key",
    "key_id",
    "load_allow_list",
    "load_private_key",
    "load_public_key",
    "public_key_b64",
    "save_allow_list",
    "save_private_key",
    "signed_bytes",
]
