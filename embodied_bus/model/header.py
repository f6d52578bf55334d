"""The binary header of a sample: one fixed little-endian struct, then three UTF-8 strings.

The layout is documented in ``docs/wire-format.md``; change both together and bump
:data:`WIRE_VERSION` on any incompatible change.
"""

from __future__ import annotations

import enum
import logging
import re
import struct
from collections.abc import Iterator
from typing import Any, ClassVar

import msgspec

from embodied_bus.errors import HeaderError

_log = logging.getLogger("embodied_bus.wire")

__all__ = [
    "HEADER_STRUCT",
    "MAX_NAME_BYTES",
    "WIRE_MAGIC",
    "WIRE_VERSION",
    "Header",
    "HeaderFlags",
    "HeaderPacker",
    "Modality",
    "decode_header",
    "encode_header",
    "encode_strings",
    "validate_stream_name",
    "with_header_flags",
]


#: Two magic bytes that open every binary header.
WIRE_MAGIC = b"EB"
#: Version of the header layout; receivers reject versions they do not know.
WIRE_VERSION = 1
#: Longest stream name, encoding or frame_id in UTF-8 bytes.
MAX_NAME_BYTES = 1024

#: magic, version, flags, modality, reserved, seq, stamp_ns, bucket, width_ns, offset_ns,
#: publisher_id, publish_ns, len(stream), len(encoding), len(frame_id)
HEADER_STRUCT = struct.Struct("<2sBBBxQqqQqQqHHH")

STREAM_NAME_RE = re.compile(r"^[A-Za-z0-9_\-]+(/[A-Za-z0-9_\-]+)*$")
#: Stream names that would map onto the action queue's own Pulsar topics (``actions.state``,
#: ``actions.dlq``, ``actions.q<P>.<kind>``): reserved on every engine, so that code moves
#: between engines unchanged.
RESERVED_STREAM_RE = re.compile(r"^actions/(state|dlq|q[0-9]/.+)$")


class Modality(enum.IntEnum):
    """What kind of sensor (or derived data) a stream carries."""

    OTHER = 0
    LIDAR = 1
    CAMERA = 2
    GPS = 3
    IMU = 4
    RADAR = 5
    LASER_SCAN = 6
    ODOMETRY = 7
    FRAME = 8

    @classmethod
    def parse(cls, value: str | int | Modality) -> Modality:
        """Parse a modality from its name (case-insensitive) or number."""
        if isinstance(value, Modality):
            return value
        try:
            if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
                return cls(int(value))
            return cls[str(value).upper()]
        except (KeyError, ValueError) as err:
            names = ", ".join(m.name.lower() for m in cls)
            raise HeaderError(f"unknown modality {value!r}; expected one of {names}") from err


MODALITY_NAMES = {m: m.name.lower() for m in Modality}
MODALITY_BY_NAME = {m.name.lower(): m for m in Modality}


class HeaderFlags(enum.IntFlag):
    """Bit flags carried in the header."""

    NONE = 0
    #: The sensor stamp was zero; ``stamp_ns`` is the publisher's receive/log time instead.
    STAMP_FALLBACK = 1
    #: The payload travelled through Zenoh shared memory.
    SHM = 2


