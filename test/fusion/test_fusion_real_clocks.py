"""Fusion on sensor clocks as robots have them: drifting rates (a 10.03 Hz lidar, a 29.97 Hz
camera), jitter, a clock offset, stamp bursts under load, loss, ten-minute runs and real
recordings. Every sweep is in exactly one frame, every IMU sample too, every nearest member is
truly the nearest (checked by brute force over the whole run), and the online assembler gives
the offline computation's frames whatever the interleaving of the streams."""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import random
from collections import Counter
from pathlib import Path

import pytest

from embodied_bus.fusion import Assembler, MultiModalFrame, load_spec, spec_from_dict
from embodied_bus.fusion.offline import digest, frame_record, offline_frames
from embodied_bus.model import Header, HeaderFlags, Modality, Sample
from embodied_bus.replay import RecordedMessage, modality_of, read_recording, topic_to_stream
from embodied_bus.sim.scenario import REAL_CLOCKS, Scenario, generate

from recordings import recording

ROOT = Path(__file__).resolve().parents[2]
MS = 1_000_000
SPEC = load_spec(ROOT / "config" / "fusion.yaml")


def fuse(samples: list[Sample], spec=SPEC) -> tuple[list[MultiModalFrame], Assembler]:  # type: ignore[no-untyped-def]
    asm = Assembler(spec)
    frames = [e for s in samples for e in asm.push(s) if isinstance(e, MultiModalFrame) and e.pane == 0]
    frames += [e for e in asm.flush() if isinstance(e, MultiModalFrame)]
    return frames, asm


def uses(frames: list[MultiModalFrame], stream: str) -> Counter[tuple[int, int]]:
    return Counter(
        (m.sample.header.publisher_id, m.sample.seq) for f in frames for m in f.members.get(stream, ())
    )


def brute_force_nearest(samples: list[Sample], stream: str, t: int, bound_ns: int) -> int | None:
    """The stamp of the sample of ``stream`` nearest ``t`` within the bound (earlier on a tie)."""
    best: tuple[int, int] | None = None
    for s in samples:
        if s.stream == stream and abs(s.stamp_ns - t) <= bound_ns:
            key = (abs(s.stamp_ns - t), s.stamp_ns)
            if best is None or key < best:
                best = key
    return None if best is None else best[1]


def check_real_clock_frames(samples: list[Sample], frames: list[MultiModalFrame]) -> None:
    sweeps = [s for s in samples if s.stream == "lidar/top"]
    used = uses(frames, "lidar/top")
    assert len(used) == len(sweeps) and set(used.values()) == {1}, "a sweep is in no frame or in two"
    assert not [f for f in frames if not f.member("lidar/top") and "lidar/top" not in f.missing]
    # every IMU sample between the first frame's window and the last one's is in exactly one frame
    imu_stamps = [m.stamp_ns for f in frames for m in f.members.get("imu", ())]
    lo, hi = min(imu_stamps), max(imu_stamps)
    inside = {(s.header.publisher_id, s.seq) for s in samples if s.stream == "imu" and lo <= s.stamp_ns <= hi}
    imu = uses(frames, "imu")
    assert set(imu) == inside and set(imu.values()) == {1}
    edge = sum(1 for s in samples if s.stream == "imu") - len(inside)
    assert edge <= 25  # only those before the first sweep's window or after the last's
    # every camera member is the image truly nearest its sweep within the bound
    camera = sorted(s.stamp_ns for s in samples if s.stream == "camera/front")
    bound = SPEC.skew_ns(SPEC.stream("camera/front"))  # type: ignore[arg-type]
    for f in frames:
        t = f.reference_stamp_ns
        i, j = bisect.bisect_left(camera, t - bound), bisect.bisect_right(camera, t + bound)
        best = min(camera[i:j], key=lambda c: (abs(c - t), c)) if i < j else None
        got = f.member("camera/front")
        assert (got.stamp_ns if got else None) == best, f"frame at {t}: not the nearest image"


