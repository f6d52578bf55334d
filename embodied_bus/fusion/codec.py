"""Frames on the wire (encoding ``ebframe``) and as JSON lines for offline checks.

Layout: ``b"EBF1"``, u32 little-endian length of a UTF-8 JSON document, the JSON document, then
the members' payloads back to back. The JSON lists every member with its header fields and the
offset and length of its payload, so decoding slices the buffer without copying.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec

from embodied_bus.errors import EncodingError
from embodied_bus.fusion.frame import Member, MultiModalFrame
from embodied_bus.fusion.metrics import end_to_end_ms
from embodied_bus.model.header import Header, HeaderFlags, Modality, validate_stream_name
from embodied_bus.model.limits import DEFAULT_LIMITS, DecodeLimits
from embodied_bus.model.sample import Sample

__all__ = ["FRAME_ENCODING", "MAX_FRAME_MEMBERS", "decode_frame", "encode_frame", "frame_summary"]

#: Encoding string of frame payloads.
FRAME_ENCODING = "ebframe"
#: Most members a decoded frame may have by default (see :class:`DecodeLimits`).
MAX_FRAME_MEMBERS = DEFAULT_LIMITS.max_frame_members
#: Largest JSON document accepted in a frame by default, in bytes.
MAX_META_BYTES = DEFAULT_LIMITS.max_frame_meta_bytes

_MAGIC = b"EBF1"


class _MemberMeta(msgspec.Struct, array_like=False):
    """One member as the frame's JSON document lists it."""

    stream: str
    modality: int
    seq: int
    header_stamp_ns: int
    stamp_ns: int
    skew_ns: int
    encoding: str
    frame_id: str
    publisher_id: int
    publish_ns: int
    receive_ns: int
    flags: int
    bucket: int
    width_ns: int
    offset_ns: int
    offset: int
    length: int
    fallback: bool = False


class _FrameMeta(msgspec.Struct):
    """A frame's JSON document (without payloads)."""

    bucket: int
    start_ns: int
    end_ns: int
    reference_stamp_ns: int
    members: list[_MemberMeta]
    late_count: int = 0
    pane: int = 0
    last_arrival_ns: int = 0
    missing: list[str] = msgspec.field(default_factory=list)
    complete: bool = False
    max_skew_ns: int | None = None
    interpolation: dict[str, float] = msgspec.field(default_factory=dict)
    forced: bool = False
    waited_on: str | None = None


_encode_meta = msgspec.json.Encoder().encode
_decode_meta = msgspec.json.Decoder(_FrameMeta).decode


def encode_frame(frame: MultiModalFrame) -> bytearray:
    """Serialize a frame with its members' payloads (one copy of each payload)."""
    members: list[_MemberMeta] = []
    offset = 0
    payloads: list[bytes | memoryview] = []
    for name, ms in frame.members.items():
        for m in ms:
            s = m.sample
            h = s.header
            n = len(s.payload)
            members.append(
                _MemberMeta(
                    name,
                    int(h.modality),
                    h.seq,
                    h.stamp_ns,
                    m.stamp_ns,
                    m.skew_ns,
                    h.encoding,
                    h.frame_id,
                    h.publisher_id,
                    h.publish_ns,
                    s.receive_ns,
                    int(h.flags),
                    h.bucket,
                    h.bucket_width_ns,
                    h.bucket_offset_ns,
                    offset,
                    n,
                    m.stamp_fallback,
                )
            )
            payloads.append(s.payload)
            offset += n
    meta = _encode_meta(
        _FrameMeta(
            frame.bucket,
            frame.start_ns,
            frame.end_ns,
            frame.reference_stamp_ns,
            members,
            frame.late_count,
            frame.pane,
            frame.last_arrival_ns,
            list(frame.missing),
            frame.complete,
            frame.max_skew_ns,
            frame.interpolation,
            frame.forced,
            frame.waited_on,
        )
    )
    out = bytearray(8 + len(meta) + offset)
    out[0:4] = _MAGIC
    struct.pack_into("<I", out, 4, len(meta))
    out[8 : 8 + len(meta)] = meta
    pos = 8 + len(meta)
    for p in payloads:
        out[pos : pos + len(p)] = p
        pos += len(p)
    return out


