"""Hostile input: every decoder that reads bytes from the network, fuzzed with hypothesis.

Each decoder must return a value or raise its own clear error (never another exception), finish
quickly (hypothesis deadline) and allocate little (tracemalloc peak per example). Inputs are
random bytes and mutations of valid messages (bit flips, truncation, extension, hostile fields).
Scale with ``EMBODIED_BUS_FUZZ_EXAMPLES`` (default 200 per target in the test command; the
closing note records a longer run).
"""

from __future__ import annotations

import json
import os
import struct
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embodied_bus.actions.model import Action, ActionError, decode_action, encode_action
from embodied_bus.errors import EncodingError, HeaderError
from embodied_bus.fusion.codec import decode_frame, encode_frame
from embodied_bus.fusion.frame import Member, MultiModalFrame
from embodied_bus.model.batches import decode_batch, encode_batch, encode_column_batch, split_batch
from embodied_bus.model.encoding import decode_npy, encode_npy
from embodied_bus.model.header import (
    Header,
    HeaderFlags,
    HeaderPacker,
    Modality,
    decode_header,
    encode_header,
)
from embodied_bus.model.limits import DecodeLimits
from embodied_bus.model.properties import decode_properties, encode_properties
from embodied_bus.model.sample import Sample
from embodied_bus.ros.bridge_core import parse_submission, string_from_cdr
from embodied_bus.rosmsg.conversions import (
    ConversionError,
    array_to_compressed_image_cdr,
    array_to_image_cdr,
    array_to_pointcloud2_cdr,
    decode_cdr,
    pointcloud2_to_array,
    sample_to_numpy,
    typestore,
)
from embodied_bus.rosmsg.rmw_zenoh import RmwZenohError, unpack_attachment
from embodied_bus.security import (
    ActionRejected,
    AllowedKey,
    AllowList,
    Signer,
    Verifier,
    generate_private_key,
)
from embodied_bus.security.keys import public_key_b64