@pytest.mark.parametrize("name", sorted(REAL_CLOCKS))
def test_a_minute_on_real_sensor_clocks_puts_every_sweep_and_imu_sample_in_exactly_one_frame(
    name: str,
) -> None:
    sc = dataclasses.replace(REAL_CLOCKS[name], duration_s=60.0)
    samples = generate(sc)
    frames, asm = fuse(samples)
    check_real_clock_frames(samples, frames)
    assert digest(frame_record(f) for f in frames) == digest(offline_frames(SPEC, samples))
    assert asm.stats.late == 0
    if sc.loss:  # a lost sweep anchors a frame without it, where the lidar's cadence says
        lost_sweeps = 600 - sum(1 for s in samples if s.stream == "lidar/top")
        assert abs(asm.stats.reference_lost - lost_sweeps) <= 2
    else:
        assert asm.stats.reference_lost == 0 and asm.stats.forced <= 1  # the last frame at most


def test_ten_minutes_of_a_drifting_lidar_and_a_jittering_camera_lose_no_sweep() -> None:
    sc = Scenario(
        duration_s=600,
        rates_hz={"lidar/top": 10.03, "camera/front": 29.97, "imu": 199.8},
        jitter_ns={"camera/front": 6 * MS, "imu": 1 * MS},
        seed=11,
    )
    samples = generate(sc)
    frames, asm = fuse(samples)
    check_real_clock_frames(samples, frames)
    assert len(frames) == sum(1 for s in samples if s.stream == "lidar/top") == 6018
    assert digest(frame_record(f) for f in frames) == digest(offline_frames(SPEC, samples))
    # the lidar's phase walks through every position in its bucket: some buckets hold two sweeps
    per_bucket = Counter(f.bucket for f in frames)
    assert max(per_bucket.values()) == 2
    assert asm.buffered_samples < 100  # memory bounded by the picks' reach


def test_a_camera_clock_offset_in_the_spec_is_applied_before_the_nearest_image_is_picked() -> None:
    samples = generate(REAL_CLOCKS["lidar_10.1hz_camera_offset_20ms"])
    doc = dict(__import__("yaml").safe_load((ROOT / "config" / "fusion.yaml").read_text())["fusion"])
    doc["streams"]["camera/front"]["clock_offset_ms"] = -20  # the camera clock runs 20 ms ahead
    spec = spec_from_dict(doc)
    frames, _ = fuse(samples, spec)
    members = [m for f in frames for m in f.members.get("camera/front", ())]
    assert members and all(m.stamp_ns == m.sample.header.stamp_ns - 20 * MS for m in members)
    corrected = [
        Sample(s.header._replace(stamp_ns=s.stamp_ns - 20 * MS), s.payload, s.receive_ns)
        if s.stream == "camera/front"
        else s
        for s in samples
    ]
    for f in frames[::10]:
        got = f.member("camera/front")
        want = brute_force_nearest(corrected, "camera/front", f.reference_stamp_ns, 40 * MS)
        assert (got.stamp_ns if got else None) == want
    assert digest(frame_record(f) for f in frames) == digest(offline_frames(spec, samples))


