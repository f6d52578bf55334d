"""Replay of every shared recording into a real Zenoh bus; timing at rate 1."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from embodied_bus import BusConfigError, SubscriptionOptions, open_bus
from embodied_bus.model import HeaderFlags
from embodied_bus.replay import (
    RecordedMessage,
    RecordingError,
    ReplayOptions,
    read_recording,
    recording_info,
    replay,
)
from embodied_bus.rosmsg import ConversionError, decode_cdr

from conftest import wait_until, zenoh_urls
from recordings import RECORDINGS, recording


def all_recordings() -> list[Path]:
    found = sorted(
        {p.parent for p in RECORDINGS.rglob("metadata.yaml")}
        | set(RECORDINGS.rglob("*.bag"))
        | set(RECORDINGS.rglob("sample.db3"))
    )
    return [p for p in found if not (p.parent / "metadata.yaml").exists() or p.suffix != ".db3"]


RECS = all_recordings()


def test_the_shared_recordings_are_all_found() -> None:
    assert len(RECS) == 12, RECS


@pytest.mark.parametrize("path", RECS, ids=[str(p.relative_to(RECORDINGS)) for p in RECS])
async def test_every_recording_replays_each_message_decoded_or_skipped_with_a_reason(path: Path) -> None:
    info = recording_info(path)
    decoded = sum(1 for m in read_recording(path) if isinstance(m, RecordedMessage))  # all decoded
    url, _ = zenoh_urls()
    async with open_bus(url, namespace="rp") as bus:
        summary = await replay(bus, [path], ReplayOptions(fast=True))
    doc = summary.as_dict()
    skipped_topics = set(doc["skipped"])
    assert all(reason for reason in doc["skipped"].values())
    assert doc["total"] > 0
    assert set(doc["messages"]) | skipped_topics == {t for t, n in info.counts.items() if n}
    assert all(doc["messages"][t] == info.counts[t] for t in doc["messages"])  # every message
    assert decoded == doc["total"]
    if "uf_gps_nav_vehicle" in str(path):
        assert set(doc["skipped"]) == {"/vehicle_command_ackermann"}
        assert "ackermann_msgs/msg/AckermannDriveStamped" in doc["skipped"]["/vehicle_command_ackermann"]
    elif "byu_cougar" in str(path):
        assert all("definition" not in r or "Jazzy" in r for r in doc["skipped"].values())
    else:
        assert not skipped_topics


async def test_replayed_samples_carry_cdr_header_stamps_and_flag_zero_stamps() -> None:
    path = recording("uf_gps_nav_vehicle", "bag")
    url_a, url_b = zenoh_urls()
    async with open_bus(url_a, namespace="rp2") as a, open_bus(url_b, namespace="rp2") as b:
        sub = await b.subscribe(None, options=SubscriptionOptions(capacity=100_000))
        await asyncio.sleep(0.5)
        opts = ReplayOptions(fast=True, topics=("/gps", "/vehicle_pose"), mapping={"/gps": "gnss"})
        summary = await replay(a, [path], opts)
        total = summary.as_dict()["total"]
        got = []
        while len(got) < total:
            got.append(await sub.recv(timeout_s=20))
    gnss = [s for s in got if s.stream == "gnss"]
    pose = [s for s in got if s.stream == "vehicle_pose"]
    assert len(gnss) == 107 and len(pose) == 2034
    fix = decode_cdr(gnss[0].payload, "sensor_msgs/msg/NavSatFix")
    assert 29.6 < fix.latitude < 29.7
    assert gnss[0].header.encoding == "cdr:sensor_msgs/msg/NavSatFix"
    assert gnss[0].stamp_ns == fix.header.stamp.sec * 10**9 + fix.header.stamp.nanosec
    assert all(s.header.flags & HeaderFlags.STAMP_FALLBACK for s in pose)  # zero header stamps
    assert [s.seq for s in gnss] == list(range(1, 108))


@pytest.mark.flaky(reruns=1)  # wall-clock timing on a noisy CI machine
async def test_rate_1_replay_keeps_faithful_timing() -> None:
    url, _ = zenoh_urls()
    async with open_bus(url, namespace="rp3") as bus:
        summary = await replay(
            bus,
            [recording("plotjuggler_tilt_laser", "tilt_laser.bag")],
            ReplayOptions(duration_s=2.0, start_s=1.0),
        )
    doc = summary.as_dict()
    assert 1.9 < doc["wall_s"] < 3.0  # 2 s of recording take ~2 s (no drift, no hurry)
    # Loose: CI machines are noisy (one loaded run showed a 0.2 s stall); bench/replay.py measures.
    assert doc["timing_error_p50_ms"] < 5 and doc["timing_error_p99_ms"] < 1000


def test_bad_replay_input_gets_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(RecordingError, match="does not exist"):
        recording_info(tmp_path / "nope.bag")
    (tmp_path / "junk.bag").write_bytes(b"not a bag")
    with pytest.raises(RecordingError, match="cannot open"):
        recording_info(tmp_path / "junk.bag")
    with pytest.raises(BusConfigError, match="rate"):
        ReplayOptions(rate=0)
    with pytest.raises(BusConfigError, match="stamp"):
        ReplayOptions(stamp="gps")
    with pytest.raises(ConversionError):
        decode_cdr(b"\x00\x01\x00\x00", "sensor_msgs/msg/NavSatFix")


@pytest.mark.flaky(reruns=1)  # two sessions and a recorder under CI load
async def test_record_then_replay_gives_identical_payloads_and_stamps(tmp_path: Path) -> None:
    from embodied_bus.replay import RecordedMessage, read_recording
    from embodied_bus.replay.recorder import record

    src = recording("plotjuggler_tilt_laser", "tilt_laser.bag")
    topics = ("/scan", "/imu_data", "/position_gps")
    out = tmp_path / "rt.mcap"
    url_a, url_b = zenoh_urls()
    async with open_bus(url_a, namespace="rt") as a, open_bus(url_b, namespace="rt") as b:
        stop, ready = asyncio.Event(), asyncio.Event()
        live: dict[str, int] = {}
        task = asyncio.create_task(
            record(b, out, ["scan", "imu_data", "position_gps"], stop, ready=ready, counts=live)
        )
        await ready.wait()
        probe = await a.publisher("scan")
        assert await probe.wait_for_subscribers(10)
        await probe.close()
        summary = await replay(a, [src], ReplayOptions(fast=True, topics=topics))
        assert summary.as_dict()["total"] == 890
        await wait_until(lambda: sum(live.values()) >= 890, 30, "the recorder wrote all 890 messages")
        stop.set()
        counts = await task
    assert counts == {"/scan": 178, "/imu_data": 356, "/position_gps": 356}
    original = [m for m in read_recording(src, topics=topics) if isinstance(m, RecordedMessage)]
    again = [m for m in read_recording(out) if isinstance(m, RecordedMessage)]
    key = lambda ms: sorted((m.topic, m.stamp_ns, m.cdr) for m in ms)  # noqa: E731
    assert key(original) == key(again)
    assert {m.msgtype for m in again} == {
        "sensor_msgs/msg/LaserScan",
        "sensor_msgs/msg/Imu",
        "sensor_msgs/msg/NavSatFix",
    }


@pytest.mark.parametrize(
    "parts",
    [("robot_localization_husky_gps", "test1.bag"), ("plotjuggler_tilt_laser", "tilt_laser.bag")],
)
def test_ros1_bytes_converted_directly_equal_the_decoded_and_reserialized_messages(
    parts: tuple[str, str],
) -> None:
    from embodied_bus.replay import SkippedTopic, read_recording

    def rows(decode: bool) -> list[tuple[str, bytes, int, str]]:
        return [
            (m.topic, m.cdr, m.stamp_ns, m.frame_id)
            for m in read_recording(recording(*parts), decode=decode)
            if not isinstance(m, SkippedTopic)
        ]

    fast, slow = rows(False), rows(True)
    assert len(fast) > 1000 and fast == slow