EXAMPLES = int(os.environ.get("EMBODIED_BUS_FUZZ_EXAMPLES", "200"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=2000,  # ms per example: no hangs
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=os.environ.get("EMBODIED_BUS_FUZZ_RANDOM") != "1",
)
#: Peak Python/NumPy allocation allowed while decoding one input (bytes).
PEAK_BYTES = 48 * 1024 * 1024


@contextmanager
def bounded_memory(extra: int = 0) -> Iterator[None]:
    tracemalloc.start()
    try:
        yield
        _, peak = tracemalloc.get_traced_memory()
        assert peak < PEAK_BYTES + extra, f"decoder allocated {peak} bytes"
    finally:
        tracemalloc.stop()


def only(errors: tuple[type[BaseException], ...], fn: Callable[[], Any], extra: int = 0) -> Any:
    """Run ``fn``: it may return or raise one of ``errors``; anything else fails the test."""
    with bounded_memory(extra):
        try:
            return fn()
        except errors:
            return None


@st.composite
def mutated(draw: st.DrawFn, valid: bytes) -> bytes:
    """A valid message with bytes flipped, cut or appended."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(0, 8))):
        if data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
    cut = draw(st.integers(0, len(data)))
    data = data[: cut if draw(st.booleans()) else len(data)]
    return bytes(data) + draw(st.binary(max_size=16))


HEADER = Header(
    stream="lidar/top",
    modality=Modality.LIDAR,
    seq=7,
    stamp_ns=1_700_000_000_000_000_000,
    bucket=17_000_000_000,
    bucket_width_ns=100_000_000,
    bucket_offset_ns=0,
    encoding="cdr:sensor_msgs/msg/PointCloud2",
    frame_id="velodyne",
    publisher_id=42,
    publish_ns=1_700_000_000_000_000_100,
    flags=HeaderFlags(0),
)


BATCH = encode_batch([(encode_header(HEADER), b"abc"), (encode_header(HEADER._replace(seq=8)), b"")])


_PACK = HeaderPacker(HEADER)
COLUMN_BATCH = encode_column_batch(
    _PACK(7, HEADER.stamp_ns, HEADER.bucket, HEADER.publish_ns),
    [7, 8, 9],
    [HEADER.stamp_ns, HEADER.stamp_ns + 5, HEADER.stamp_ns + 9],
    [HEADER.bucket] * 3,
    [HEADER.publish_ns, HEADER.publish_ns + 1, HEADER.publish_ns + 2],
    [b"abc", b"", b"de"],
)


@FUZZ
@given(mutated(COLUMN_BATCH[0]), st.one_of(st.just(bytes(COLUMN_BATCH[1])), st.binary(max_size=16)))
def test_column_batches_decode_to_whole_samples_or_raise_header_error(att: bytes, payload: bytes) -> None:
    got = only((HeaderError,), lambda: decode_batch(att, payload))
    if got is not None:
        samples, errors = got
        assert samples and not errors and b"".join(p for _, p in samples) == payload
        assert all(h.seq > 0 for h, _ in samples)


@FUZZ
@given(mutated(BATCH[0]), st.one_of(st.just(BATCH[1]), st.binary(max_size=16)))
def test_sample_batches_split_into_whole_samples_or_raise_header_error(att: bytes, payload: bytes) -> None:
    entries = only((HeaderError,), lambda: split_batch(att, payload))
    if entries is not None:
        assert entries and b"".join(p for _, p in entries) == payload


@FUZZ
@given(mutated(BATCH[0]), st.one_of(st.just(BATCH[1]), st.binary(max_size=16)))
def test_decoded_batches_agree_with_decoding_each_sample(att: bytes, payload: bytes) -> None:
    got = only((HeaderError,), lambda: decode_batch(att, payload))
    if got is None:
        return
    samples, errors = got
    one_by_one = []
    for raw, body in split_batch(att, payload):
        h = only((HeaderError,), lambda raw=raw: decode_header(raw))  # type: ignore[misc]
        if h is not None:
            one_by_one.append((h, body))
    assert samples == one_by_one
    assert len(samples) + len(errors) == len(split_batch(att, payload))


@FUZZ
@given(
    st.one_of(
        st.just(f"177|{len(BATCH[0])}"),
        st.text(max_size=24),
        st.integers(-5, 400).map(lambda n: f"177|{n}"),
    ),
    st.one_of(st.just(BATCH[0] + BATCH[1]), mutated(BATCH[0] + BATCH[1])),
)
def test_pulsar_batch_messages_decode_or_raise_header_error(prop: str, data: bytes) -> None:
    from embodied_bus.engines.pulsar import decode_batch_message

    got = only((HeaderError,), lambda: decode_batch_message(prop, data))
    if got is not None:
        samples, errors = got
        assert len(samples) + len(errors) >= 1
    if prop == f"177|{len(BATCH[0])}" and data == BATCH[0] + BATCH[1]:
        assert got is not None and [h.seq for h, _ in got[0]] == [7, 8]


@FUZZ
@given(st.one_of(st.binary(max_size=256), mutated(encode_header(HEADER))))
def test_sample_headers_decode_or_raise_header_error(data: bytes) -> None:
    h = only((HeaderError,), lambda: decode_header(data))
    if h is not None:
        assert h.seq >= 1 and h.bucket_width_ns > 0


_COMPACT = encode_properties(HEADER)["eb.h"]


@FUZZ
@given(
    st.one_of(
        st.text(max_size=200),
        st.builds(
            lambda cut, insert: _COMPACT[:cut] + insert + _COMPACT[cut + 1 :],
            st.integers(0, len(_COMPACT)),
            st.text(max_size=8),
        ),
    ),
    st.dictionaries(
        st.sampled_from(["eb.v", "eb.seq", "eb.stream", "eb.flags"]), st.text(max_size=30), max_size=4
    ),
)
def test_pulsar_properties_decode_or_raise_header_error(compact: str, layout1: dict[str, str]) -> None:
    h = only((HeaderError,), lambda: decode_properties({"eb.h": compact}))
    if h is not None:
        assert h.seq >= 1 and h.bucket_width_ns > 0
    only((HeaderError,), lambda: decode_properties(layout1))


def _valid_frame() -> bytes:
    cdr = array_to_pointcloud2_cdr(np.zeros((4, 3), np.float32), frame_id="l", stamp_ns=1)
    m = Member(Sample(HEADER, cdr, 5), HEADER.stamp_ns, 0)
    f = MultiModalFrame(17, 0, 100, HEADER.stamp_ns, {"lidar/top": (m,)}, ("camera",), False, max_skew_ns=3)
    return bytes(encode_frame(f))


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=10), c, max_size=4),
    max_leaves=20,
)


@st.composite
def hostile_frame_meta(draw: st.DrawFn) -> bytes:
    valid = _valid_frame()
    (n,) = struct.unpack_from("<I", valid, 4)
    meta = json.loads(valid[8 : 8 + n])
    member = meta["members"][0]
    for key in draw(st.lists(st.sampled_from(sorted(member)), max_size=4)):
        member[key] = draw(JSON)
    if draw(st.booleans()):
        meta["members"] = meta["members"] * draw(st.integers(0, 50))
    raw = json.dumps(meta).encode()
    return valid[:4] + struct.pack("<I", len(raw)) + raw + valid[8 + n :]


@FUZZ
@given(st.one_of(st.binary(max_size=512), mutated(_valid_frame()), hostile_frame_meta()))
def test_frames_decode_or_raise_encoding_error(data: bytes) -> None:
    frame = only((EncodingError,), lambda: decode_frame(data, limits=DecodeLimits(max_frame_members=64)))
    if frame is not None:
        for members in frame.members.values():
            for m in members:
                assert len(m.sample.payload) <= len(data)


def _cdr(typename: str) -> bytes:
    ts = typestore()
    t = ts.types
    hdr = t["std_msgs/msg/Header"](stamp=t["builtin_interfaces/msg/Time"](sec=1, nanosec=2), frame_id="f")
    v3 = t["geometry_msgs/msg/Vector3"](x=1.0, y=2.0, z=3.0)
    if typename == "sensor_msgs/msg/PointCloud2":
        pts = np.zeros(5, dtype=[("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("i", "<u2")])
        return array_to_pointcloud2_cdr(pts, frame_id="f", stamp_ns=1)
    if typename == "sensor_msgs/msg/Image":
        return array_to_image_cdr(np.zeros((4, 5, 3), np.uint8), frame_id="f", stamp_ns=1)
    if typename == "sensor_msgs/msg/CompressedImage":
        return array_to_compressed_image_cdr(
            np.zeros((8, 8, 3), np.uint8), frame_id="f", stamp_ns=1, fmt="png"
        )
    if typename == "sensor_msgs/msg/NavSatFix":
        msg = t[typename](
            header=hdr,
            status=t["sensor_msgs/msg/NavSatStatus"](status=0, service=1),
            latitude=47.0,
            longitude=8.0,
            altitude=400.0,
            position_covariance=np.zeros(9),
            position_covariance_type=0,
        )
    elif typename == "sensor_msgs/msg/Imu":
        msg = t[typename](
            header=hdr,
            orientation=t["geometry_msgs/msg/Quaternion"](x=0.0, y=0.0, z=0.0, w=1.0),
            orientation_covariance=np.zeros(9),
            angular_velocity=v3,
            angular_velocity_covariance=np.zeros(9),
            linear_acceleration=v3,
            linear_acceleration_covariance=np.zeros(9),
        )
    else:
        msg = t[typename](
            header=hdr,
            angle_min=-1.0,
            angle_max=1.0,
            angle_increment=0.5,
            time_increment=0.0,
            scan_time=0.1,
            range_min=0.1,
            range_max=10.0,
            ranges=np.ones(5, np.float32),
            intensities=np.ones(5, np.float32),
        )
    return bytes(ts.serialize_cdr(msg, typename))


SENSOR_TYPES = [
    "sensor_msgs/msg/PointCloud2",
    "sensor_msgs/msg/Image",
    "sensor_msgs/msg/CompressedImage",
    "sensor_msgs/msg/NavSatFix",
    "sensor_msgs/msg/Imu",
    "sensor_msgs/msg/LaserScan",
]


@pytest.mark.parametrize("typename", SENSOR_TYPES)
def test_cdr_sensor_messages_convert_or_raise_conversion_error(typename: str) -> None:
    valid = _cdr(typename)
    header = HEADER._replace(encoding=f"cdr:{typename}")
    assert sample_to_numpy(Sample(header, valid, 0)) is not None

    @FUZZ
    @given(st.one_of(st.binary(max_size=256), mutated(valid)))
    def run(data: bytes) -> None:
        only((ConversionError,), lambda: sample_to_numpy(Sample(header, data, 0)))

    run()


@st.composite
def hostile_cloud(draw: st.DrawFn) -> Any:
    ts = typestore()
    t = ts.types
    fields = [
        t["sensor_msgs/msg/PointField"](
            name=draw(st.text(max_size=4)),
            offset=draw(st.integers(0, 2**32 - 1)),
            datatype=draw(st.integers(0, 255)),
            count=draw(st.integers(0, 2**32 - 1)),
        )
        for _ in range(draw(st.integers(0, 5)))
    ]
    hdr = t["std_msgs/msg/Header"](stamp=t["builtin_interfaces/msg/Time"](sec=0, nanosec=0), frame_id="")
    msg = t["sensor_msgs/msg/PointCloud2"](
        header=hdr,
        height=draw(st.integers(0, 2**32 - 1)),
        width=draw(st.integers(0, 2**32 - 1)),
        fields=fields,
        is_bigendian=draw(st.booleans()),
        point_step=draw(st.integers(0, 2**32 - 1)),
        row_step=draw(st.integers(0, 2**32 - 1)),
        data=np.frombuffer(draw(st.binary(max_size=256)), dtype=np.uint8),
        is_dense=True,
    )
    return bytes(ts.serialize_cdr(msg, "sensor_msgs/msg/PointCloud2"))


@FUZZ
@given(hostile_cloud())
def test_point_clouds_with_hostile_layouts_never_allocate_what_their_header_claims(cdr: bytes) -> None:
    def convert() -> Any:
        return pointcloud2_to_array(decode_cdr(cdr, "sensor_msgs/msg/PointCloud2"))

    arr = only((ConversionError,), convert)
    if arr is not None:
        assert arr.nbytes <= len(cdr)


def _envelope() -> bytes:
    return encode_action(Action("navigate_to", {"goal": [1.0, 2.0]}, priority=3))


@st.composite
def hostile_envelope(draw: st.DrawFn) -> bytes:
    d = json.loads(_envelope())
    for key in draw(st.lists(st.sampled_from([*sorted(d), "auth"]), max_size=5)):
        d[key] = draw(JSON)
    return json.dumps(d).encode()


@FUZZ
@given(st.one_of(st.binary(max_size=256), mutated(_envelope()), hostile_envelope()))
def test_action_envelopes_decode_or_raise_action_error(data: bytes) -> None:
    only((ActionError,), lambda: decode_action(data))


KEY = generate_private_key()
VERIFIER = Verifier(AllowList([AllowedKey("p", public_key_b64(KEY), frozenset({"*"}))]))


@FUZZ
@given(st.dictionaries(st.sampled_from(["v", "key", "nonce", "expires_ns", "aud", "sig"]), JSON, max_size=6))
def test_hostile_signature_blocks_are_rejected_never_crash(fields: dict[str, Any]) -> None:
    good = Signer(KEY, audience="r1").sign(Action("dock"))
    auth = {**(good.auth or {}), **fields}
    action = Action("dock", auth=auth, id=good.id)
    only((ActionRejected,), lambda: VERIFIER.verify(action))


@FUZZ
@given(st.one_of(st.binary(max_size=64), mutated(bytes(33))))
def test_rmw_attachments_and_ros_strings_decode_or_raise(data: bytes) -> None:
    only((RmwZenohError,), lambda: unpack_attachment(data))
    only((ValueError,), lambda: string_from_cdr(data))
    only((ValueError,), lambda: parse_submission(data.decode(errors="replace")))


@FUZZ
@given(st.one_of(st.binary(max_size=300), mutated(bytes(encode_npy(np.arange(6, dtype=np.float32))))))
def test_npy_payloads_decode_or_raise_encoding_error(data: bytes) -> None:
    only((EncodingError,), lambda: decode_npy(data))


def test_npy_headers_nested_to_exhaust_the_parser_are_rejected() -> None:
    text = ("(" * 100_000).encode()
    blob = b"\x93NUMPY\x02\x00" + struct.pack("<I", len(text)) + text
    with pytest.raises(EncodingError):
        decode_npy(blob)


def test_limits_are_configurable_and_named_in_errors() -> None:
    with pytest.raises(EncodingError, match="max_payload_bytes 10"):
        decode_frame(_valid_frame(), limits=DecodeLimits(max_payload_bytes=10))
    with pytest.raises(EncodingError, match="max_string_bytes"):
        decode_frame(_valid_frame(), limits=DecodeLimits(max_string_bytes=3))
    with pytest.raises(ConversionError, match="max_points"):
        pointcloud2_to_array(
            decode_cdr(_cdr("sensor_msgs/msg/PointCloud2"), "sensor_msgs/msg/PointCloud2"),
            limits=DecodeLimits(max_points=2),
        )
    with pytest.raises(ActionError, match="max_action_bytes"):
        decode_action(_envelope(), limits=DecodeLimits(max_action_bytes=10))
    with pytest.raises(Exception, match="positive integer"):
        DecodeLimits(max_points=0)


OPS = [
    "submit",
    "get",
    "ended",
    "cancel",
    "dead_letters",
    "requeue",
    "purge",
    "backlog",
    "take",
    "renew",
    "checkpoint",
    "report",
    "retire",
]
EXECUTOR = st.fixed_dictionaries({"name": st.text(max_size=8), "session": st.text(max_size=8)})


@st.composite
def hostile_request(draw: st.DrawFn) -> bytes:
    if draw(st.booleans()):
        return draw(st.binary(max_size=128))
    req: dict[str, Any] = {"op": draw(st.sampled_from(OPS) | st.text(max_size=5))}
    fields = [
        "actions",
        "executor",
        "kinds",
        "id",
        "ids",
        "leases",
        "lease",
        "reports",
        "max",
        "state",
        "labels",
    ]
    for key in draw(st.lists(st.sampled_from(fields), max_size=5)):
        req[key] = draw(EXECUTOR if key == "executor" else JSON)
    if draw(st.booleans()):
        req["actions"] = [
            json.loads(_envelope())
            | draw(
                st.dictionaries(st.sampled_from(["kind", "priority", "payload", "deadline_ns", "auth"]), JSON)
            )
        ]
    if draw(st.booleans()):
        req["reports"] = [
            draw(
                st.fixed_dictionaries(
                    {"id": st.text(max_size=4), "attempt": st.integers(-2, 3), "ok": st.booleans()},
                    optional={"result": JSON, "reason": JSON, "permanent": JSON},
                )
            )
        ]
    return json.dumps(req).encode()


def test_the_queue_service_answers_hostile_requests_and_keeps_serving(tmp_path: Path) -> None:
    import asyncio

    from embodied_bus import open_bus
    from embodied_bus.actions import QueueService
    from embodied_bus.testing.ports import free_port

    async def main() -> None:
        async with open_bus(f"zenoh:?listen=tcp/127.0.0.1:{free_port()}", namespace="fuzzq") as bus:
            svc = QueueService(bus, tmp_path / "q.db")

            @FUZZ
            @given(hostile_request())
            def run(data: bytes) -> None:
                reply = json.loads(svc.core.handle_bytes(data))
                assert isinstance(reply["r"], str)
                if reply["r"] == "error":
                    assert isinstance(reply["error"], str) and reply["error"]

            run()
            assert svc.bad_requests > 0
            good = json.loads(
                svc.core.handle_bytes(
                    json.dumps({"op": "submit", "actions": [json.loads(_envelope())]}).encode()
                )
            )
            assert good["r"] == "submitted" and good["actions"][0]["status"] == "queued"

    asyncio.run(main())


@st.composite
def sample_fields(draw: st.DrawFn) -> list[tuple[int, int, str, int]]:
    """(seq, stamp_ns, frame_id, payload size) per sample: half the time one publisher's run of
    same-shape samples (the one-pass decoder's case, empty payloads included), else mixed."""
    count = draw(st.integers(1, 40))
    seqs = draw(st.lists(st.integers(1, 2**40), min_size=count, max_size=count))
    stamps = draw(st.lists(st.integers(0, 2**62), min_size=count, max_size=count))
    if draw(st.booleans()):
        frame, size = draw(st.sampled_from(["velodyne", "base"])), draw(st.sampled_from([0, 3, 16]))
        return [(q, t, frame, size) for q, t in zip(seqs, stamps, strict=True)]
    frames = draw(st.lists(st.sampled_from(["velodyne", "base"]), min_size=count, max_size=count))
    sizes = draw(st.lists(st.sampled_from([0, 3, 16]), min_size=count, max_size=count))
    return list(zip(seqs, stamps, frames, sizes, strict=True))


@FUZZ
@given(sample_fields())
def test_any_batch_of_well_formed_samples_decodes_to_the_same_samples(
    fields: list[tuple[int, int, str, int]],
) -> None:
    headers = [HEADER._replace(seq=q, stamp_ns=t, frame_id=f) for q, t, f, _ in fields]
    entries = [
        (encode_header(h), bytes([i % 256]) * f[3])
        for i, (h, f) in enumerate(zip(headers, fields, strict=True))
    ]
    samples, errors = decode_batch(*encode_batch(entries))
    assert errors == []
    assert samples == [(h, p) for h, (_, p) in zip(headers, entries, strict=True)]


HOSTILE = Path(__file__).resolve().parents[1] / "data" / "hostile"


def _refuses(kind: str) -> Callable[[bytes], object]:
    """The decoder of ``kind`` and the error it refuses hostile bytes with, as one check."""
    from embodied_bus.actions import protocol
    from embodied_bus.actions.pulsar.records import parse_records
    from embodied_bus.security import AllowList, Refused, Role, Trust

    trust = Trust(AllowList())

    def refused(decode: Callable[[bytes], object], *errors: type[BaseException]) -> Callable[[bytes], object]:
        def check(data: bytes) -> object:
            with pytest.raises(errors):
                decode(data)
            return None

        return check

    return {
        "action": refused(decode_action, ActionError),
        "request": refused(protocol.decode_request, ActionError),
        "sealed": refused(lambda d: trust.open("request", d, [Role.PLANNER]), Refused),
        "records": lambda d: _records_or_refused(parse_records, d),
        "header": refused(decode_header, HeaderError),
        "recording": refused(lambda d: None, Exception),  # replaced below: needs a file
    }[kind]


def _records_or_refused(parse: Callable[[bytes], list[Any]], data: bytes) -> None:
    """A state-log message is refused whole, or read with its malformed records skipped."""
    try:
        records = parse(data)
    except ActionError:
        return
    assert all(isinstance(r.k, str) and isinstance(r.e, str) for r in records)


@pytest.mark.parametrize(
    "path",
    sorted(p for p in HOSTILE.rglob("*") if p.is_file() and p.suffix != ".md"),
    ids=lambda p: f"{p.parent.name}/{p.name}",
)
def test_the_hostile_corpus_is_refused_by_name(path: Path, tmp_path: Path) -> None:
    """Every file of ``test/data/hostile`` is refused by its decoder with that decoder's own
    error: no traceback, no recursion error, no hang."""
    kind = path.parent.name
    if kind == "recording":
        from embodied_bus.replay.reader import RecordingError, read_recording

        copy = tmp_path / path.name
        copy.write_bytes(path.read_bytes())
        with pytest.raises(RecordingError):
            list(read_recording(copy))
        return
    _refuses(kind)(path.read_bytes())
