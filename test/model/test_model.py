"""Pure logic: wire header, bucket clock, npy encoding (no engine involved)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from embodied_bus import BusConfigError, EncodingError, HeaderError
from embodied_bus.model import (
    BucketClock,
    Header,
    HeaderFlags,
    Modality,
    decode_header,
    decode_npy,
    decode_properties,
    encode_header,
    encode_npy,
    encode_properties,
    validate_stream_name,
)
from embodied_bus.model.batches import decode_batch, encode_batch, is_batch, split_batch
from embodied_bus.model.header import HeaderPacker, with_header_flags

BASE = Header(
    stream="lidar/front",
    modality=Modality.LIDAR,
    seq=1,
    stamp_ns=1_700_000_000_123_456_789,
    bucket=17_000_000_001,
    bucket_width_ns=100_000_000,
    bucket_offset_ns=0,
    encoding="cdr:sensor_msgs/msg/PointCloud2",
    frame_id="lidar_front",
    publisher_id=0xDEADBEEF01234567,
    publish_ns=1_700_000_000_200_000_000,
)


@pytest.mark.parametrize("modality", list(Modality))
@pytest.mark.parametrize("flags", [HeaderFlags.NONE, HeaderFlags.STAMP_FALLBACK, HeaderFlags.SHM])
def test_header_round_trips_through_binary_and_properties(modality: Modality, flags: HeaderFlags) -> None:
    h = BASE._replace(modality=modality, flags=flags)
    assert decode_header(encode_header(h)) == h
    assert decode_properties(encode_properties(h)) == h


@pytest.mark.parametrize("flags", [HeaderFlags.NONE, HeaderFlags.STAMP_FALLBACK])
def test_flags_set_on_a_packed_header_change_nothing_else(flags: HeaderFlags) -> None:
    h = BASE._replace(flags=flags)
    assert decode_header(with_header_flags(encode_header(h), HeaderFlags.SHM)) == h._replace(
        flags=flags | HeaderFlags.SHM
    )
    with pytest.raises(HeaderError, match="too short"):
        with_header_flags(b"EB\x01", HeaderFlags.SHM)


@given(
    stream=st.from_regex(r"[A-Za-z0-9_\-]{1,12}(/[A-Za-z0-9_\-]{1,12}){0,3}", fullmatch=True),
    seq=st.integers(1, 2**64 - 1),
    stamp=st.integers(-(2**62), 2**62),
    width=st.integers(1, 2**40),
    frame=st.text(max_size=40),
    enc=st.text(max_size=40),
)
def test_any_valid_header_round_trips(
    stream: str, seq: int, stamp: int, width: int, frame: str, enc: str
) -> None:
    clock = BucketClock(width_ns=width)
    h = BASE._replace(
        stream=stream,
        seq=seq,
        stamp_ns=stamp,
        bucket=clock.bucket_of(stamp),
        bucket_width_ns=width,
        frame_id=frame,
        encoding=enc,
    )
    assert decode_header(encode_header(h)) == h
    assert decode_properties(encode_properties(h)) == h


@given(
    frame=st.text(max_size=40),
    modality=st.sampled_from(list(Modality)),
    seq=st.integers(1, 2**64 - 1),
    stamp=st.integers(-(2**62), 2**62),
    width=st.integers(1, 2**40),
    publish=st.integers(-(2**62), 2**62),
)
def test_the_header_packer_writes_the_bytes_encode_header_writes(
    frame: str, modality: Modality, seq: int, stamp: int, width: int, publish: int
) -> None:
    template = BASE._replace(frame_id=frame, modality=modality, bucket_width_ns=width)
    h = template._replace(seq=seq, stamp_ns=stamp, bucket=stamp // width, publish_ns=publish)
    assert HeaderPacker(template)(seq, stamp, stamp // width, publish) == encode_header(h)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b[:10], "too short"),
        (lambda b: b"XX" + b[2:], "magic"),
        (lambda b: b[:2] + b"\x09" + b[3:], "version 9"),
        (lambda b: b + b"extra", "length mismatch"),
        (lambda b: b[:4] + b"\xc8" + b[5:], "modality"),
    ],
    ids=["short", "magic", "version", "length", "modality"],
)
def test_malformed_binary_headers_are_rejected_with_the_reason(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(HeaderError, match=message):
        decode_header(mutate(encode_header(BASE)))


def test_a_batch_splits_back_into_its_samples_in_order() -> None:
    entries = [(encode_header(BASE._replace(seq=i)), bytes([i]) * i) for i in range(1, 6)]
    att, payload = encode_batch(entries)
    assert is_batch(att) and not is_batch(encode_header(BASE))
    assert split_batch(att, payload) == [(h, p) for h, p in entries]
    assert [decode_header(h).seq for h, _ in split_batch(att, payload)] == [1, 2, 3, 4, 5]


_PAYLOADS = {
    "growing": lambda i: bytes([i % 256]) * i,
    "equal": lambda i: bytes([i % 256]) * 8,
    "empty": lambda i: b"",
    "some-empty": lambda i: b"" if i % 3 else bytes([i % 256]),
}


@pytest.mark.parametrize("payloads", list(_PAYLOADS))
@pytest.mark.parametrize("count", [5, 40], ids=["small-batch", "one-pass-batch"])
@pytest.mark.parametrize("same_length", [True, False], ids=["one-publisher", "mixed-lengths"])
def test_a_decoded_batch_equals_its_samples_decoded_one_by_one(
    same_length: bool, count: int, payloads: str
) -> None:
    headers = [
        BASE._replace(seq=i, frame_id="f" if same_length else "f" * (i % 7)) for i in range(1, count + 1)
    ]
    entries = [(encode_header(h), _PAYLOADS[payloads](i)) for i, h in enumerate(headers, 1)]
    att, payload = encode_batch(entries)
    samples, errors = decode_batch(att, payload)
    assert errors == []
    assert samples == [(decode_header(h), p) for h, p in split_batch(att, payload)]
    assert [h for h, _ in samples] == headers


def test_a_failure_inside_the_one_pass_batch_decoder_falls_back_to_sample_by_sample(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from embodied_bus.model import batches

    def broken(*_args: object) -> None:
        raise ValueError("a bug")

    entries = [(encode_header(BASE._replace(seq=i)), b"p") for i in range(1, 41)]
    att, payload = encode_batch(entries)
    monkeypatch.setattr(batches, "decode_run", broken)
    samples, errors = decode_batch(att, payload)
    assert errors == [] and [h.seq for h, _ in samples] == list(range(1, 41))


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (lambda b: b"XX" + b[2:], "bad header magic"),
        (lambda b: b[:4] + b"\xc8" + b[5:], "unknown modality"),
        (lambda b: b[:-1] + b"\xff", "not UTF-8"),
        (lambda b: b[:3] + b"\x07" + b[4:], None),  # unknown flag bits: accepted, as one by one
    ],
    ids=["magic", "modality", "utf8", "flags"],
)
def test_a_bad_header_in_a_batch_costs_only_its_sample_and_says_why(spoil, message: str | None) -> None:  # type: ignore[no-untyped-def]
    raw = [encode_header(BASE._replace(seq=i)) for i in range(1, 4)]
    raw[1] = spoil(raw[1])
    att, payload = encode_batch([(h, b"p%d" % i) for i, h in enumerate(raw, 1)])
    samples, errors = decode_batch(att, payload)
    if message is None:
        assert errors == [] and [h.flags for h, _ in samples][1] == decode_header(raw[1]).flags
        return
    assert [(h.seq, p) for h, p in samples] == [(1, b"p1"), (3, b"p3")]
    with pytest.raises(HeaderError) as one_by_one:
        decode_header(raw[1])
    assert [str(e) for e in errors] == [str(one_by_one.value)] and message in str(errors[0])


def test_a_batch_is_refused_by_a_version_1_header_decoder_by_name() -> None:
    att, _ = encode_batch([(encode_header(BASE), b"x"), (encode_header(BASE._replace(seq=2)), b"y")])
    with pytest.raises(HeaderError, match="unsupported header version 177"):
        decode_header(att)


@pytest.mark.parametrize(
    ("cut", "message"),
    [
        (lambda att, p: (att[:5], p), "batch head too short"),
        (lambda att, p: (att[:-1], p), "batch lengths do not add up"),
        (lambda att, p: (att, p + b"extra"), "payloads 2 vs 7 bytes"),
        (lambda att, p: (att[:4] + b"\0\0\0\0" + att[8:], p), "batch of 0 samples"),
        (lambda att, p: (att[:12], p), "does not fit"),
    ],
)
def test_a_malformed_batch_is_refused_with_the_reason(cut, message: str) -> None:  # type: ignore[no-untyped-def]
    att, payload = encode_batch([(encode_header(BASE), b"x"), (encode_header(BASE._replace(seq=2)), b"y")])
    with pytest.raises(HeaderError, match=message):
        split_batch(*cut(att, payload))


def test_a_header_with_sequence_zero_is_rejected() -> None:
    with pytest.raises(HeaderError, match="sequence number 0"):
        decode_header(encode_header(BASE._replace(seq=0)))


def _layout1_properties(h: Header) -> dict[str, str]:
    """The thirteen properties earlier builds wrote (layout 1)."""
    return {
        "eb.v": "1",
        "eb.stream": h.stream,
        "eb.modality": h.modality.name.lower(),
        "eb.seq": str(h.seq),
        "eb.stamp_ns": str(h.stamp_ns),
        "eb.bucket": str(h.bucket),
        "eb.width_ns": str(h.bucket_width_ns),
        "eb.offset_ns": str(h.bucket_offset_ns),
        "eb.encoding": h.encoding,
        "eb.frame_id": h.frame_id,
        "eb.pub": format(h.publisher_id, "016x"),
        "eb.pub_ns": str(h.publish_ns),
        "eb.flags": str(int(h.flags)),
    }


def test_pulsar_properties_are_one_compact_text_that_keeps_any_encoding_and_frame_id() -> None:
    h = BASE._replace(encoding="raw|rgb8:2x2", frame_id="cam|left ü")
    props = encode_properties(h)
    assert list(props) == ["eb.h"] and props["eb.h"].startswith("2|lidar/front|lidar|1|")
    assert decode_properties(props) == h
    assert decode_properties({**props, "other": "x"}) == h  # foreign properties are ignored


def test_properties_written_by_earlier_builds_still_decode() -> None:
    assert decode_properties(_layout1_properties(BASE)) == BASE


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (3, "soon", r"field seq is not an integer: 'soon'"),
        (5, "1.5", r"field bucket is not an integer"),
        (8, "xyz", r"field pub is not an integer"),
        (1, "li dar", r"invalid stream name 'li dar'"),
        (2, "sonar", r"unknown modality 'sonar'"),
        (0, "9", r"unsupported eb.h layout '9'"),
        (11, "999", r"encoding_len 999"),
    ],
)
def test_a_malformed_compact_header_names_the_field(field: int, value: str, message: str) -> None:
    parts = encode_properties(BASE)["eb.h"].split("|", 12)
    parts[field] = value
    with pytest.raises(HeaderError, match=message):
        decode_properties({"eb.h": "|".join(parts)})
    with pytest.raises(HeaderError, match="fields, expected 13"):
        decode_properties({"eb.h": "2|lidar/top|lidar"})


def test_properties_missing_or_malformed_name_the_key() -> None:
    with pytest.raises(HeaderError, match=r"eb\.h"):
        decode_properties({"unrelated": "1"})
    props = _layout1_properties(BASE)
    del props["eb.stamp_ns"]
    with pytest.raises(HeaderError, match=r"eb\.stamp_ns"):
        decode_properties(props)
    props = _layout1_properties(BASE)
    props["eb.bucket"] = "soon"
    with pytest.raises(HeaderError, match=r"eb\.bucket"):
        decode_properties(props)


@pytest.mark.parametrize("name", ["", "/lidar", "lidar/", "li dar", "a//b", "a.b", "ü"])
def test_invalid_stream_names_are_refused(name: str) -> None:
    with pytest.raises(HeaderError, match="invalid stream name"):
        validate_stream_name(name)


def test_bucket_clock_floors_with_phase_offset() -> None:
    c = BucketClock(width_ns=100, offset_ns=30)
    assert [c.bucket_of(s) for s in (29, 30, 129, 130, -71, -70)] == [-1, 0, 0, 1, -2, -1]
    assert c.start_ns(1) == 130 and c.end_ns(1) == 230


@pytest.mark.parametrize(("width", "offset"), [(0, 0), (-5, 0), (100, 100), (100, -1)])
def test_bucket_clock_rejects_bad_width_or_offset(width: int, offset: int) -> None:
    with pytest.raises(BusConfigError):
        BucketClock(width_ns=width, offset_ns=offset)


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.asfortranarray(np.arange(12, dtype=np.int16).reshape(3, 4)),
        np.zeros(5, dtype=[("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("ring", "<u2")]),
        np.arange(10, dtype=">u4"),
        np.zeros((0, 3)),
        np.arange(20)[::2],
    ],
    ids=["f32", "fortran", "structured", "big-endian", "empty", "strided"],
)
def test_npy_round_trip_is_a_zero_copy_view(array: np.ndarray) -> None:  # type: ignore[type-arg]
    blob = bytes(encode_npy(array))
    out = decode_npy(blob)
    assert out.dtype == array.dtype and out.shape == array.shape
    assert np.array_equal(out, array)
    assert np.shares_memory(out, np.frombuffer(blob, np.uint8)) or out.size == 0
    assert np.array_equal(np.load(__import__("io").BytesIO(blob)), array)  # numpy reads it too


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"not npy", "magic"),
        (b"\x93NUMPY\x09\x00" + b"\x00" * 10, "version"),
        (b"\x93NUMPY\x01\x00\xff\x00{", "past the end"),
    ],
)
def test_broken_npy_payloads_raise_encoding_errors(blob: bytes, message: str) -> None:
    with pytest.raises(EncodingError, match=message):
        decode_npy(blob)


def test_npy_with_a_truncated_body_names_the_size_mismatch() -> None:
    blob = bytes(encode_npy(np.arange(100, dtype=np.float64)))[:-8]
    with pytest.raises(EncodingError, match="size mismatch"):
        decode_npy(blob)


def test_headers_whose_strings_concatenate_alike_decode_distinctly() -> None:
    a = BASE._replace(stream="s0", encoding="0", frame_id="")
    b = BASE._replace(stream="s0", encoding="", frame_id="0")
    assert decode_header(encode_header(a)) == a
    assert decode_header(encode_header(b)) == b


def test_properties_of_one_publisher_decode_the_same_after_the_first_and_bad_fields_are_still_named() -> None:
    headers = [
        BASE._replace(seq=i, stamp_ns=BASE.stamp_ns + i, bucket=BASE.bucket + i, publish_ns=i)
        for i in range(1, 5)
    ]
    assert [decode_properties(encode_properties(h)) for h in headers] == headers
    good = encode_properties(headers[0])["eb.h"].split("|")
    for index, name in ((3, "seq"), (4, "stamp_ns"), (9, "pub_ns")):
        bad = "|".join([*good[:index], "x1", *good[index + 1 :]])
        with pytest.raises(HeaderError, match=f"field {name} is not an integer"):
            decode_properties({"eb.h": bad})
    zero = "|".join([*good[:3], "0", *good[4:]])
    with pytest.raises(HeaderError, match="seq must be >= 1"):
        decode_properties({"eb.h": zero})


def test_a_header_is_untracked_by_the_garbage_collector_and_keeps_the_named_tuple_conveniences() -> None:
    import gc
    import pickle

    assert not gc.is_tracked(BASE)
    stream, modality, seq, *_, flags = BASE
    assert (stream, modality, seq, flags) == ("lidar/front", Modality.LIDAR, 1, HeaderFlags.NONE)
    assert len(BASE) == len(Header._fields) == 12 and BASE[2] == 1 and BASE[-1] is HeaderFlags.NONE
    assert Header._fields[:3] == ("stream", "modality", "seq") and list(BASE[:2]) == [stream, modality]
    later = BASE._replace(seq=2)
    assert later.seq == 2 and BASE.seq == 1 and later > BASE and later != BASE
    assert BASE._asdict()["frame_id"] == "lidar_front" and list(BASE._asdict()) == list(Header._fields)
    assert {BASE: 1}[BASE._replace()] == 1 and pickle.loads(pickle.dumps(BASE)) == BASE
    assert BASE.bucket_start_ns == BASE.bucket * BASE.bucket_width_ns
    with pytest.raises(AttributeError):
        BASE.seq = 3  # type: ignore[misc]


def test_headers_decoded_from_a_batch_are_untracked_and_equal_to_the_encoded_ones() -> None:
    import gc

    headers = [BASE._replace(seq=i, stamp_ns=BASE.stamp_ns + i, publish_ns=i) for i in range(1, 41)]
    samples, errors = decode_batch(*encode_batch([(encode_header(h), b"p") for h in headers]))
    assert not errors and [h for h, _ in samples] == headers
    assert not any(gc.is_tracked(h) for h, _ in samples)
    header = decode_properties(encode_properties(BASE))
    assert header == BASE and not gc.is_tracked(header)


def test_a_batch_table_is_little_endian_u32_header_and_payload_lengths_interleaved() -> None:
    import struct

    h1, h2 = encode_header(BASE), encode_header(BASE._replace(seq=2, frame_id="f" * 300))
    att, payload = encode_batch([(h1, b"abc"), (h2, b"x" * 70_000)])
    assert att[:8] == struct.pack("<2sBxI", b"EB", att[2], 2) and payload == b"abc" + b"x" * 70_000
    assert att[8:24] == struct.pack("<4I", len(h1), 3, len(h2), 70_000) and att[24:] == h1 + h2


@pytest.mark.parametrize("sizes", [[3], [5, 5, 5, 5], [0, 7, 1_000, 2], [0, 0, 0]])
def test_a_column_batch_round_trips_to_the_headers_and_payloads_it_was_made_of(sizes: list[int]) -> None:
    import gc

    from embodied_bus.model.batches import COLUMN_LAYOUT, encode_column_batch

    n = len(sizes)
    headers = [
        BASE._replace(
            seq=10 + i, stamp_ns=BASE.stamp_ns + 3 * i, bucket=BASE.bucket + i // 2, publish_ns=50 + i
        )
        for i in range(n)
    ]
    payloads = [bytes([i]) * size for i, size in enumerate(sizes)]
    att, body = encode_column_batch(
        encode_header(headers[0]),
        [h.seq for h in headers],
        [h.stamp_ns for h in headers],
        [h.bucket for h in headers],
        [h.publish_ns for h in headers],
        payloads,
    )
    assert is_batch(att) and att[2] == COLUMN_LAYOUT and body == b"".join(payloads)
    samples, errors = decode_batch(att, bytes(body))
    assert not errors and samples == list(zip(headers, payloads, strict=True))
    assert not any(gc.is_tracked(h) for h, _ in samples)
    with pytest.raises(HeaderError, match="not a table batch"):
        split_batch(att, bytes(body))


def _column_batch(**changes: object) -> tuple[bytes, bytes]:
    from embodied_bus.model.batches import encode_column_batch

    cols: dict[str, object] = {
        "first": encode_header(BASE._replace(seq=4)),
        "seqs": [4, 5],
        "stamps_ns": [BASE.stamp_ns, BASE.stamp_ns + 1],
        "buckets": [BASE.bucket] * 2,
        "publish_ns": [BASE.publish_ns] * 2,
        "payloads": [b"ab", b"c"],
    }
    cols.update(changes)
    att, body = encode_column_batch(**cols)  # type: ignore[arg-type]
    return att, bytes(body)


@pytest.mark.parametrize(
    ("att", "payload", "message"),
    [
        (_column_batch()[0][:10], b"abc", "column batch head too short"),
        (_column_batch()[0][:-1], b"abc", "needs"),
        (_column_batch()[0], b"abcd", "add up to 3 bytes, not 4"),
        (*_column_batch(seqs=[5, 6]), "first header and the first row of the columns differ"),
        (*_column_batch(first=encode_header(BASE._replace(seq=0)), seqs=[0, 1]), "seq"),
        (*_column_batch(seqs=[4, 0]), "sequence number 0"),
        (b"EB\xb2\x00" + (0).to_bytes(4, "little") + bytes(4), b"", "batch of 0 samples"),
    ],
)
def test_a_malformed_column_batch_is_rejected_by_name(att: bytes, payload: bytes, message: str) -> None:
    with pytest.raises(HeaderError, match=message):
        decode_batch(att, payload)


def test_column_batch_columns_must_have_one_entry_per_payload() -> None:
    from embodied_bus.model.batches import encode_column_batch

    with pytest.raises(ValueError, match="columns of other lengths"):
        encode_column_batch(encode_header(BASE), [1], [1], [1], [1, 2], [b"x"])
