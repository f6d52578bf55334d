"""What a state table holds: one :class:`StateEntry` per key, the latest written."""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

from embodied_bus.errors import BusConfigError

__all__ = ["MAX_KEY_BYTES", "StateEntry", "encode_value", "validate_key", "validate_table"]

#: Longest key, in UTF-8 bytes.
MAX_KEY_BYTES = 1024
_TABLE_RE = re.compile(r"[A-Za-z0-9_\-]{1,64}")


def validate_table(name: str) -> str:
    """Return ``name`` if it can name a table (letters, digits, ``_``, ``-``; 1 to 64).

    Raises:
        BusConfigError: It cannot.
    """
    if not isinstance(name, str) or not _TABLE_RE.fullmatch(name):
        raise BusConfigError(f"invalid state table name {name!r}: use 1 to 64 letters, digits, '_' or '-'")
    return name


def validate_key(key: str) -> str:
    """Return ``key`` if it can be a key (a non-empty string of at most
    :data:`MAX_KEY_BYTES` UTF-8 bytes, without NUL).

    Raises:
        BusConfigError: It cannot.
    """
    if not isinstance(key, str) or not key or "\0" in key:
        raise BusConfigError(f"a state key must be a non-empty string without NUL, got {key!r}")
    if len(key.encode()) > MAX_KEY_BYTES:
        raise BusConfigError(f"state key {key[:40]!r}... is over {MAX_KEY_BYTES} bytes")
    return key


def encode_value(value: Any) -> tuple[bytes, bool]:
    """``(data, is_json)`` of a value: ``bytes`` as they are, anything else as JSON.

    Raises:
        BusConfigError: The value is neither bytes nor JSON-serialisable.
    """
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value), False
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False).encode(), True
    except (TypeError, ValueError) as err:
        raise BusConfigError(f"a state value must be bytes or JSON-serialisable: {err}") from err


class StateEntry(NamedTuple):
    """The value of one key as a put (or a delete) left it.

    Attributes:
        key: The key.
        data: The value's bytes (JSON text when ``is_json``); empty for a delete.
        is_json: Whether ``data`` is JSON (the value was not ``bytes``).
        stamp_ns: When it was written, ns since the epoch (the writer's clock).
        deleted: A delete (a tombstone): the key has no value now.
        revision: Order of the write in its table (1, 2, ...) where the store numbers writes
            (the Zenoh state service); 0 where it does not (Pulsar: topic order decides).
    """

    key: str
    data: bytes
    is_json: bool = False
    stamp_ns: int = 0
    deleted: bool = False
    revision: int = 0

    @property
    def value(self) -> Any:
        """The value: decoded JSON, or the bytes (None for a delete)."""
        if self.deleted:
            return None
        return json.loads(self.data) if self.is_json else self.data

    def to_json(self) -> dict[str, Any]:
        """A JSON-able document (bytes values as ``{"bytes_hex": ...}``)."""
        value = self.value
        return {
            "key": self.key,
            "value": {"bytes_hex": value.hex()} if isinstance(value, bytes) else value,
            "stamp_ns": self.stamp_ns,
            "deleted": self.deleted,
        }
