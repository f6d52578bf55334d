"""Fused frames as message_filters-style sets (``embodied_bus.fusion.sets``): one member per
stream, the nearest where a stream has several, and a named reason for every frame without a
set."""

from __future__ import annotations

import pytest

from embodied_bus.fusion import Member, MultiModalFrame
from embodied_bus.fusion.sets import DroppedSet, DropReason, FrameSets, MemberSet
from embodied_bus.model import Header, Modality, Sample

MS = 1_000_000


def member(stream: str, stamp_ms: float) -> Member:
    stamp = int(stamp_ms * MS)
    h = Header(
        stream=stream, modality=Modality.OTHER, seq=1, stamp_ns=stamp, bucket=0, bucket_width_ns=100 * MS,
        bucket_offset_ns=0, encoding="raw", frame_id="", publisher_id=1, publish_ns=stamp,
    )  # fmt: skip
    return Member(Sample(h, stream.encode(), stamp), stamp, 0)


def frame(ref_ms: float, **members: list[float]) -> MultiModalFrame:
    by_stream = {
        s.replace("_", "/"): tuple(member(s.replace("_", "/"), t) for t in ts) for s, ts in members.items()
    }
    return MultiModalFrame(
        bucket=0, start_ns=0, end_ns=100 * MS, reference_stamp_ns=int(ref_ms * MS), members=by_stream,
        missing=(), complete=True,
    )  # fmt: skip


def test_a_set_has_one_member_per_stream_in_the_subscribers_order_the_nearest_of_several() -> None:
    sets = FrameSets(["camera", "lidar", "imu"], slop_ns=50 * MS)
    got = sets.take(frame(100, lidar=[100], camera=[88], imu=[60, 80, 97, 104, 120]))
    assert isinstance(got, MemberSet)
    assert [s.stream for s in got.samples] == ["camera", "lidar", "imu"]
    assert [s.stamp_ns // MS for s in got.samples] == [88, 100, 97]
    assert got.span_ns == 12 * MS


def test_a_frame_without_a_set_says_why_and_a_frame_seen_twice_is_taken_once() -> None:
    sets = FrameSets(["lidar", "camera"], slop_ns=20 * MS)
    missing = sets.take(frame(100, lidar=[100]))
    assert missing == DroppedSet(DropReason.MISSING, 100 * MS, "camera")
    wide = sets.take(frame(200, lidar=[200], camera=[175]))
    assert isinstance(wide, DroppedSet) and wide.reason is DropReason.SLOP
    assert wide.detail == "span 25.0 ms > slop 20 ms"
    assert isinstance(sets.take(frame(300, lidar=[300], camera=[310])), MemberSet)
    assert sets.take(frame(300, lidar=[300], camera=[310])) is None  # a duplicate from another worker
    exact = FrameSets(["lidar", "camera"], slop_ns=0)
    assert isinstance(exact.take(frame(100, lidar=[100], camera=[100])), MemberSet)
    assert isinstance(exact.take(frame(200, lidar=[200], camera=[201])), DroppedSet)


@pytest.mark.parametrize(
    ("streams", "slop_ns", "error"),
    [([], 0, "at least one"), (["a", "a"], 0, "once per synchronizer"), (["a"], -1, "slop must be >= 0")],
)
def test_bad_synchronizer_arguments_are_refused_by_name(streams: list[str], slop_ns: int, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        FrameSets(streams, slop_ns)
