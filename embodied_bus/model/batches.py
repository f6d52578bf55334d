"""Several samples of one publisher in one message: a table batch (headers and payload
lengths) or a column batch (one header, then the fields that differ as columns)."""

from __future__ import annotations

import functools
import logging
import struct
import sys
from array import array
from collections.abc import Callable, Iterator, Sequence
from itertools import accumulate, repeat
from typing import NamedTuple

from embodied_bus.errors import HeaderError
from embodied_bus.model.header import HEADER_SIZE, WIRE_MAGIC, Header, decode_header

_log = logging.getLogger("embodied_bus.wire")

__all__ = [
    "BATCH_LAYOUT",
    "COLUMN_LAYOUT",
    "HeaderRun",
    "decode_batch",
    "decode_batch_runs",
    "encode_batch",
    "encode_batch_parts",
    "encode_column_batch",
    "is_batch",
    "split_batch",
]


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
        """The samples' headers, in order (built by map in C, by position: no bytecode per
        sample)."""
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


def decode_run(attachment: bytes, payload: bytes, count: int, table: tuple[int, ...]) -> HeaderRun | None:
    """The one-pass path of :func:`decode_batch`, or None if the batch is not one run of
    same-shape headers (or its first header is malformed: the exact path names the error)."""
    size = table[0]
    h_at = _BATCH_HEAD.size + 8 * count
    if size > HEADER_SIZE and table[0::2].count(size) == count:
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
            run = decode_run(attachment, payload, count, table)
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