class Header(msgspec.Struct, frozen=True, gc=False, order=True):
    """Everything a sample carries besides its payload. Construct it by keyword (twelve fields
    are too many to get right by position); positions stay for C-level bulk construction.

    An immutable ``msgspec.Struct`` built in C that the garbage collector does not track (it
    holds only strings, ints and enum members): a subscriber builds one per sample, and tracking
    each for as long as it lives costs small-sample streams throughput. It keeps the named
    tuple's conveniences: unpacking and indexing in field order, ``len``, ``_fields``,
    ``_replace`` and ``_asdict``; it is hashable and orders like a tuple of its fields, but
    never equals a plain tuple.

    Attributes:
        stream: Stream name, segments of ``[A-Za-z0-9_-]`` separated by ``/``.
        modality: Sensor kind.
        seq: Per-publisher sequence number, starting at 1.
        stamp_ns: Sensor stamp in UTC nanoseconds.
        bucket: Time-bucket id, ``(stamp_ns - bucket_offset_ns) // bucket_width_ns``.
        bucket_width_ns: Bucket width in nanoseconds.
        bucket_offset_ns: Bucket phase offset in nanoseconds.
        encoding: Payload encoding, e.g. ``cdr:sensor_msgs/msg/PointCloud2``, ``npy``, ``raw``.
        frame_id: Coordinate frame of the data (may be empty).
        publisher_id: Random 64-bit id of the publishing endpoint (scopes ``seq``).
        publish_ns: Wall-clock time at publish, UTC nanoseconds (for latency).
        flags: :class:`HeaderFlags`.
    """

    stream: str
    modality: Modality
    seq: int
    stamp_ns: int
    bucket: int
    bucket_width_ns: int
    bucket_offset_ns: int
    encoding: str
    frame_id: str
    publisher_id: int
    publish_ns: int
    flags: HeaderFlags = HeaderFlags.NONE

    #: Field names in order (as a named tuple has them).
    _fields: ClassVar[tuple[str, ...]] = (
        "stream",
        "modality",
        "seq",
        "stamp_ns",
        "bucket",
        "bucket_width_ns",
        "bucket_offset_ns",
        "encoding",
        "frame_id",
        "publisher_id",
        "publish_ns",
        "flags",
    )

    @property
    def bucket_start_ns(self) -> int:
        """First nanosecond of this sample's bucket."""
        return self.bucket * self.bucket_width_ns + self.bucket_offset_ns

    def __iter__(self) -> Iterator[Any]:
        return iter(msgspec.structs.astuple(self))

    def __len__(self) -> int:
        return len(self._fields)

    def __getitem__(self, index: int | slice) -> Any:
        return msgspec.structs.astuple(self)[index]

    def _replace(self, **changes: Any) -> Header:
        """A copy with these fields changed (as ``namedtuple._replace``)."""
        return msgspec.structs.replace(self, **changes)

    def _asdict(self) -> dict[str, Any]:
        """The fields by name, in order (as ``namedtuple._asdict``)."""
        return msgspec.structs.asdict(self)


def validate_stream_name(stream: str) -> str:
    """Return ``stream`` if it is a valid stream name, else raise :class:`HeaderError`."""
    if not isinstance(stream, str) or not STREAM_NAME_RE.match(stream):
        raise HeaderError(
            f"invalid stream name {stream!r}: use segments of letters, digits, '_' or '-' separated by '/'"
        )
    if len(stream.encode()) > MAX_NAME_BYTES:
        raise HeaderError(f"stream name longer than {MAX_NAME_BYTES} bytes")
    if RESERVED_STREAM_RE.match(stream):
        raise HeaderError(
            f"stream name {stream!r} is reserved: actions/state, actions/dlq and actions/q<0-9>/... "
            "are the action queue's own topics on Pulsar (other names under actions/ are free)"
        )
    return stream


def encode_strings(stream: str, encoding: str, frame_id: str) -> tuple[bytes, int, int, int]:
    """UTF-8 tail of a binary header and its three lengths (publishers cache this)."""
    s = stream.encode()
    e = encoding.encode()
    f = frame_id.encode()
    if max(len(s), len(e), len(f)) > MAX_NAME_BYTES:
        raise HeaderError(f"stream, encoding or frame_id longer than {MAX_NAME_BYTES} bytes")
    return s + e + f, len(s), len(e), len(f)


def encode_header(h: Header, tail: tuple[bytes, int, int, int] | None = None) -> bytes:
    """Encode a header to its binary form (used as the Zenoh attachment).

    Args:
        h: The header.
        tail: ``encode_strings(h.stream, h.encoding, h.frame_id)`` if already known.
    """
    strings, ls, le, lf = tail or encode_strings(h.stream, h.encoding, h.frame_id)
    return (
        HEADER_PACK(
            WIRE_MAGIC,
            WIRE_VERSION,
            int(h.flags),
            int(h.modality),
            h.seq,
            h.stamp_ns,
            h.bucket,
            h.bucket_width_ns,
            h.bucket_offset_ns,
            h.publisher_id,
            h.publish_ns,
            ls,
            le,
            lf,
        )
        + strings
    )


