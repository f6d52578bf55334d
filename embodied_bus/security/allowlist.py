"""The allow-list: which keys may do what, read from a YAML file, and re-read while it changes.

Each key has roles: a ``planner`` signs actions of its ``kinds`` and sends queue requests; an
``executor`` takes, renews and reports actions, as the executor names in ``executors``; the
``queue`` (the Zenoh queue service) answers them, leases actions and publishes results::

    keys:
      ops-planner: {public_key: B64, roles: [planner], kinds: [navigate_to, dock]}
      arm-left:    {public_key: B64, roles: [executor], executors: [arm-left]}
      queue:       {public_key: B64, roles: [queue]}

An entry without ``roles`` is a planner (the only role of earlier allow-lists).
"""

from __future__ import annotations

import enum
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from embodied_bus.security.keys import KeyFileError, key_id, load_public_key, public_key_b64

__all__ = [
    "RELOAD_S",
    "AllowList",
    "AllowedKey",
    "Role",
    "WatchedAllowList",
    "load_allow_list",
    "public_entry",
    "save_allow_list",
]

#: A watched allow-list file is looked at again at most this often, seconds: a revoked or
#: rotated key stops being accepted within this long.
RELOAD_S = 1.0


class Role(str, enum.Enum):
    """What a key may do."""

    PLANNER = "planner"
    EXECUTOR = "executor"
    QUEUE = "queue"


@dataclass(frozen=True)
class AllowedKey:
    """One key in the allow-list.

    Attributes:
        name: A label (e.g. ``ops-planner``).
        public_key: Base64 raw Ed25519 public key.
        kinds: Action kinds it may sign (``*``: all); planners only.
        not_after_ns: The key stops being accepted at this UTC ns (set by rotation); 0 = never.
        roles: What it may do.
        executors: Executor names it may act as (executors only; empty: its own name).
    """

    name: str
    public_key: str
    kinds: frozenset[str] = frozenset()
    not_after_ns: int = 0
    roles: frozenset[Role] = frozenset({Role.PLANNER})
    executors: frozenset[str] = frozenset()

    @property
    def key_id(self) -> str:
        """Fingerprint of the public key."""
        return key_id(load_public_key(self.public_key))

    def allows(self, kind: str) -> bool:
        """True if this key may sign actions of ``kind``."""
        return Role.PLANNER in self.roles and ("*" in self.kinds or kind in self.kinds)

    def acts_as(self, executor: str) -> bool:
        """True if this key may act as the executor named ``executor``."""
        return Role.EXECUTOR in self.roles and executor in (self.executors or {self.name})

    def valid_at(self, now_ns: int) -> bool:
        """Not rotated out at ``now_ns``."""
        return not self.not_after_ns or now_ns <= self.not_after_ns


@dataclass
class AllowList:
    """The keys and what each may do."""

    keys: list[AllowedKey] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._by_id: dict[str, tuple[AllowedKey, Ed25519PublicKey]] = {}
        for k in self.keys:
            pub = load_public_key(k.public_key)
            self._by_id[key_id(pub)] = (k, pub)

    def lookup(self, kid: str) -> tuple[AllowedKey, Ed25519PublicKey] | None:
        """The entry and public key for a key id, if listed."""
        return self._by_id.get(kid)

    def add(self, entry: AllowedKey) -> AllowList:
        """A new list with ``entry`` added (an entry with the same public key is replaced)."""
        keys = [k for k in self.keys if k.public_key != entry.public_key]
        return AllowList([*keys, entry])

    def current(self) -> AllowList:
        """This list (a :class:`WatchedAllowList` answers with what its file holds now)."""
        return self


def _str_list(path: object, name: str, key: str, value: object) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise KeyFileError(f"{path}: keys.{name}.{key}: expected a list of strings")
    return value