def reinterleave(samples: list[Sample], seed: int, lag_ns: int, speedup: float = 1.0) -> list[Sample]:
    """The same samples, each stream in its own order, streams interleaved differently: each
    stream's arrival delayed by its own random lag (as separate topics of a broker may be),
    received ``speedup`` times faster than recorded (a fast replay)."""
    rng = random.Random(seed)
    lags = {name: rng.randrange(lag_ns) for name in sorted({s.stream for s in samples})}
    t0 = samples[0].receive_ns
    keyed = [
        (s.receive_ns + lags[s.stream] + rng.randrange(lag_ns // 10 + 1), i, s) for i, s in enumerate(samples)
    ]
    by_stream: dict[str, list[tuple[int, int, Sample]]] = {}
    for k in keyed:
        by_stream.setdefault(k[2].stream, []).append(k)
    out: list[tuple[int, int, Sample]] = []
    for items in by_stream.values():
        times = sorted(t for t, _, _ in items)  # keep each stream's own order
        out += [(t, i, s) for t, (_, i, s) in zip(times, sorted(items, key=lambda x: x[1]), strict=True)]
    return [Sample(s.header, s.payload, t0 + int((t - t0) / speedup)) for t, _, s in sorted(out)]


@pytest.mark.parametrize("seed", range(6))
def test_any_interleaving_of_the_streams_gives_the_same_frames(seed: int) -> None:
    """What a transport may do (separate topics of a broker, a replay 20 times faster than
    recorded, one topic 1.5 s of sensor time behind another, far past the lateness bound): the
    frames are the same, by digest, as long as each stream keeps its own order. A stream still
    delivering is waited for; only one silent for the lateness bound (receive times) is given
    up. A stream with ``max_delay_ms`` is given up by the other streams' stamps once it is
    silent that long: a sparse one (a 5 Hz GPS) may then lag by no more than that."""
    samples = generate(
        dataclasses.replace(REAL_CLOCKS["lidar_9.98hz_camera_29.97hz_jitter_3ms"], duration_s=20)
    )
    doc = dict(__import__("yaml").safe_load((ROOT / "config" / "fusion.yaml").read_text())["fusion"])
    del doc["streams"]["gps"]["max_delay_ms"]
    for spec, lag_ns, speedup in ((spec_from_dict(doc), 1500 * MS, 20.0), (SPEC, 45 * MS, 1.0)):
        frames, asm = fuse(reinterleave(samples, seed, lag_ns, speedup), spec)
        assert asm.stats.late == 0
        assert digest(frame_record(f) for f in frames) == digest(offline_frames(spec, samples))


def test_a_stall_of_every_stream_at_once_gives_up_none_of_them() -> None:
    """A paused process, a replay that stalls, a network blip: every stream silent for four
    times the lateness bound, then all of it at once. Nothing is given up or late."""
    samples = generate(REAL_CLOCKS["lidar_10.03hz"])
    cut = samples[0].receive_ns + 5 * 10**9
    stalled = [Sample(s.header, s.payload, s.receive_ns + 500 * MS * (s.receive_ns > cut)) for s in samples]
    frames, asm = fuse(stalled)
    assert asm.stats.late == 0 and asm.stats.reference_lost == 0 and asm.stats.forced <= 1
    assert digest(frame_record(f) for f in frames) == digest(offline_frames(SPEC, samples))


def recording_samples(path: Path, topics: list[str], names: dict[str, str] | None = None) -> list[Sample]:
    """The recording's messages as samples (stream names from the topics, or ``names``)."""
    seqs: dict[str, int] = {}
    out = []
    for m in read_recording(path, topics=topics):
        assert isinstance(m, RecordedMessage)
        stream = (names or {}).get(m.topic) or topic_to_stream(m.topic)
        seqs[stream] = seqs.get(stream, 0) + 1
        h = Header(
            stream=stream,
            modality=Modality.parse(modality_of(m.msgtype)),
            seq=seqs[stream],
            stamp_ns=m.stamp_ns,
            bucket=0,
            bucket_width_ns=1,
            bucket_offset_ns=0,
            encoding=f"cdr:{m.msgtype}",
            frame_id=m.frame_id,
            publisher_id=hash(stream) & 0xFFFFFFFF,
            publish_ns=m.log_time_ns,
            flags=HeaderFlags.NONE,
        )
        out.append(Sample(h, m.cdr, m.log_time_ns))
    return out


def test_the_tilt_laser_recording_whose_scans_drift_through_their_buckets_gives_one_frame_per_scan() -> None:
    """The demo's own recording: its scans drift from 53 ms to 8 ms into their bucket in 18 s
    (a period of about 99.75 ms). Every scan is in exactly one frame, every IMU sample between
    the first and the last in exactly one."""
    spec = load_spec(ROOT / "config" / "demo.yaml")
    samples = recording_samples(
        recording("plotjuggler_tilt_laser", "tilt_laser.bag"),
        ["/scan", "/imu_data", "/position_gps"],
        {"/imu_data": "imu", "/position_gps": "gps"},  # as config/demo.yaml maps them
    )
    frames, asm = fuse(samples, spec)
    scans = [s for s in samples if s.stream == "scan"]
    assert len(uses(frames, "scan")) == len(scans) and set(uses(frames, "scan").values()) == {1}
    imu = uses(frames, "imu")
    assert set(imu.values()) == {1} and len(imu) >= sum(1 for s in samples if s.stream == "imu") - 4
    assert digest(frame_record(f) for f in frames) == digest(offline_frames(spec, samples))
    phases = [(s.stamp_ns - spec.clock.offset_ns) % spec.clock.width_ns for s in scans]
    assert max(phases) - min(phases) > 40 * MS  # the drift is real
    assert asm.stats.late == 0


def test_six_minutes_of_a_real_husky_fuse_odometry_with_every_imu_sample_and_the_nearest_fix_as_offline() -> (
    None
):
    """robot_localization's Husky recording (BSD-3): odometry at 9.99 Hz anchors the frames,
    every IMU sample (30 Hz, stamped ~25 ms before it was logged) lands in exactly one frame,
    and the GPS fix (2.5 Hz) is the one truly nearest each odometry stamp within 250 ms."""
    samples = recording_samples(
        recording("robot_localization_husky_gps", "test1.bag"),
        ["/husky_velocity_controller/odom", "/imu/data", "/fix"],
    )
    odom, imu, fix = "husky_velocity_controller/odom", "imu/data", "fix"
    spec = spec_from_dict(
        {
            "bucket_width_ms": 100,
            "lateness_ms": 500,
            "streams": {
                odom: {"role": "reference", "expected_period_ms": 100},
                imu: {"role": "required", "pick": "all", "window": "around"},
                fix: {"role": "optional", "pick": "nearest", "max_skew_ms": 250},
            },
        }
    )
    frames, asm = fuse(samples, spec)
    n_odom = sum(1 for s in samples if s.stream == odom)
    assert n_odom > 3900 and len(uses(frames, odom)) == n_odom and set(uses(frames, odom).values()) == {1}
    assert set(uses(frames, imu).values()) == {1}
    assert len(uses(frames, imu)) >= sum(1 for s in samples if s.stream == imu) - 4
    assert digest(frame_record(f) for f in frames) == digest(offline_frames(spec, samples))
    for f in frames[:: max(1, len(frames) // 60)]:
        got = f.member(fix)
        want = brute_force_nearest(samples, fix, f.reference_stamp_ns, 250 * MS)
        assert (got.stamp_ns if got else None) == want
    assert asm.stats.late == 0


def test_sim_writes_a_recording_with_the_clocks_asked_for_and_it_fuses_one_frame_per_sweep(
    tmp_path: Path,
) -> None:
    import json
    import subprocess
    import sys

    out = tmp_path / "drift.mcap"
    run = subprocess.run(
        [
            *(sys.executable, "-m", "embodied_bus.cli.main", "sim", str(out), "--duration", "20"),
            *("--rate", "lidar/top=10.03", "--jitter", "camera/front=6", "--loss", "0.02"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(run.stdout.splitlines()[-1])["rates_hz"]["lidar/top"] == 10.03
    samples = recording_samples(out, ["/lidar/top", "/camera/front", "/gps", "/imu"])
    sweeps = sorted(s.stamp_ns for s in samples if s.stream == "lidar/top")
    gaps = sorted(b - a for a, b in itertools.pairwise(sweeps))
    assert abs(gaps[len(gaps) // 2] - 99_700_299) < 3 * MS  # 10.03 Hz, as asked
    frames, asm = fuse(samples)
    assert len(uses(frames, "lidar/top")) == len(sweeps) and set(uses(frames, "lidar/top").values()) == {1}
    assert asm.stats.reference_lost >= 1  # 2 % of the sweeps were lost: frames anchored without them
    assert digest(frame_record(f) for f in frames) == digest(offline_frames(SPEC, samples))
    bad = subprocess.run(
        [sys.executable, "-m", "embodied_bus.cli.main", "sim", str(out), "--rate", "radar=3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "--rate 'radar=3': expected STREAM=NUMBER" in bad.stderr
