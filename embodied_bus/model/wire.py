"""Versioned wire header of a sample, and its two encodings.

* **Binary** (Zenoh attachment): a fixed little-endian struct followed by three UTF-8 strings.
* **Properties** (Pulsar message properties): the same fields as text, plus the bucket id as the
  message key and the bucket start as the event time (set by the Pulsar engine).

The layout is documented in ``docs/wire-format.md``; change both together and bump
:data:`WIRE_VERSION` on any incompatible change.
"""

from __future__ import annotations

import enum
import functools
import logging
import re
import struct
import sys
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import accumulate, repeat
from typing import Any, ClassVar, NamedTuple

import msgspec

from embodied_bus.errors import HeaderError

_log = logging.getLogger("embodied_bus.wire")

__all__ = [
    "BATCH_LAYOUT",
    "COLUMN_LAYOUT",
    "HEADER_STRUCT",
    "MAX_NAME_BYTES",
    "PROPERTY_LAYOUT",
    "WIRE_MAGIC",
    "WIRE_VERSION",
    "Header",
    "HeaderFlags",
    "HeaderPacker",
    "HeaderRun",
    "Modality",
    "decode_batch",
    "decode_batch_runs",
    "decode_header",
    "decode_properties",
    "encode_batch",
    "encode_batch_parts",
    "encode_column_batch",
    "encode_header",
    "encode_header_text",
    "encode_properties",
    "encode_strings",
    "is_batch",
    "split_batch",
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

_STREAM_RE = re.compile(r"^[A-Za-z0-9_\-]+(/[A-Za-z0-9_\-]+)*$")
#: Stream names that would map onto the action queue's own Pulsar topics (``actions.state``,
#: ``actions.dlq``, ``actions.q<P>.<kind>``): reserved on every engine, so that code moves
#: between engines unchanged.
_RESERVED_STREAM_RE = re.compile(r"^actions/(state|dlq|q[0-9]/.+)$")


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


_MODALITY_NAMES = {m: m.name.lower() for m in Modality}
_MODALITY_BY_NAME = {m.name.lower(): m for m in Modality}


class HeaderFlags(enum.IntFlag):
    """Bit flags carried in the header."""

    NONE = 0
    #: The sensor stamp was zero; ``stamp_ns`` is the publisher's receive/log time instead.
    STAMP_FALLBACK = 1
    #: The payload travelled through Zenoh shared memory.
    SHM = 2


class Header(msgspec.Struct, frozen=True, gc=False, order=True):
    """Everything a sample carries besides its payload.

    An immutable ``msgspec.Struct`` built in C that the garbage collector does not track (it
    holds only strings, ints and enum members): a subscriber builds one per sample, and as a
    tuple subclass each was tracked for as long as it lived, ~7 % of a 1 KiB stream's
    throughput. It keeps the named tuple's conveniences: unpacking and indexing in field order,
    ``len``, ``_fields``, ``_replace`` and ``_asdict``; it is hashable and orders like a tuple
    of its fields, but never equals a plain tuple.

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
    if not isinstance(stream, str) or not _STREAM_RE.match(stream):
        raise HeaderError(
            f"invalid stream name {stream!r}: use segments of letters, digits, '_' or '-' separated by '/'"
        )
    if len(stream.encode()) > MAX_NAME_BYTES:
        raise HeaderError(f"stream name longer than {MAX_NAME_BYTES} bytes")
    if _RESERVED_STREAM_RE.match(stream):
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
        _pack(
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


_pack = HEADER_STRUCT.pack
_unpack_from = HEADER_STRUCT.unpack_from
_HEADER_SIZE = HEADER_STRUCT.size
_FLAGS = {int(f): HeaderFlags(f) for f in range(4)}
#: Decoded (stream, encoding, frame_id) by the header's length fields and strings; bounded.
_TAILS: dict[bytes, tuple[str, str, str]] = {}
_MAX_TAILS = 4096


_MODALITIES = {int(m): m for m in Modality}


def decode_header(data: bytes) -> Header:
    """Decode a binary header.

    Raises:
        HeaderError: The bytes are not a valid header of a known version; the message says why.
    """
    n = _HEADER_SIZE
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
    ) = _unpack_from(data)
    if magic != WIRE_MAGIC:
        raise HeaderError(f"bad header magic {magic!r}, expected {WIRE_MAGIC!r}")
    if version != WIRE_VERSION:
        raise HeaderError(f"unsupported header version {version}, this build reads {WIRE_VERSION}")
    if len(data) != n + ls + le + lf:
        raise HeaderError(f"header length mismatch: {len(data)} bytes, fields say {n + ls + le + lf}")
    mod = _MODALITIES.get(modality)
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
    fl = _FLAGS.get(flags)
    if fl is None:
        fl = HeaderFlags(flags & 3)
    return Header(
        strings[0],
        mod,
        seq,
        stamp_ns,
        bucket,
        width_ns,
        offset_ns,
        strings[1],
        strings[2],
        pub_id,
        publish_ns,
        fl,
    )


#: Third byte of a Zenoh *batch* attachment (where a header has its version): several samples
#: of one publisher in one Zenoh put. A receiver that reads only version 1 rejects it by name.
BATCH_LAYOUT = 0xB1
#: magic, layout, reserved, number of samples; then per sample (header bytes, payload bytes)
_BATCH_HEAD = struct.Struct("<2sBxI")
#: ``array`` typecode of an unsigned 32-bit int (the batch table's entries), and whether this
#: host must swap its bytes to write them little-endian.
_U32 = next(code for code in "IL" if array(code).itemsize == 4)
_SWAP_U32 = sys.byteorder != "little"
#: Most samples in one batch.
MAX_BATCH_SAMPLES = 4096
#: Third byte of a *column batch* attachment (:func:`encode_column_batch`): samples of one
#: publisher whose headers differ only in seq, stamp_ns, bucket and publish_ns, sent as the
#: first sample's header and those four fields as columns.
COLUMN_LAYOUT = 0xB2
#: magic, layout, reserved, number of samples, length of the first sample's header
_COLUMN_HEAD = struct.Struct("<2sBxII")
#: Bytes per sample in a column batch's columns: seq, stamp_ns, bucket, publish_ns (8 each) and
#: the payload length (4).
_COLUMN_BYTES = 36


def is_batch(attachment: bytes) -> bool:
    """Whether a Zenoh attachment is a batch (:func:`encode_batch` or
    :func:`encode_column_batch`) rather than one header."""
    return (
        len(attachment) > 2
        and (attachment[2] == BATCH_LAYOUT or attachment[2] == COLUMN_LAYOUT)
        and attachment[:2] == WIRE_MAGIC
    )


def encode_column_batch(
    first: bytes,
    seqs: Sequence[int],
    stamps_ns: Sequence[int],
    buckets: Sequence[int],
    publish_ns: Sequence[int],
    payloads: Sequence[bytes | bytearray],
    join: Callable[[Sequence[bytes | bytearray], int], bytes | bytearray] | None = None,
) -> tuple[bytes, bytes | bytearray]:
    """Samples of one publisher whose headers differ only in seq, stamp_ns, bucket and
    publish_ns, as one attachment and one payload (layout :data:`COLUMN_LAYOUT`).

    The attachment holds the column head (magic, layout, sample count, header length), the
    first sample's encoded header, then five little-endian columns: seq (``u64``), stamp_ns,
    bucket and publish_ns (``i64``) and the payload lengths (``u32``). The payload is the
    payloads one after another. A receiver rebuilds every header from the first and the
    columns, so nothing per sample is decoded twice.

    Args:
        first: The first sample's encoded header (:func:`encode_header`).
        seqs: Sequence numbers, one per sample (the first matches ``first``).
        stamps_ns: Sensor stamps, UTC ns.
        buckets: Time-bucket ids.
        publish_ns: Publish times, UTC ns.
        payloads: The payloads.
        join: As for :func:`encode_batch_parts`.

    Raises:
        ValueError: The columns differ in length, or there are no samples.
    """
    n = len(payloads)
    if not n or not len(seqs) == len(stamps_ns) == len(buckets) == len(publish_ns) == n:
        raise ValueError(f"column batch of {n} payloads and columns of other lengths (or empty)")
    sizes = list(map(len, payloads))
    att = b"".join(
        (
            _COLUMN_HEAD.pack(WIRE_MAGIC, COLUMN_LAYOUT, n, len(first)),
            first,
            _columns_layout(n).pack(*seqs, *stamps_ns, *buckets, *publish_ns, *sizes),
        )
    )
    body = b"".join(payloads) if join is None else join(payloads, sum(sizes))
    return att, body


@functools.lru_cache(maxsize=256)
def _columns_layout(count: int) -> struct.Struct:
    """The five columns of a column batch of ``count`` samples, little-endian: seq (``u64``),
    stamp_ns, bucket, publish_ns (``i64``), payload length (``u32``); one C call packs or
    unpacks them all."""
    return struct.Struct(f"<{count}Q{count}q{count}q{count}q{count}I")


@functools.lru_cache(maxsize=32)
def _uniform_layout(size: int, count: int) -> struct.Struct:
    """The layout of ``count`` payloads of ``size`` bytes each, one after another (one compiled
    item per payload: up to ~150 KiB for a batch of :data:`MAX_BATCH_SAMPLES`, so few are
    kept; compiling one again costs ~9 ns per payload, a tenth of what slicing saves)."""
    return struct.Struct(f"{size}s" * count)


def _decode_columns(attachment: bytes, payload: bytes) -> HeaderRun:
    """The samples of a column batch (:func:`encode_column_batch`), checked.

    Raises:
        HeaderError: The batch is malformed (the message says how); none of it is usable.
    """
    n_head = _COLUMN_HEAD.size
    if len(attachment) < n_head:
        raise HeaderError(f"column batch head too short: {len(attachment)} bytes, need {n_head}")
    _, _, count, header_len = _COLUMN_HEAD.unpack_from(attachment)
    if not 0 < count <= MAX_BATCH_SAMPLES:
        raise HeaderError(f"batch of {count} samples (1 to {MAX_BATCH_SAMPLES} allowed)")
    want = n_head + header_len + _COLUMN_BYTES * count
    if len(attachment) != want:
        raise HeaderError(
            f"column batch of {count} samples with a {header_len}-byte header needs {want} bytes, "
            f"has {len(attachment)}"
        )
    at = n_head + header_len
    first = decode_header(attachment[n_head:at])
    cols = _columns_layout(count).unpack_from(attachment, at)
    seqs, stamps, buckets = cols[:count], cols[count : 2 * count], cols[2 * count : 3 * count]
    publish, sizes = cols[3 * count : 4 * count], cols[4 * count :]
    if sum(sizes) != len(payload):
        raise HeaderError(f"column batch payloads add up to {sum(sizes)} bytes, not {len(payload)}")
    if (first.seq, first.stamp_ns, first.bucket, first.publish_ns) != (
        seqs[0],
        stamps[0],
        buckets[0],
        publish[0],
    ):
        raise HeaderError("column batch: the first header and the first row of the columns differ")
    if 0 in seqs:
        raise HeaderError("sequence number 0 in a column batch (they start at 1)")
    return HeaderRun(first, seqs, stamps, buckets, publish, _split_payloads(payload, sizes), sizes)


def _split_payloads(payload: bytes, sizes: Sequence[int]) -> list[bytes]:
    """The payloads of a batch, given their sizes (bytes; checked to add up to ``payload``)."""
    count, step = len(sizes), sizes[0]
    if not payload:
        return [b""] * count  # empty payloads (markers, triggers)
    if sizes.count(step) == count:  # payloads of one size: one C call (half the time of slicing)
        return list(_uniform_layout(step, count).unpack(payload))
    ends = list(accumulate(sizes))
    return list(map(payload.__getitem__, map(slice, [0, *ends[:-1]], ends)))


def encode_batch(entries: list[tuple[bytes, bytes | bytearray]]) -> tuple[bytes, bytes]:
    """Several (encoded header, payload) pairs as one attachment and one payload.

    The attachment holds the batch head, a table of (header length, payload length) per sample
    (little-endian ``u32`` each) and the headers one after another; the payload is the
    payloads one after another.

    Returns:
        ``(attachment, payload)``.
    """
    headers, payloads = zip(*entries, strict=True)
    attachment, payload = encode_batch_parts(headers, payloads)
    assert isinstance(payload, bytes)  # joined by b"".join
    return attachment, payload


def encode_batch_parts(
    headers: Sequence[bytes],
    payloads: Sequence[bytes | bytearray],
    join: Callable[[Sequence[bytes | bytearray], int], bytes | bytearray] | None = None,
) -> tuple[bytes, bytes | bytearray]:
    """:func:`encode_batch` of ``zip(headers, payloads)`` (the two as separate sequences).

    Args:
        headers: Encoded headers.
        payloads: Their payloads.
        join: Concatenates the payloads, given them and their total length in bytes (None:
            ``b"".join``), e.g. into a buffer the caller keeps.
    """
    n = len(headers)
    if len(payloads) != n:
        raise ValueError(f"{n} headers but {len(payloads)} payloads")
    sizes = array(_U32, map(len, payloads))
    table = array(_U32, bytes(8 * n))  # (header length, payload length) per sample, interleaved
    table[0::2] = array(_U32, map(len, headers))
    table[1::2] = sizes
    if _SWAP_U32:
        table.byteswap()
    head = _BATCH_HEAD.pack(WIRE_MAGIC, BATCH_LAYOUT, n) + table.tobytes()
    body = b"".join(payloads) if join is None else join(payloads, sum(sizes))
    return head + b"".join(headers), body


def _batch_table(attachment: bytes, payload: bytes) -> tuple[int, tuple[int, ...]]:
    """Sample count and (header length, payload length) table of a batch, checked."""
    n_head = _BATCH_HEAD.size
    if len(attachment) < n_head:
        raise HeaderError(f"batch head too short: {len(attachment)} bytes, need {n_head}")
    _, layout, count = _BATCH_HEAD.unpack_from(attachment)
    if layout != BATCH_LAYOUT:
        raise HeaderError(f"not a table batch: layout byte {layout:#x}, expected {BATCH_LAYOUT:#x}")
    if not 0 < count <= MAX_BATCH_SAMPLES:
        raise HeaderError(f"batch of {count} samples (1 to {MAX_BATCH_SAMPLES} allowed)")
    h_at = n_head + 8 * count
    if len(attachment) < h_at:
        raise HeaderError(f"batch table of {count} samples does not fit in {len(attachment)} bytes")
    table = struct.unpack_from(f"<{2 * count}I", attachment, n_head)
    if h_at + sum(table[0::2]) != len(attachment) or sum(table[1::2]) != len(payload):
        raise HeaderError(
            f"batch lengths do not add up: headers {sum(table[0::2])} + {h_at} vs {len(attachment)} "
            f"bytes, payloads {sum(table[1::2])} vs {len(payload)} bytes"
        )
    return count, table


def split_batch(attachment: bytes, payload: bytes) -> list[tuple[bytes, bytes]]:
    """The (encoded header, payload) pairs of a batch.

    Raises:
        HeaderError: The batch is malformed (the message says how); none of it is usable.
    """
    count, table = _batch_table(attachment, payload)
    h_at, p_at = _BATCH_HEAD.size + 8 * count, 0
    out = []
    for i in range(count):
        hl, pl = table[2 * i], table[2 * i + 1]
        out.append((attachment[h_at : h_at + hl], payload[p_at : p_at + pl]))
        h_at += hl
        p_at += pl
    return out


#: Headers as (bytes 0-5, seq, stamp_ns, bucket, bytes 30-53, publish_ns, bytes 62-): the
#: fields that differ between samples of one publisher, and the rest as three opaque runs.
_RUN_STRUCTS: dict[int, struct.Struct] = {}
#: Smaller batches are decoded header by header (the one-pass path costs more below this).
_RUN_MIN_SAMPLES = 16


class HeaderRun(NamedTuple):
    """The samples of a batch whose headers differ only in seq, stamp_ns, bucket and publish_ns
    (one publisher's samples with the same encoding and frame_id), as columns.

    Attributes:
        first: The first sample's header (the others share all but the four fields).
        seqs: Sequence numbers, in batch order.
        stamps_ns: Sensor stamps, UTC nanoseconds.
        buckets: Time-bucket ids.
        publish_ns: Publish times, UTC nanoseconds.
        payloads: The payloads.
        sizes: Their lengths in bytes.
    """

    first: Header
    seqs: tuple[int, ...]
    stamps_ns: tuple[int, ...]
    buckets: tuple[int, ...]
    publish_ns: tuple[int, ...]
    payloads: list[bytes]
    sizes: tuple[int, ...]

    def headers(self) -> Iterator[Header]:
        """The samples' headers, in order (built by map in C: no bytecode per sample)."""
        first = self.first
        return map(
            Header,
            repeat(first.stream),
            repeat(first.modality),
            self.seqs,
            self.stamps_ns,
            self.buckets,
            repeat(first.bucket_width_ns),
            repeat(first.bucket_offset_ns),
            repeat(first.encoding),
            repeat(first.frame_id),
            repeat(first.publisher_id),
            self.publish_ns,
            repeat(first.flags),
        )

    def pairs(self) -> list[tuple[Header, bytes]]:
        """``(header, payload)`` per sample, in order."""
        return list(zip(self.headers(), self.payloads, strict=True))


def _decode_run(attachment: bytes, payload: bytes, count: int, table: tuple[int, ...]) -> HeaderRun | None:
    """The one-pass path of :func:`decode_batch`, or None if the batch is not one run of
    same-shape headers (or its first header is malformed: the exact path names the error)."""
    size = table[0]
    h_at = _BATCH_HEAD.size + 8 * count
    if size > _HEADER_SIZE and table[0::2].count(size) == count:
        run = _RUN_STRUCTS.get(size)
        if run is None:
            if len(_RUN_STRUCTS) >= 64:
                _RUN_STRUCTS.clear()
            run = _RUN_STRUCTS[size] = struct.Struct(f"<6sQqq24sq{size - 62}s")
        head, seqs, stamps, buckets, mid, publish, tail = zip(
            *run.iter_unpack(attachment[h_at:]), strict=True
        )
        if head.count(head[0]) == count and mid.count(mid[0]) == count and tail.count(tail[0]) == count:
            try:
                first = decode_header(attachment[h_at : h_at + size])
            except HeaderError:
                first = None
            if first is not None and 0 not in seqs:
                sizes = table[1::2]  # _batch_table checked that they fill the payload
                bodies = _split_payloads(payload, sizes)
                return HeaderRun(first, seqs, stamps, buckets, publish, bodies, sizes)
    return None


def decode_batch(attachment: bytes, payload: bytes) -> tuple[list[tuple[Header, bytes]], list[HeaderError]]:
    """Decode a batch into its samples: what :func:`split_batch` then :func:`decode_header` per
    sample give, in one pass when the headers differ only in seq, stamp, bucket and publish
    time (one publisher's samples with the same encoding and frame_id): the first header is
    decoded in full and the differing fields of all of them are unpacked together.

    Returns:
        ``(samples, errors)``: the (header, payload) pairs that decoded, in batch order, and one
        :class:`HeaderError` per sample whose header did not (the others are unaffected).

    Raises:
        HeaderError: The batch itself is malformed (see :func:`split_batch`); none of it is usable.
    """
    decoded, errors = decode_batch_runs(attachment, payload)
    return (decoded.pairs() if isinstance(decoded, HeaderRun) else decoded), errors


def decode_batch_runs(
    attachment: bytes, payload: bytes
) -> tuple[HeaderRun | list[tuple[Header, bytes]], list[HeaderError]]:
    """:func:`decode_batch`, with a batch of one run of same-shape headers returned as a
    :class:`HeaderRun` (its columns) instead of ``(header, payload)`` pairs.

    Raises:
        HeaderError: The batch itself is malformed; none of it is usable.
    """
    if len(attachment) > 2 and attachment[2] == COLUMN_LAYOUT:
        return _decode_columns(attachment, payload), []
    count, table = _batch_table(attachment, payload)
    if count >= _RUN_MIN_SAMPLES:
        try:
            run = _decode_run(attachment, payload, count, table)
        except (ValueError, TypeError, struct.error) as err:  # a bug in the fast path, not bad input
            _log.warning("one-pass batch decoding failed (%r); decoding sample by sample", err)
            run = None
        if run is not None:
            return run, []
    out: list[tuple[Header, bytes]] = []
    errors: list[HeaderError] = []
    for raw_header, body in split_batch(attachment, payload):
        try:
            out.append((decode_header(raw_header), body))
        except HeaderError as err:
            errors.append(err)
    return out, errors


_PROP_KEYS = (
    "eb.v",
    "eb.stream",
    "eb.modality",
    "eb.seq",
    "eb.stamp_ns",
    "eb.bucket",
    "eb.width_ns",
    "eb.offset_ns",
    "eb.encoding",
    "eb.frame_id",
    "eb.pub",
    "eb.pub_ns",
    "eb.flags",
)


#: Layout version of the compact Pulsar header property ``eb.h``.
PROPERTY_LAYOUT = 2
#: Fields of ``eb.h`` in order (the last holds the encoding followed by the frame_id).
_H_FIELDS = (
    "layout",
    "stream",
    "modality",
    "seq",
    "stamp_ns",
    "bucket",
    "width_ns",
    "offset_ns",
    "pub",
    "pub_ns",
    "flags",
    "encoding_len",
    "encoding+frame_id",
)
_H_PREFIX = f"{PROPERTY_LAYOUT}|"


#: Constant parts of ``eb.h`` by (stream, modality, width, offset, publisher, flags, encoding,
#: frame_id): what surrounds seq/stamp/bucket and publish_ns. Bounded.
_COMPACT_PARTS: dict[tuple[object, ...], tuple[str, str, str]] = {}


def encode_properties(h: Header) -> dict[str, str]:
    """Encode a header as Pulsar message properties: ``{"eb.h": encode_header_text(h)}``."""
    return {"eb.h": encode_header_text(h)}


def encode_header_text(h: Header) -> str:
    """Encode a header as the text of the Pulsar message property ``eb.h``.

    ``eb.h`` is ``2|stream|modality|seq|stamp_ns|bucket|width_ns|offset_ns|pub|pub_ns|flags|
    len(encoding)|<encoding><frame_id>`` (``pub`` in 16 hex digits, lengths in characters), so
    encoding and frame_id may hold any character. One property instead of thirteen doubles a
    1 KiB stream's throughput through the Pulsar client.
    """
    stream, modality, seq, stamp_ns, bucket, width_ns, offset_ns, enc, frame_id, pub, pub_ns, flags = h
    flag_bits = int(flags)
    key = (stream, int(modality), width_ns, offset_ns, pub, flag_bits, enc, frame_id)
    parts = _COMPACT_PARTS.get(key)
    if parts is None:
        if len(_COMPACT_PARTS) >= 4096:
            _COMPACT_PARTS.clear()
        parts = _COMPACT_PARTS[key] = (
            f"{_H_PREFIX}{stream}|{_MODALITY_NAMES[Modality(modality)]}|",
            f"|{width_ns}|{offset_ns}|{pub:016x}|",
            f"|{flag_bits}|{len(enc)}|{enc}{frame_id}",
        )
    head, mid, tail = parts
    return f"{head}{seq}|{stamp_ns}|{bucket}{mid}{pub_ns}{tail}"


_valid_streams: set[str] = set()  # stream names seen valid (a bounded cache)


def _check_seq_and_width(seq: int, width_ns: int, seq_name: str, width_name: str) -> None:
    if seq <= 0:
        raise HeaderError(f"{seq_name} must be >= 1, got {seq}")
    if width_ns <= 0:
        raise HeaderError(f"{width_name} must be positive, got {width_ns}")


def _is_int(text: str, base: int) -> bool:
    try:
        int(text, base)
    except ValueError:
        return False
    return True


#: Decoded constant fields of ``eb.h`` (everything but seq, stamp, bucket and publish_ns) by
#: their text: (stream, modality, width_ns, offset_ns, pub, flags, encoding, frame_id). Bounded.
_COMPACT_FIXED: dict[tuple[str, ...], tuple[str, Modality, int, int, int, HeaderFlags, str, str]] = {}


def _decode_compact(value: str) -> Header:
    parts = value.split("|", 12)
    key = (parts[0], parts[1], parts[2], *parts[6:9], *parts[10:13]) if len(parts) == 13 else None
    fixed = _COMPACT_FIXED.get(key) if key is not None else None
    if fixed is not None:
        try:
            seq, stamp_ns, bucket, pub_ns = int(parts[3]), int(parts[4]), int(parts[5]), int(parts[9])
        except ValueError:
            seq = 0  # the full decoder names the field
        if seq > 0:
            stream, mod, width, offset, pub, flags, enc, frame = fixed
            return Header(stream, mod, seq, stamp_ns, bucket, width, offset, enc, frame, pub, pub_ns, flags)
    h = _decode_compact_full(value, parts)
    if key is not None:
        if len(_COMPACT_FIXED) >= 4096:
            _COMPACT_FIXED.clear()
        _COMPACT_FIXED[key] = (
            h.stream,
            h.modality,
            h.bucket_width_ns,
            h.bucket_offset_ns,
            h.publisher_id,
            h.flags,
            h.encoding,
            h.frame_id,
        )
    return h


def _decode_compact_full(value: str, parts: list[str]) -> Header:
    if len(parts) != 13:
        raise HeaderError(f"property eb.h has {len(parts)} fields, expected 13: {value[:120]!r}")
    if parts[0] != str(PROPERTY_LAYOUT):
        raise HeaderError(f"unsupported eb.h layout {parts[0]!r}, this build reads {PROPERTY_LAYOUT}")
    try:
        seq, stamp_ns, bucket, width_ns, offset_ns = map(int, parts[3:8])
        pub = int(parts[8], 16)
        pub_ns, flag_bits, enc_len = map(int, parts[9:12])
    except ValueError as err:
        bad = next(i for i in range(3, 12) if not _is_int(parts[i], 16 if i == 8 else 10))
        raise HeaderError(f"property eb.h: field {_H_FIELDS[bad]} is not an integer: {parts[bad]!r}") from err
    flags = _FLAGS.get(flag_bits)
    if flags is None:
        try:
            flags = HeaderFlags(flag_bits & 3)  # unknown flag bits are ignored (compatible)
        except ValueError as err:
            raise HeaderError(f"property eb.h: invalid flags {flag_bits}") from err
    _check_seq_and_width(seq, width_ns, "property eb.h: seq", "property eb.h: width_ns")
    tail = parts[12]
    if not 0 <= enc_len <= len(tail):
        raise HeaderError(
            f"property eb.h: encoding_len {enc_len} does not fit the {len(tail)} characters left"
        )
    stream = parts[1]
    if stream not in _valid_streams:
        if not _STREAM_RE.match(stream):
            raise HeaderError(f"property eb.h: invalid stream name {stream!r}")
        if len(_valid_streams) < 4096:
            _valid_streams.add(stream)
    return Header(
        stream,
        _MODALITY_BY_NAME.get(parts[2]) or Modality.parse(parts[2]),
        seq,
        stamp_ns,
        bucket,
        width_ns,
        offset_ns,
        tail[:enc_len],
        tail[enc_len:],
        pub,
        pub_ns,
        flags,
    )


def decode_properties(props: Mapping[str, str]) -> Header:
    """Decode a header from Pulsar message properties: ``eb.h`` (layout 2), or the thirteen
    ``eb.*`` properties of layout 1 that earlier builds wrote.

    Raises:
        HeaderError: A property is missing or malformed; the message names it.
    """
    compact = props.get("eb.h")
    if compact is not None:
        return _decode_compact(compact)
    if "eb.v" not in props:
        raise HeaderError("message properties lack eb.h (no embodied_bus header)")
    missing = [k for k in _PROP_KEYS if k not in props]
    if missing:
        raise HeaderError(f"message properties lack {', '.join(missing)}")
    if props["eb.v"] != str(WIRE_VERSION):
        raise HeaderError(f"unsupported header version {props['eb.v']!r}, this build reads {WIRE_VERSION}")
    key = ""
    try:
        key = "eb.seq"
        seq = int(props[key])
        key = "eb.stamp_ns"
        stamp_ns = int(props[key])
        key = "eb.bucket"
        bucket = int(props[key])
        key = "eb.width_ns"
        width_ns = int(props[key])
        key = "eb.offset_ns"
        offset_ns = int(props[key])
        key = "eb.pub"
        pub = int(props[key], 16)
        key = "eb.pub_ns"
        pub_ns = int(props[key])
        key = "eb.flags"
        flags = HeaderFlags(int(props[key]))
    except ValueError as err:
        raise HeaderError(f"property {key} is not a valid integer: {props[key]!r}") from err
    _check_seq_and_width(seq, width_ns, "property eb.seq", "property eb.width_ns")
    return Header(
        props["eb.stream"],
        Modality.parse(props["eb.modality"]),
        seq,
        stamp_ns,
        bucket,
        width_ns,
        offset_ns,
        props["eb.encoding"],
        props["eb.frame_id"],
        pub,
        pub_ns,
        flags,
    )
