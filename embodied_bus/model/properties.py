"""The header as Pulsar message properties: the compact ``eb.h`` text, or one property per
field; the bucket id travels as the message key and the bucket start as the event time."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from embodied_bus.errors import HeaderError
from embodied_bus.model.header import (
    FLAGS_BY_VALUE,
    MODALITY_BY_NAME,
    MODALITY_NAMES,
    STREAM_NAME_RE,
    WIRE_VERSION,
    Header,
    HeaderFlags,
    Modality,
)

_log = logging.getLogger("embodied_bus.wire")

__all__ = [
    "PROPERTY_LAYOUT",
    "decode_properties",
    "encode_header_text",
    "encode_properties",
]


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
            f"{_H_PREFIX}{stream}|{MODALITY_NAMES[Modality(modality)]}|",
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
            return Header(
                stream=stream,
                modality=mod,
                seq=seq,
                stamp_ns=stamp_ns,
                bucket=bucket,
                bucket_width_ns=width,
                bucket_offset_ns=offset,
                encoding=enc,
                frame_id=frame,
                publisher_id=pub,
                publish_ns=pub_ns,
                flags=flags,
            )
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
    flags = FLAGS_BY_VALUE.get(flag_bits)
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
        if not STREAM_NAME_RE.match(stream):
            raise HeaderError(f"property eb.h: invalid stream name {stream!r}")
        if len(_valid_streams) < 4096:
            _valid_streams.add(stream)
    return Header(
        stream=stream,
        modality=MODALITY_BY_NAME.get(parts[2]) or Modality.parse(parts[2]),
        seq=seq,
        stamp_ns=stamp_ns,
        bucket=bucket,
        bucket_width_ns=width_ns,
        bucket_offset_ns=offset_ns,
        encoding=tail[:enc_len],
        frame_id=tail[enc_len:],
        publisher_id=pub,
        publish_ns=pub_ns,
        flags=flags,
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
        stream=props["eb.stream"],
        modality=Modality.parse(props["eb.modality"]),
        seq=seq,
        stamp_ns=stamp_ns,
        bucket=bucket,
        bucket_width_ns=width_ns,
        bucket_offset_ns=offset_ns,
        encoding=props["eb.encoding"],
        frame_id=props["eb.frame_id"],
        publisher_id=pub,
        publish_ns=pub_ns,
        flags=flags,
    )
