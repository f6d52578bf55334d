"""Who may do what on the action queue: signed, replay-proof actions (Ed25519), sealed queue
messages between known parties, and the key allow-list they are checked against.

Planners sign each action (:class:`Signer`); executors verify it against the allow-list
(:class:`Verifier`) and reject unsigned, forged, tampered, expired, replayed or not-allowed
actions before any handler runs. Planners, executors and the queue service also seal the queue
messages they send (:class:`Sealer`), and refuse those not sealed by a key whose role allows
them (:class:`Trust`). A :class:`WatchedAllowList` is re-read while the processes run.
"""

from embodied_bus.security.allowlist import (
    RELOAD_S,
    AllowedKey,
    AllowList,
    Role,
    WatchedAllowList,
    load_allow_list,
    public_entry,
    save_allow_list,
)
from embodied_bus.security.keys import (
    KeyFileError,
    generate_private_key,
    key_id,
    load_private_key,
    load_public_key,
    public_key_b64,
    save_private_key,
)
from embodied_bus.security.seal import Refused, Sealer, Trust
from embodied_bus.security.signing import (
    ANY_AUDIENCE,
    DEFAULT_MAX_TTL_S,
    DEFAULT_TTL_S,
    ActionRejected,
    RejectReason,
    SecurityError,
    Signer,
    Verifier,
    signed_bytes,
)

__all__ = [
    "ANY_AUDIENCE",
    "DEFAULT_MAX_TTL_S",
    "DEFAULT_TTL_S",
    "RELOAD_S",
    "ActionRejected",
    "AllowList",
    "AllowedKey",
    "KeyFileError",
    "Refused",
    "RejectReason",
    "Role",
    "Sealer",
    "SecurityError",
    "Signer",
    "Trust",
    "Verifier",
    "WatchedAllowList",
    "generate_private_key",
    "key_id",
    "load_allow_list",
    "load_private_key",
    "load_public_key",
    "public_entry",
    "public_key_b64",
    "save_allow_list",
    "save_private_key",
    "signed_bytes",
]
