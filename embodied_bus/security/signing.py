"""Signing and verifying actions.

A signed action carries ``auth = {"v": 1, "key": <key id>, "nonce": <32 hex>, "expires_ns": <UTC ns>,
"aud": <bus namespace or null>, "sig": <base64 Ed25519 signature>}``. The signature covers the
action's id, kind, payload, priority, deadline, idempotency key and selector, its session and
own retry policy where it has them, plus every ``auth`` field but ``sig`` (canonical JSON:
sorted keys, no spaces, ASCII), so changing any of them breaks it. The queue service is not
trusted: executors verify.

Rejections (:class:`RejectReason`): unsigned, malformed, unknown key, key expired (rotated out),
kind not allowed for the key, bad signature (forged or tampered), expired, expiry too far ahead,
wrong audience (an action signed for another robot), replayed (a nonce already used by another
action, or by this action after it completed).

Expiry is checked at every attempt, so the TTL bounds how long after signing an action may
start, retries included: choose it to cover the retry budget (default 60 s).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import enum
import json
import secrets
import sqlite3
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from embodied_bus.errors import EmbodiedBusError
from embodied_bus.security.allowlist import AllowList, WatchedAllowList
from embodied_bus.security.keys import key_id

__all__ = [
    "ANY_AUDIENCE",
    "DEFAULT_MAX_TTL_S",
    "DEFAULT_TTL_S",
    "ActionRejected",
    "RejectReason",
    "SecurityError",
    "Signable",
    "Signer",
    "Verifier",
    "signed_bytes",
]

#: ``Signer(audience=ANY_AUDIENCE)``: a signature every robot that allows the key accepts, where
#: the robot's verifier allows that (``Verifier(accept_any_audience=True)``).
ANY_AUDIENCE = "*"

#: Default lifetime of a signature, seconds.
DEFAULT_TTL_S = 60.0
#: Longest lifetime an executor accepts, seconds (a signature valid for a year is a standing order).
DEFAULT_MAX_TTL_S = 3600.0
#: Clock skew tolerated between planner and executor, seconds.
DEFAULT_CLOCK_SKEW_S = 5.0
_AUTH_KEYS = {"v", "key", "nonce", "expires_ns", "aud", "sig"}


class Signable(Protocol):
    """What a signature covers: the fields of an action (:class:`embodied_bus.actions.Action`)."""

    @property
    def id(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def payload(self) -> Any: ...
    @property
    def priority(self) -> int: ...
    @property
    def deadline_ns(self) -> int | None: ...
    @property
    def idempotency_key(self) -> str | None: ...
    @property
    def selector(self) -> Any: ...
    @property
    def auth(self) -> dict[str, Any] | None: ...


SignableT = TypeVar("SignableT", bound=Signable)


class SecurityError(EmbodiedBusError):
    """Root of the security errors."""


class RejectReason(str, enum.Enum):
    """Why an executor refused an action."""

    UNSIGNED = "unsigned"
    MALFORMED = "malformed"
    UNKNOWN_KEY = "unknown_key"
    KEY_EXPIRED = "key_expired"
    NOT_ALLOWED = "not_allowed"
    BAD_SIGNATURE = "bad_signature"
    EXPIRED = "expired"
    EXPIRY_TOO_FAR = "expiry_too_far"
    WRONG_AUDIENCE = "wrong_audience"
    REPLAYED = "replayed"


class ActionRejected(SecurityError):
    """An action failed verification; never executed."""

    def __init__(self, reason: RejectReason, message: str) -> None:
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason


def signed_bytes(action: Signable, auth: dict[str, Any]) -> bytes:
    """The canonical bytes a signature covers."""
    doc = {
        "id": action.id,
        "kind": action.kind,
        "payload": action.payload,
        "priority": action.priority,
        "deadline_ns": action.deadline_ns,
        "idempotency_key": action.idempotency_key,
        "selector": action.selector,
        "auth": {k: v for k, v in auth.items() if k != "sig"},
    }
    session = getattr(action, "session", None)
    if session is not None:  # a step's place in its session is signed too
        doc["session"] = session
    retry = getattr(action, "retry", None)
    if retry is not None:  # and an action's own retry policy
        doc["retry"] = dataclasses.asdict(retry)
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


@dataclass(frozen=True)
class Signer:
    """Signs actions for a planner.

    Args:
        private_key: The planner's Ed25519 key.
        ttl_s: Seconds a signature stays valid (retries included).
        audience: The bus namespace (robot) the actions are meant for. None: a
            :class:`~embodied_bus.actions.Planner` fills in its bus's namespace; :meth:`sign` on
            its own refuses. :data:`ANY_AUDIENCE` signs for every robot that allows the key, and
            only robots whose verifier accepts that run it.
    """

    private_key: Ed25519PrivateKey
    ttl_s: float = DEFAULT_TTL_S
    audience: str | None = None

    @property
    def key_id(self) -> str:
        """Fingerprint of the public key."""
        return key_id(self.private_key)

    def sign(self, action: SignableT, *, now_ns: int | None = None) -> SignableT:
        """A copy of ``action`` with a fresh nonce, an expiry and the signature."""
        if self.audience is None:
            raise SecurityError(
                "Signer has no audience: give audience=<the robot's bus namespace> (or ANY_AUDIENCE "
                "to sign for every robot that allows the key)"
            )
        now = time.time_ns() if now_ns is None else now_ns
        auth: dict[str, Any] = {
            "v": 1,
            "key": self.key_id,
            "nonce": secrets.token_hex(16),
            "expires_ns": now + int(self.ttl_s * 1e9),
            "aud": None if self.audience == ANY_AUDIENCE else self.audience,
        }
        sig = self.private_key.sign(signed_bytes(action, auth))
        auth["sig"] = base64.b64encode(sig).decode()
        return replace(action, auth=auth)  # type: ignore[type-var]


class _NonceStore:
    """Nonces seen, until their signature expires: in memory, or in SQLite to survive restarts."""

    def __init__(self, path: Path | None) -> None:
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path) if path else ":memory:", check_same_thread=False)
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS nonces (nonce TEXT PRIMARY KEY, action TEXT, expires_ns INTEGER, "
            "done INTEGER DEFAULT 0)"
        )
        self._db.commit()

    def check_and_record(self, nonce: str, action_id: str, expires_ns: int, now_ns: int) -> str | None:
        """Record the nonce; return why it is a replay, or None."""
        with self._lock:
            self._db.execute("DELETE FROM nonces WHERE expires_ns < ?", (now_ns,))
            row = self._db.execute("SELECT action, done FROM nonces WHERE nonce=?", (nonce,)).fetchone()
            if row is None:
                self._db.execute(
                    "INSERT INTO nonces (nonce, action, expires_ns) VALUES (?, ?, ?)",
                    (nonce, action_id, expires_ns),
                )
                self._db.commit()
                return None
            if row[0] != action_id:
                return f"nonce already used by action {row[0]}"
            if row[1]:
                return "this signed action already completed"
            return None

    def mark_done(self, nonce: str) -> None:
        with self._lock:
            self._db.execute("UPDATE nonces SET done=1 WHERE nonce=?", (nonce,))
            self._db.commit()


class Verifier:
    """Checks actions against an allow-list before an executor runs them.

    Args:
        allow: The allow-list (a :class:`WatchedAllowList` is re-read when its file changes).
        audience: This robot's bus namespace; actions signed for another audience are rejected,
            and so are those signed for any robot unless ``accept_any_audience``.
        accept_any_audience: Also run actions signed for every robot (``ANY_AUDIENCE``).
        nonce_db: SQLite file for seen nonces (None: in memory; replay protection then restarts
            with the process, bounded by the signatures' expiry).
        max_ttl_s: Reject signatures valid for longer than this.
        clock_skew_s: Tolerated clock difference between planner and executor.
    """

    def __init__(
        self,
        allow: AllowList | WatchedAllowList,
        *,
        audience: str | None = None,
        accept_any_audience: bool = False,
        nonce_db: str | Path | None = None,
        max_ttl_s: float = DEFAULT_MAX_TTL_S,
        clock_skew_s: float = DEFAULT_CLOCK_SKEW_S,
    ) -> None:
        self.allow = allow
        self.audience = audience
        self.accept_any_audience = accept_any_audience
        self.max_ttl_ns = int(max_ttl_s * 1e9)
        self.skew_ns = int(clock_skew_s * 1e9)
        self._nonces = _NonceStore(Path(nonce_db) if nonce_db else None)
        #: Rejections per reason.
        self.rejected: Counter[str] = Counter()
        #: Actions accepted.
        self.accepted = 0

    def _reject(self, reason: RejectReason, message: str) -> ActionRejected:
        self.rejected[reason.value] += 1
        return ActionRejected(reason, message)

    def verify(self, action: Signable, *, now_ns: int | None = None) -> str:
        """Return the signing key's name if ``action`` may run here.

        Raises:
            ActionRejected: With the reason; counted in :attr:`rejected`.
        """
        now = time.time_ns() if now_ns is None else now_ns
        auth = action.auth
        if auth is None:
            raise self._reject(
                RejectReason.UNSIGNED, f"action {action.id} of kind {action.kind!r} is not signed"
            )
        if (
            not isinstance(auth, dict)
            or set(auth) != _AUTH_KEYS
            or auth["v"] != 1
            or not isinstance(auth["key"], str)
            or not isinstance(auth["nonce"], str)
            or not 16 <= len(auth["nonce"]) <= 128
            or isinstance(auth["expires_ns"], bool)
            or not isinstance(auth["expires_ns"], int)
            or not isinstance(auth["sig"], str)
            or not (auth["aud"] is None or isinstance(auth["aud"], str))
        ):
            raise self._reject(
                RejectReason.MALFORMED, "auth must hold v=1, key, nonce, expires_ns, aud and sig"
            )
        found = self.allow.lookup(auth["key"])
        if found is None:
            raise self._reject(RejectReason.UNKNOWN_KEY, f"key {auth['key']} is not in the allow-list")
        entry, pub = found
        if not entry.valid_at(now):
            raise self._reject(RejectReason.KEY_EXPIRED, f"key {entry.name} ({auth['key']}) was rotated out")
        if not entry.allows(action.kind):
            raise self._reject(
                RejectReason.NOT_ALLOWED, f"key {entry.name} may not send {action.kind!r} actions"
            )
        try:
            sig = base64.b64decode(auth["sig"], validate=True)
            pub.verify(sig, signed_bytes(action, auth))
        except (InvalidSignature, binascii.Error, ValueError):
            raise self._reject(
                RejectReason.BAD_SIGNATURE, f"signature by {entry.name} does not match (forged or tampered)"
            ) from None
        if auth["expires_ns"] + self.skew_ns < now:
            age_s = (now - auth["expires_ns"]) / 1e9
            raise self._reject(RejectReason.EXPIRED, f"signature expired {age_s:.1f} s ago")
        if auth["expires_ns"] - now > self.max_ttl_ns + self.skew_ns:
            raise self._reject(
                RejectReason.EXPIRY_TOO_FAR, f"signature valid for more than {self.max_ttl_ns / 1e9:.0f} s"
            )
        if self.audience is not None and auth["aud"] != self.audience:
            if auth["aud"] is not None:
                raise self._reject(
                    RejectReason.WRONG_AUDIENCE, f"signed for {auth['aud']!r}, this is {self.audience!r}"
                )
            if not self.accept_any_audience:
                raise self._reject(
                    RejectReason.WRONG_AUDIENCE,
                    f"signed for every robot, and this one ({self.audience!r}) runs only actions "
                    "signed for it",
                )
        replay = self._nonces.check_and_record(
            auth["nonce"], action.id, auth["expires_ns"] + self.skew_ns, now
        )
        if replay is not None:
            raise self._reject(RejectReason.REPLAYED, replay)
        self.accepted += 1
        return entry.name

    def completed(self, action: Signable) -> None:
        """Remember that this signed action ran to completion (a later copy is a replay)."""
        if isinstance(action.auth, dict) and isinstance(action.auth.get("nonce"), str):
            self._nonces.mark_done(action.auth["nonce"])
