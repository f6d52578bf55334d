"""Sealed messages: who sent a queue message, checked before it is believed.

A sealed message is JSON ``{"by": <key id>, "t": <UTC ns>, "sig": <base64 Ed25519>, "m":
<the message>}``. The signature covers the channel it was sent on (a request, the reply to one
request, a push to one executor, the result of one action), the time and the message bytes, so
a sealed message cannot be moved to another channel, altered, or replayed after
:data:`WINDOW_S`. :class:`Trust` opens one only if its key is in the allow-list, not rotated out,
and holds a role the channel needs; on channels opened ``once`` (the queue's requests) a copy of
a message already opened is refused inside the window too. Every refusal is counted by reason.
"""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
import heapq
import threading
import time
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from embodied_bus.security.allowlist import AllowedKey, AllowList, Role, WatchedAllowList
from embodied_bus.security.keys import key_id
from embodied_bus.security.signing import SecurityError

__all__ = ["WINDOW_S", "Opened", "RefuseReason", "Refused", "Sealer", "Trust", "reply_channel"]

#: A sealed message older (or further ahead) than this is refused, seconds: the clocks of the
#: parties must agree within it.
WINDOW_S = 30.0


class RefuseReason(str, enum.Enum):
    """Why a sealed message was refused."""

    UNSEALED = "unsealed"
    UNKNOWN_KEY = "unknown_key"
    KEY_EXPIRED = "key_expired"
    WRONG_ROLE = "wrong_role"
    STALE = "stale"
    BAD_SIGNATURE = "bad_signature"
    NOT_ITS_OWN = "not_its_own"
    REPLAYED = "replayed"


class Refused(SecurityError):
    """A queue message that is not believed; never acted on."""

    def __init__(self, reason: RefuseReason, message: str) -> None:
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason


class _Sealed(msgspec.Struct):
    by: str
    t: int
    sig: str
    m: msgspec.Raw


_SEALED = msgspec.json.Decoder(_Sealed)


def _signed(channel: str, t: int, body: bytes) -> bytes:
    return b"%s\n%d\n%s" % (channel.encode(), t, body)


def reply_channel(request: bytes) -> str:
    """The channel of the reply to ``request`` (the sealed bytes): a reply to another request
    does not open as this one's."""
    return "reply/" + hashlib.sha256(request).hexdigest()[:32]


class Sealer:
    """Seals the messages one party sends.

    Args:
        private_key: The party's Ed25519 key (its public key is in the others' allow-lists).
    """

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        #: The key's id, as allow-lists name it.
        self.key_id = key_id(private_key)

    def seal(self, channel: str, body: bytes, *, now_ns: int | None = None) -> bytes:
        """``body`` sealed for ``channel``."""
        t = time.time_ns() if now_ns is None else now_ns
        sig = base64.b64encode(self._key.sign(_signed(channel, t, body)))
        return b'{"by":"%s","t":%d,"sig":"%s","m":%s}' % (self.key_id.encode(), t, sig, body)


@dataclass(frozen=True, slots=True)
class Opened:
    """A sealed message that was believed: what it says, and the allow-list entry of its sender."""

    body: bytes
    sender: AllowedKey


class Trust:
    """Which sealed messages to believe: those sealed by a key of the allow-list, with a role
    the channel needs, within :data:`WINDOW_S` of now.

    Args:
        allow: The allow-list (a :class:`WatchedAllowList` is re-read when its file changes).
        window_s: Largest age (or lead) of a sealed message, seconds.
    """

    def __init__(self, allow: AllowList | WatchedAllowList, *, window_s: float = WINDOW_S) -> None:
        self.allow = allow
        self.window_ns = int(window_s * 1e9)
        #: Refusals per reason.
        self.refused: Counter[str] = Counter()
        self._seen: set[bytes] = set()  # signatures of messages opened ``once``, within the window
        self._expiry: list[tuple[int, bytes]] = []  # (when a signature may be forgotten, it)
        self._seen_lock = threading.Lock()

    def refuse(self, reason: RefuseReason, message: str) -> Refused:
        """Count a refusal; the error to raise."""
        self.refused[reason.value] += 1
        return Refused(reason, message)

    def open(
        self,
        channel: str,
        data: bytes,
        roles: Collection[Role],
        *,
        now_ns: int | None = None,
        once: bool = False,
        not_before_ns: int = 0,
    ) -> Opened:
        """Open a message sealed for ``channel`` by a key with one of ``roles``; with ``once``,
        only the first copy of it, and none sealed before ``not_before_ns`` (when this party
        started: it cannot know which copies it saw before), are believed; the others are
        refused as replayed.

        Raises:
            Refused: With the reason; counted in :attr:`refused`.
        """
        try:
            sealed = _SEALED.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            raise self.refuse(RefuseReason.UNSEALED, f"a message on {channel} is not sealed") from None
        found = self.allow.lookup(sealed.by)
        if found is None:
            raise self.refuse(RefuseReason.UNKNOWN_KEY, f"key {sealed.by} is not in the allow-list")
        entry, pub = found
        now = time.time_ns() if now_ns is None else now_ns
        if not entry.valid_at(now):
            raise self.refuse(RefuseReason.KEY_EXPIRED, f"key {entry.name} was rotated out")
        if not entry.roles & set(roles):
            wanted = "/".join(sorted(r.value for r in roles))
            raise self.refuse(RefuseReason.WRONG_ROLE, f"key {entry.name} may not send {wanted} messages")
        if abs(now - sealed.t) > self.window_ns:
            raise self.refuse(
                RefuseReason.STALE, f"a message by {entry.name} is {abs(now - sealed.t) / 1e9:.0f} s off"
            )
        body = bytes(sealed.m)
        try:
            sig = base64.b64decode(sealed.sig, validate=True)
            pub.verify(sig, _signed(channel, sealed.t, body))
        except (InvalidSignature, binascii.Error, ValueError):
            raise self.refuse(
                RefuseReason.BAD_SIGNATURE, f"a message by {entry.name} on {channel} does not match its seal"
            ) from None
        if once and (sealed.t < not_before_ns or not self._first(sig, sealed.t, now)):
            raise self.refuse(RefuseReason.REPLAYED, f"a message by {entry.name} on {channel} came again")
        return Opened(body, entry)

    def _first(self, sig: bytes, t_ns: int, now_ns: int) -> bool:
        """Whether the message signed ``sig`` comes for the first time; remembered until it is
        stale anyway."""
        with self._seen_lock:
            while self._expiry and self._expiry[0][0] < now_ns:
                self._seen.discard(heapq.heappop(self._expiry)[1])
            if sig in self._seen:
                return False
            self._seen.add(sig)
            heapq.heappush(self._expiry, (t_ns + self.window_ns, sig))
            return True