def _member(d: _MemberMeta, body: memoryview, lim: DecodeLimits) -> Member:
    """One member of a frame from its metadata entry; its payload a view of ``body``.

    Raises:
        EncodingError: The entry is out of bounds or names an invalid stream.
    """
    stream = d.stream
    try:
        validate_stream_name(stream)
        modality = Modality(d.modality)
    except ValueError as err:
        raise EncodingError(f"frame member {stream!r}: {err}") from None
    off, n = d.offset, d.length
    if off < 0 or n < 0 or off + n > len(body):
        raise EncodingError(f"frame member {stream!r} payload [{off}, {off + n}) is out of bounds")
    if len(d.encoding) > lim.max_string_bytes or len(d.frame_id) > lim.max_string_bytes:
        raise EncodingError(f"frame member {stream!r}: encoding or frame_id exceeds max_string_bytes")
    if d.width_ns <= 0:
        raise EncodingError(f"frame member {stream!r} has a non-positive bucket width")
    h = Header(
        stream=stream,
        modality=modality,
        seq=d.seq,
        stamp_ns=d.header_stamp_ns,
        bucket=d.bucket,
        bucket_width_ns=d.width_ns,
        bucket_offset_ns=d.offset_ns,
        encoding=d.encoding,
        frame_id=d.frame_id,
        publisher_id=d.publisher_id,
        publish_ns=d.publish_ns,
        flags=HeaderFlags(d.flags & 3),
    )
    return Member(Sample(h, body[off : off + n], d.receive_ns), d.stamp_ns, d.skew_ns, d.fallback)


def decode_frame(
    buffer: bytes | bytearray | memoryview, *, limits: DecodeLimits | None = None
) -> MultiModalFrame:
    """Decode a frame; member payloads are views of ``buffer`` (no copy).

    Args:
        limits: Bounds on payload size, member count, metadata size and string lengths
            (None: :data:`DEFAULT_LIMITS`).

    Raises:
        EncodingError: The buffer is not a valid frame; the message says what is wrong.
    """
    lim = limits or DEFAULT_LIMITS
    mv = memoryview(buffer)
    if len(mv) > lim.max_payload_bytes:
        raise EncodingError(f"frame of {len(mv)} bytes exceeds max_payload_bytes {lim.max_payload_bytes}")
    if len(mv) < 8 or mv[:4].tobytes() != _MAGIC:
        raise EncodingError("frame payload lacks the EBF1 magic")
    (meta_len,) = struct.unpack_from("<I", mv, 4)
    if meta_len > lim.max_frame_meta_bytes or 8 + meta_len > len(mv):
        raise EncodingError(f"frame metadata length {meta_len} exceeds the payload ({len(mv)} bytes)")
    try:
        meta = _decode_meta(mv[8 : 8 + meta_len])
    except msgspec.ValidationError as err:
        raise EncodingError(f"frame metadata is malformed: {err} (an object with a members list)") from None
    except msgspec.DecodeError as err:
        raise EncodingError(f"frame metadata is not valid JSON: {err}") from None
    if len(meta.members) > lim.max_frame_members:
        raise EncodingError(
            f"frame has {len(meta.members)} members, limit max_frame_members {lim.max_frame_members}"
        )
    body = mv[8 + meta_len :]
    members: dict[str, list[Member]] = {}
    for d in meta.members:
        member = _member(d, body, lim)
        members.setdefault(member.sample.stream, []).append(member)
    return MultiModalFrame(
        bucket=meta.bucket,
        start_ns=meta.start_ns,
        end_ns=meta.end_ns,
        reference_stamp_ns=meta.reference_stamp_ns,
        members={k: tuple(v) for k, v in members.items()},
        missing=tuple(meta.missing),
        complete=meta.complete,
        late_count=meta.late_count,
        max_skew_ns=meta.max_skew_ns,
        interpolation=meta.interpolation,
        forced=meta.forced,
        pane=meta.pane,
        last_arrival_ns=meta.last_arrival_ns,
        waited_on=meta.waited_on,
    )


def frame_summary(frame: MultiModalFrame, emitted_ns: int) -> dict[str, Any]:
    """One JSON-ready line per frame: bucket, members with stamps and offsets from the
    reference, missing, skew, latency and what the frame waited on (a figure that is undefined
    is None: ``end_to_end_ms`` where the stamps are not on the wall clock, ``max_skew_ms``
    without members besides the reference)."""
    e2e = end_to_end_ms(emitted_ns, frame.reference_stamp_ns)
    return {
        "bucket": frame.bucket,
        "start_ns": frame.start_ns,
        "reference_stamp_ns": frame.reference_stamp_ns,
        "complete": frame.complete,
        "forced": frame.forced,
        "pane": frame.pane,
        "missing": list(frame.missing),
        "members": {
            k: [
                {
                    "seq": m.sample.seq,
                    "stamp_ns": m.stamp_ns,
                    "skew_ms": round(m.skew_ns / 1e6, 3),
                    "fallback": m.stamp_fallback,
                }
                for m in v
            ]
            for k, v in frame.members.items()
        },
        "max_skew_ms": None if frame.max_skew_ns is None else round(frame.max_skew_ns / 1e6, 3),
        "waited_on": frame.waited_on,
        "late_count": frame.late_count,
        "added_latency_ms": round((emitted_ns - frame.last_arrival_ns) / 1e6, 3)
        if frame.last_arrival_ns
        else None,
        "end_to_end_ms": None if e2e is None else round(e2e, 3),
        "emitted_ns": emitted_ns,
    }
