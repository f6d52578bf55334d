"""Frames on the wire (encoding ``ebframe``) and as JSON lines for offline checks.

Layout: ``b"EBF1"``, u32 little-endian length of a UTF-8 JSON document, the JSON document, then
the members' payloads back to back. The JSON lists every member with its header fields and the
offset and length of its payload, so decoding slices the buffer without copying.
"""

from __future__ import annotations

import json
import struct
from typing import Any

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


def encode_frame(frame: MultiModalFrame) -> bytearray:
    """Serialize a frame with its members' payloads (one copy of each payload)."""
    members: list[dict[str, Any]] = []
    offset = 0
    payloads: list[bytes | memoryview] = []
    for name, ms in frame.members.items():
        for m in ms:
            h = m.sample.header
            n = len(m.sample.payload)
            members.append(
                {
                    "stream": name,
                    "modality": int(h.modality),
                    "seq": h.seq,
                    "header_stamp_ns": h.stamp_ns,
                    "stamp_ns": m.stamp_ns,
                    "skew_ns": m.skew_ns,
                    "fallback": m.stamp_fallback,
                    "encoding": h.encoding,
                    "frame_id": h.frame_id,
                    "publisher_id": h.publisher_id,
                    "publish_ns": h.publish_ns,
                    "receive_ns": m.sample.receive_ns,
                    "flags": int(h.flags),
                    "bucket": h.bucket,
                    "width_ns": h.bucket_width_ns,
                    "offset_ns": h.bucket_offset_ns,
                    "offset": offset,
                    "length": n,
                }
            )
            payloads.append(m.sample.payload)
            offset += n
    meta = json.dumps(
        {
            "bucket": frame.bucket,
            "start_ns": frame.start_ns,
            "end_ns": frame.end_ns,
            "reference_stamp_ns": frame.reference_stamp_ns,
            "missing": list(frame.missing),
            "complete": frame.complete,
            "late_count": frame.late_count,
            "max_skew_ns": frame.max_skew_ns,
            "interpolation": frame.interpolation,
            "forced": frame.forced,
            "pane": frame.pane,
            "last_arrival_ns": frame.last_arrival_ns,
            "skew_measured": frame.skew_measured,
            "members": members,
        },
        separators=(",", ":"),
    ).encode()
    out = bytearray(8 + len(meta) + offset)
    out[0:4] = _MAGIC
    struct.pack_into("<I", out, 4, len(meta))
    out[8 : 8 + len(meta)] = meta
    pos = 8 + len(meta)
    for p in payloads:
        out[pos : pos + len(p)] = p
        pos += len(p)
    return out


def _int(d: dict[str, Any], key: str) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool):
        raise EncodingError(f"frame field {key!r} must be an integer, got {v!r}")
    return v


def _member(d: Any, body: memoryview, lim: DecodeLimits) -> Member:
    """One member of a frame from its metadata entry; its payload a view of ``body``.

    Raises:
        EncodingError: The entry is malformed or out of bounds.
    """
    if not isinstance(d, dict):
        raise EncodingError("frame member must be an object")
    stream = d.get("stream")
    if not isinstance(stream, str):
        raise EncodingError("frame member lacks a stream name")
    try:
        validate_stream_name(stream)
        modality = Modality(_int(d, "modality"))
    except ValueError as err:
        raise EncodingError(f"frame member {stream!r}: {err}") from None
    off, n = _int(d, "offset"), _int(d, "length")
    if off < 0 or n < 0 or off + n > len(body):
        raise EncodingError(f"frame member {stream!r} payload [{off}, {off + n}) is out of bounds")
    for key in ("encoding", "frame_id"):
        if not isinstance(d.get(key), str):
            raise EncodingError(f"frame member {stream!r} field {key!r} must be a string")
        if len(d[key]) > lim.max_string_bytes:
            raise EncodingError(f"frame member {stream!r} field {key!r} exceeds max_string_bytes")
    width = _int(d, "width_ns")
    if width <= 0:
        raise EncodingError(f"frame member {stream!r} has a non-positive bucket width")
    h = Header(
        stream=stream,
        modality=modality,
        seq=_int(d, "seq"),
        stamp_ns=_int(d, "header_stamp_ns"),
        bucket=_int(d, "bucket"),
        bucket_width_ns=width,
        bucket_offset_ns=_int(d, "offset_ns"),
        encoding=d["encoding"],
        frame_id=d["frame_id"],
        publisher_id=_int(d, "publisher_id"),
        publish_ns=_int(d, "publish_ns"),
        flags=HeaderFlags(_int(d, "flags") & 3),
    )
    sample = Sample(h, body[off : off + n], _int(d, "receive_ns"))
    return Member(sample, _int(d, "stamp_ns"), _int(d, "skew_ns"), bool(d.get("fallback")))


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
        meta = json.loads(mv[8 : 8 + meta_len].tobytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise EncodingError(f"frame metadata is not valid JSON: {err}") from err
    if not isinstance(meta, dict) or not isinstance(meta.get("members"), list):
        raise EncodingError("frame metadata must be an object with a members list")
    raw_members = meta["members"]
    if len(raw_members) > lim.max_frame_members:
        raise EncodingError(
            f"frame has {len(raw_members)} members, limit max_frame_members {lim.max_frame_members}"
        )
    body = mv[8 + meta_len :]
    members: dict[str, list[Member]] = {}
    for d in raw_members:
        member = _member(d, body, lim)
        members.setdefault(member.sample.stream, []).append(member)
    try:
        missing = tuple(str(x) for x in meta.get("missing", []))
        interp = {str(k): float(v) for k, v in dict(meta.get("interpolation", {})).items()}
        return MultiModalFrame(
            bucket=_int(meta, "bucket"),
            start_ns=_int(meta, "start_ns"),
            end_ns=_int(meta, "end_ns"),
            reference_stamp_ns=_int(meta, "reference_stamp_ns"),
            members={k: tuple(v) for k, v in members.items()},
            missing=missing,
            complete=bool(meta.get("complete")),
            late_count=_int(meta, "late_count"),
            max_skew_ns=_int(meta, "max_skew_ns"),
            interpolation=interp,
            forced=bool(meta.get("forced")),
            pane=_int(meta, "pane"),
            last_arrival_ns=_int(meta, "last_arrival_ns"),
            skew_measured=bool(meta.get("skew_measured", True)),
        )
    except (TypeError, ValueError) as err:
        raise EncodingError(f"frame metadata is malformed: {err}") from err


def frame_summary(frame: MultiModalFrame, emitted_ns: int) -> dict[str, Any]:
    """One JSON-ready line per frame: bucket, members with stamps, missing, skew, latency
    (``end_to_end_ms`` None where the stamps are not on the wall clock)."""
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
        "max_skew_ms": round(frame.max_skew_ns / 1e6, 3),
        "late_count": frame.late_count,
        "added_latency_ms": round((emitted_ns - frame.last_arrival_ns) / 1e6, 3)
        if frame.last_arrival_ns
        else None,
        "end_to_end_ms": None if e2e is None else round(e2e, 3),
        "emitted_ns": emitted_ns,
    }