def _entry(path: object, name: str, entry: object) -> AllowedKey:
    if not isinstance(entry, dict) or not isinstance(entry.get("public_key"), str):
        raise KeyFileError(f"{path}: keys.{name}.public_key: expected a base64 string")
    try:
        roles = frozenset(Role(r) for r in _str_list(path, name, "roles", entry.get("roles", ["planner"])))
    except ValueError:
        raise KeyFileError(
            f"{path}: keys.{name}.roles: each must be one of {[r.value for r in Role]}"
        ) from None
    if not roles:
        raise KeyFileError(f"{path}: keys.{name}.roles: give at least one role")
    kinds = _str_list(path, name, "kinds", entry.get("kinds", []))
    if Role.PLANNER in roles and not kinds:
        raise KeyFileError(f"{path}: keys.{name}.kinds: expected a non-empty list of action kinds (or '*')")
    not_after = entry.get("not_after_ns", 0)
    if isinstance(not_after, bool) or not isinstance(not_after, int) or not_after < 0:
        raise KeyFileError(f"{path}: keys.{name}.not_after_ns: expected UTC nanoseconds >= 0")
    executors = _str_list(path, name, "executors", entry.get("executors", []))
    load_public_key(entry["public_key"])
    return AllowedKey(
        str(name), entry["public_key"], frozenset(kinds), not_after, roles, frozenset(executors)
    )


def load_allow_list(path: str | Path) -> AllowList:
    """Load ``keys: {name: {public_key, roles, kinds, executors, not_after_ns}}`` from YAML.

    Raises:
        KeyFileError: Unreadable file, bad YAML, or an invalid entry (named).
    """
    try:
        doc = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as err:
        raise KeyFileError(f"cannot read allow-list {str(path)!r}: {err}") from err
    except yaml.YAMLError as err:
        raise KeyFileError(f"allow-list {str(path)!r} is not valid YAML: {err}") from err
    keys = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(keys, dict):
        raise KeyFileError(f"{path}: expected a 'keys:' mapping of name to {{public_key, roles, ...}}")
    return AllowList([_entry(path, str(name), entry) for name, entry in keys.items()])


def save_allow_list(allow: AllowList, path: str | Path) -> None:
    """Write an allow-list as YAML (atomically: a watcher never reads half a file)."""
    doc = {
        "keys": {
            k.name: {
                "public_key": k.public_key,
                "key_id": k.key_id,
                "roles": sorted(r.value for r in k.roles),
                **({"kinds": sorted(k.kinds)} if k.kinds else {}),
                **({"executors": sorted(k.executors)} if k.executors else {}),
                **({"not_after_ns": k.not_after_ns} if k.not_after_ns else {}),
            }
            for k in allow.keys
        }
    }
    p = Path(path)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text("# embodied_bus allow-list: which keys may do what\n" + yaml.safe_dump(doc))
    tmp.replace(p)


class WatchedAllowList:
    """An allow-list file read again whenever it changed (looked at at most every
    :data:`RELOAD_S`): ``keys revoke`` and ``keys rotate`` reach running processes. A file that
    became unreadable or invalid keeps the last good list (and says why, once).

    Args:
        path: The YAML file.
        reload_s: Longest time between two looks at the file, seconds.
    """

    def __init__(self, path: str | Path, *, reload_s: float = RELOAD_S) -> None:
        self.path = Path(path)
        self.reload_s = reload_s
        self._lock = threading.Lock()
        self._stamp = self._file_stamp()
        self._list = load_allow_list(self.path)
        self._checked = time.monotonic()
        #: Times the file was read again because it changed.
        self.reloads = 0
        #: Why the last change could not be read (None: it could).
        self.error: str | None = None

    @property
    def keys(self) -> list[AllowedKey]:
        return self.current().keys

    def _file_stamp(self) -> tuple[int, int, int]:
        try:
            st = os.stat(self.path)
        except OSError:
            return (0, 0, 0)
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def current(self) -> AllowList:
        """The list as the file holds it now (re-read if it changed)."""
        now = time.monotonic()
        if now - self._checked < self.reload_s:
            return self._list
        with self._lock:
            self._checked = now
            stamp = self._file_stamp()
            if stamp != self._stamp:
                self._stamp = stamp
                try:
                    self._list = load_allow_list(self.path)
                    self.reloads += 1
                    self.error = None
                except KeyFileError as err:
                    self.error = str(err)
            return self._list

    def lookup(self, kid: str) -> tuple[AllowedKey, Ed25519PublicKey] | None:
        """The entry and public key for a key id in the current list."""
        return self.current().lookup(kid)


def public_entry(
    name: str,
    key: Ed25519PrivateKey | Ed25519PublicKey,
    kinds: list[str] | None = None,
    *,
    roles: tuple[Role, ...] = (Role.PLANNER,),
    executors: tuple[str, ...] = (),
) -> AllowedKey:
    """An allow-list entry for a key."""
    return AllowedKey(
        name, public_key_b64(key), frozenset(kinds or []), 0, frozenset(roles), frozenset(executors)
    )