class HeaderPacker:
    """Encodes headers equal to a template except in seq, stamp_ns, bucket and publish_ns,
    to the bytes :func:`encode_header` gives, with one struct pack (the constant fields are
    packed once). A publisher's own samples all have this shape.

    Attributes:
        pack: ``pack(head, seq, stamp_ns, bucket, mid, publish_ns, tail)``.
        head: Bytes 0-5 of the header (magic, version, flags, modality).
        mid: Bytes 30-53 (bucket width, offset, publisher id).
        tail: Bytes 62- (the three string lengths and the strings).
    """

    __slots__ = ("head", "mid", "pack", "tail")

    def __init__(self, template: Header) -> None:
        full = encode_header(template)
        self.head = full[:6]
        self.mid = full[30:54]
        self.tail = full[62:]
        self.pack = struct.Struct(f"<6sQqq24sq{len(self.tail)}s").pack

    def __call__(self, seq: int, stamp_ns: int, bucket: int, publish_ns: int) -> bytes:
        """The encoded header of the template with these four fields."""
        return self.pack(self.head, seq, stamp_ns, bucket, self.mid, publish_ns, self.tail)


def with_header_flags(header: bytes, flags: HeaderFlags) -> bytes:
    """The binary header ``header`` with these flag bits set as well (byte 3; the other bytes
    unchanged): for a sender that learns a sample's path only after its header was packed.

    Raises:
        HeaderError: ``header`` is too short to hold the flags byte.
    """
    if len(header) < 4:
        raise HeaderError(f"header too short to carry flags: {len(header)} bytes")
    return b"".join((header[:3], bytes((header[3] | int(flags),)), header[4:]))


HEADER_PACK = HEADER_STRUCT.pack
HEADER_UNPACK_FROM = HEADER_STRUCT.unpack_from
HEADER_SIZE = HEADER_STRUCT.size
FLAGS_BY_VALUE = {int(f): HeaderFlags(f) for f in range(4)}
#: Decoded (stream, encoding, frame_id) by the header's length fields and strings; bounded.
_TAILS: dict[bytes, tuple[str, str, str]] = {}
_MAX_TAILS = 4096


MODALITY_BY_VALUE = {int(m): m for m in Modality}


def decode_header(data: bytes) -> Header:
    """Decode a binary header.

    Raises:
        HeaderError: The bytes are not a valid header of a known version; the message says why.
    """
    n = HEADER_SIZE
    if len(data) < n:
        raise HeaderError(f"header too short: {len(data)} bytes, need at least {n}")
    (
        magic,
        version,
        flags,
        modality,
        seq,
        stamp_ns,
        bucket,
        width_ns,
        offset_ns,
        pub_id,
        publish_ns,
        ls,
        le,
        lf,
    ) = HEADER_UNPACK_FROM(data)
    if magic != WIRE_MAGIC:
        raise HeaderError(f"bad header magic {magic!r}, expected {WIRE_MAGIC!r}")
    if version != WIRE_VERSION:
        raise HeaderError(f"unsupported header version {version}, this build reads {WIRE_VERSION}")
    if len(data) != n + ls + le + lf:
        raise HeaderError(f"header length mismatch: {len(data)} bytes, fields say {n + ls + le + lf}")
    mod = MODALITY_BY_VALUE.get(modality)
    if mod is None:
        raise HeaderError(f"unknown modality number {modality}")
    if width_ns <= 0:
        raise HeaderError(f"bucket width must be positive, got {width_ns}")
    if seq == 0:
        raise HeaderError("sequence number 0 is invalid (sequences start at 1)")
    key = data[n - 6 :]  # the three lengths and the strings: a unique key for the tail
    strings = _TAILS.get(key)
    if strings is None:
        tail = data[n:]
        try:
            strings = (tail[:ls].decode(), tail[ls : ls + le].decode(), tail[ls + le :].decode())
        except UnicodeDecodeError as err:
            raise HeaderError(f"header string is not UTF-8: {err}") from err
        if len(_TAILS) >= _MAX_TAILS:
            _TAILS.clear()
        _TAILS[key] = strings
    fl = FLAGS_BY_VALUE.get(flags)
    if fl is None:
        fl = HeaderFlags(flags & 3)
    return Header(
        stream=strings[0],
        modality=mod,
        seq=seq,
        stamp_ns=stamp_ns,
        bucket=bucket,
        bucket_width_ns=width_ns,
        bucket_offset_ns=offset_ns,
        encoding=strings[1],
        frame_id=strings[2],
        publisher_id=pub_id,
        publish_ns=publish_ns,
        flags=fl,
    )
