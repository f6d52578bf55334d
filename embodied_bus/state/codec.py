"""Binary forms of state entries and of the state service's requests and replies.

A list of entries is columnar, so that a reader loads 100,000 keys in a few C calls:
``<count u32><key bytes u32>``, the keys (UTF-8, NUL between them), a flags byte each (1 = JSON,
2 = deleted), then ``stamp_ns`` (u64), ``revision`` (u64) and data length (u32) of each, then
the data back to back; little-endian. Pulsar carries one value per message
(:func:`encode_pulsar_value`): the key is the message key, and an empty message is a delete
(what the broker's compaction drops).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import accumulate, pairwise

from embodied_bus.errors import BusConfigError
from embodied_bus.state.model import StateEntry

__all__ = [
    "OP_PUT",
    "OP_SINCE",
    "Request",
    "decode_entries",
    "decode_pulsar_value",
    "decode_reply",
    "decode_request",
    "encode_entries",
    "encode_error",
    "encode_pulsar_value",
    "encode_reply",
    "encode_request",
]

_HEAD = struct.Struct("<II")
_JSON = 1
_DELETED = 2
_U64 = struct.Struct("<Q")
_VALUE = struct.Struct("<BQ")
_SWAP = sys.byteorder == "big"
#: Store entries (a put or a delete); the reply holds the revision of the first.
OP_PUT = 1
#: Read entries written after a revision (0: every live key); the reply holds the table's
#: revision then the entries.
OP_SINCE = 2
_OK = 0
_ERROR = 1


def _column(code: str, values: Iterable[int]) -> bytes:
    col = array(code, values)
    if _SWAP:
        col.byteswap()
    return col.tobytes()


def _read_column(code: str, data: bytes, offset: int, count: int) -> tuple[array[int], int]:
    col = array(code)
    end = offset + count * col.itemsize
    if end > len(data):
        raise BusConfigError("state entries end inside a column")
    col.frombytes(data[offset:end])
    if _SWAP:
        col.byteswap()
    return col, end


def encode_entries(entries: Iterable[StateEntry]) -> bytes:
    """Entries in the columnar form."""
    items = list(entries)
    keys = "\0".join(e.key for e in items).encode()
    flags = bytes((_JSON if e.is_json else 0) | (_DELETED if e.deleted else 0) for e in items)
    return b"".join(
        (
            _HEAD.pack(len(items), len(keys)),
            keys,
            flags,
            _column("Q", (e.stamp_ns for e in items)),
            _column("Q", (e.revision for e in items)),
            _column("I", (len(e.data) for e in items)),
            *(e.data for e in items),
        )
    )


def decode_entries(data: bytes, offset: int = 0) -> list[StateEntry]:
    """Entries of :func:`encode_entries` from ``offset``.

    Raises:
        BusConfigError: The bytes are not a list of entries.
    """
    if len(data) - offset < _HEAD.size:
        raise BusConfigError("state entries too short")
    count, keys_len = _HEAD.unpack_from(data, offset)
    offset += _HEAD.size
    try:
        keys = data[offset : offset + keys_len].decode().split("\0") if count else []
    except UnicodeDecodeError as err:
        raise BusConfigError("state keys in bad UTF-8") from err
    offset += keys_len
    flags = data[offset : offset + count]
    offset += count
    stamps, offset = _read_column("Q", data, offset, count)
    revisions, offset = _read_column("Q", data, offset, count)
    lengths, offset = _read_column("I", data, offset, count)
    if len(keys) != count or len(flags) != count or offset + sum(lengths) != len(data):
        raise BusConfigError("malformed state entries (counts and lengths disagree)")
    ends = list(accumulate(lengths, initial=offset))
    values = [data[a:b] for a, b in pairwise(ends)]
    return list(
        map(
            StateEntry,
            keys,
            values,
            [bool(f & _JSON) for f in flags],
            stamps,
            [bool(f & _DELETED) for f in flags],
            revisions,
        )
    )


@dataclass(frozen=True, slots=True)
class Request:
    """A request to the state service: ``op`` on ``table``; ``body`` is the entries of a put
    or the revision (u64) of a read."""

    op: int
    table: str
    body: bytes


def encode_request(op: int, table: str, body: bytes) -> bytes:
    name = table.encode()
    return bytes((op, len(name))) + name + body


def decode_request(data: bytes) -> Request:
    """Raises :class:`BusConfigError` on a malformed request."""
    if len(data) < 2 or len(data) < 2 + data[1]:
        raise BusConfigError("state request too short")
    name_end = 2 + data[1]
    try:
        table = data[2:name_end].decode()
    except UnicodeDecodeError as err:
        raise BusConfigError("state request names its table in bad UTF-8") from err
    return Request(data[0], table, data[name_end:])


def encode_reply(revision: int, body: bytes = b"") -> bytes:
    return bytes((_OK,)) + _U64.pack(revision) + body


def encode_error(message: str) -> bytes:
    return bytes((_ERROR,)) + message.encode()


def decode_reply(data: bytes) -> tuple[int, int]:
    """``(revision, offset of the body)`` of a reply.

    Raises:
        BusConfigError: The service answered with an error (its message), or garbage.
    """
    if data[:1] == bytes((_ERROR,)):
        raise BusConfigError(f"the state service refused: {data[1:].decode(errors='replace')}")
    if len(data) < 1 + _U64.size or data[0] != _OK:
        raise BusConfigError("malformed reply from the state service")
    return _U64.unpack_from(data, 1)[0], 1 + _U64.size


def encode_pulsar_value(entry: StateEntry) -> bytes:
    """A Pulsar message's data for ``entry`` (empty for a delete)."""
    if entry.deleted:
        return b""
    return _VALUE.pack(_JSON if entry.is_json else 0, entry.stamp_ns) + entry.data


def decode_pulsar_value(key: str, data: bytes) -> StateEntry:
    """The entry of a Pulsar message (empty data: a delete).

    Raises:
        BusConfigError: The data is not a state value.
    """
    if not data:
        return StateEntry(key, b"", deleted=True)
    if len(data) < _VALUE.size:
        raise BusConfigError(f"state value of {key!r} is too short ({len(data)} bytes)")
    flags, stamp_ns = _VALUE.unpack_from(data)
    return StateEntry(key, data[_VALUE.size :], bool(flags & _JSON), stamp_ns)
