"""The transport-free assembler: one frame per reference sample, picks relative to it, windows
that tile time, decisions by each stream's own samples; invariants (hypothesis) and faults."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embodied_bus.fusion import (
    Assembler,
    DroppedFrame,
    LateSample,
    MultiModalFrame,
    SpecError,
    StampJump,
    decode_frame,
    encode_frame,
    load_spec,
    spec_from_dict,
)
from embodied_bus.fusion.offline import digest, frame_record, offline_frames
from embodied_bus.fusion.worker import FusionMetrics
from embodied_bus.model import Header, Modality, Sample
from embodied_bus.sim.scenario import T0_NS, Scenario, generate
from embodied_bus.sim.scenario import lost_input as scenario_lost_input

ROOT = Path(__file__).resolve().parents[2]
MS = 1_000_000
SPEC = load_spec(ROOT / "config" / "fusion.yaml")
CAMERA_BOUND_NS = SPEC.skew_ns(next(s for s in SPEC.streams if s.name == "camera/front"))


def run(samples: list[Sample], spec=SPEC) -> tuple[list[MultiModalFrame], list[object], Assembler]:  # type: ignore[no-untyped-def]
    asm = Assembler(spec)
    frames: list[MultiModalFrame] = []
    other: list[object] = []
    for s in samples:
        for ev in asm.push(s):
            (frames if isinstance(ev, MultiModalFrame) and ev.pane == 0 else other).append(ev)
    for ev in asm.flush():
        (frames if isinstance(ev, MultiModalFrame) else other).append(ev)
    return frames, other, asm


def sample(stream: str, stamp_ms: float, seq: int, arrival_ms: float | None = None) -> Sample:
    stamp = T0_NS + int(stamp_ms * MS)
    arrival = T0_NS + int((arrival_ms if arrival_ms is not None else stamp_ms + 1) * MS)
    h = Header(
        stream=stream,
        modality=Modality.OTHER,
        seq=seq,
        stamp_ns=stamp,
        bucket=0,
        bucket_width_ns=100 * MS,
        bucket_offset_ns=0,
        encoding="raw",
        frame_id="",
        publisher_id=hash(stream) & 0xFFFF,
        publish_ns=arrival,
    )
    return Sample(h, b"", arrival)


def spec2(**streams: dict[str, object]) -> object:
    """A spec with a 100 ms lidar reference and the given other streams (100 ms buckets)."""
    return spec_from_dict(
        {
            "bucket_width_ms": 100,
            "bucket_offset_ms": 50,
            "lateness_ms": 120,
            "streams": {"lidar": {"role": "reference", "expected_period_ms": 100}, **streams},
        }
    )


def test_one_complete_frame_per_lidar_sweep_with_every_imu_sample_once() -> None:
    samples = generate(Scenario(duration_s=10))
    frames, other, asm = run(samples)
    sweeps = sum(1 for s in samples if s.stream == "lidar/top")
    assert len(frames) == sweeps and all(f.member("lidar/top") for f in frames)
    assert all(f.complete for f in frames)
    imu_used = Counter(m.sample.seq for f in frames for m in f.members.get("imu", ()))
    assert max(imu_used.values()) == 1
    inside = [
        s
        for s in samples
        if s.stream == "imu"
        and frames[0].reference_stamp_ns - 50 * MS <= s.stamp_ns
        and s.stamp_ns < frames[-1].reference_stamp_ns + 50 * MS
    ]
    assert sum(imu_used.values()) == len(inside)  # every IMU sample between the first and last
    # half a learned period either side, and the sweeps' stamp jitter (8 ms)
    assert all(abs(m.skew_ns) <= 60 * MS for f in frames for m in f.members["imu"])
    assert all(abs(f.members["camera/front"][0].skew_ns) <= CAMERA_BOUND_NS for f in frames)
    assert all(f.max_skew_ns is not None for f in frames)  # the held fix counts too
    assert asm.stats.late == 0 and not [e for e in other if isinstance(e, LateSample)]
    assert asm.stats.forced == 0


def test_a_bucket_holding_two_sweeps_gives_two_frames_and_one_holding_none_gives_none() -> None:
    spec = spec2(imu={"role": "optional", "pick": "all", "window": "before"})
    # sweeps at 60 and 140 ms fall in bucket [50, 150); none falls in [150, 250)
    samples = [sample("lidar", t, i + 1) for i, t in enumerate((0, 60, 140, 255, 340))]
    samples += [sample("imu", t, i + 1) for i, t in enumerate(range(0, 400, 10))]
    samples.sort(key=lambda s: s.receive_ns)
    frames, _, asm = run(samples, spec)
    assert [f.reference_stamp_ns - T0_NS for f in frames] == [0, 60 * MS, 140 * MS, 255 * MS, 340 * MS]
    assert [f.bucket for f in frames].count(spec.clock.bucket_of(T0_NS + 60 * MS)) == 2
    assert all(f.member("lidar") for f in frames) and asm.stats.reference_lost == 0
    # `before`: the IMU since the previous sweep (exclusive) up to this one (inclusive)
    assert [m.stamp_ns - T0_NS for m in frames[2].members["imu"]] == [
        70 * MS,
        80 * MS,
        90 * MS,
        100 * MS,
        110 * MS,
        120 * MS,
        130 * MS,
        140 * MS,
    ]


@pytest.mark.parametrize(
    ("window", "first_frame_imu_ms"),
    [
        ("before", [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]),
        ("after", list(range(100, 200, 10))),
        ("around", list(range(50, 150, 10))),
    ],
)
def test_windows_tile_time_so_each_imu_sample_lands_in_exactly_one_frame(
    window: str, first_frame_imu_ms: list[int]
) -> None:
    spec = spec2(imu={"role": "optional", "pick": "all", "window": window})
    sweeps = (0, 100, 197, 301, 399, 502)  # jittery
    samples = [sample("lidar", t, i + 1, t + 30) for i, t in enumerate(sweeps)]
    samples += [sample("imu", t, i + 1) for i, t in enumerate(range(0, 700, 10))]
    samples.sort(key=lambda s: s.receive_ns)
    frames, _, _ = run(samples, spec)
    got = [m.stamp_ns for f in frames for m in f.members.get("imu", ())]
    assert len(got) == len(set(got)) and got == sorted(got)  # once each, in order
    assert [m.stamp_ns - T0_NS for m in frames[1].members["imu"]] == [t * MS for t in first_frame_imu_ms]
    assert digest(frame_record(f) for f in frames) == digest(offline_frames(spec, samples))


def test_a_lost_sweep_is_judged_from_the_lidars_own_cadence_and_anchors_a_frame_without_it() -> None:
    spec = spec2(cam={"role": "required", "max_skew_ms": 20})
    # a 10.03 Hz lidar (99.7 ms) that loses its 6th sweep; nothing is read from the bucket grid
    stamps = [round(i * 99.7) for i in range(12) if i != 5]
    samples = [sample("lidar", t, i + 1, t + 40) for i, t in enumerate(stamps)]
    samples += [sample("cam", t, i + 1, t + 20) for i, t in enumerate(range(0, 1200, 33))]
    samples.sort(key=lambda s: s.receive_ns)
    frames, _, asm = run(samples, spec)
    lost = [f for f in frames if not f.member("lidar")]
    assert len(frames) == 12 and len(lost) == 1 and asm.stats.reference_lost == 1
    assert lost[0].reference_stamp_ns - T0_NS == (stamps[4] + 100) * MS or lost[0].reference_stamp_ns - T0_NS
    assert "lidar" in lost[0].missing and not lost[0].complete
    assert lost[0].member("cam") is not None  # its other members are still there
    assert abs(lost[0].reference_stamp_ns - T0_NS - 498.5 * MS) < 3 * MS  # one learned period on


def test_frames_are_emitted_on_arrival_of_the_last_needed_sample() -> None:
    spec = spec2(cam={"role": "required", "max_skew_ms": 25})
    asm = Assembler(spec)
    assert asm.push(sample("lidar", 100, 1)) == []  # the camera is still owed
    out = asm.push(sample("cam", 104, 1))  # a later image cannot be nearer: emit now
    assert len(out) == 1 and isinstance(out[0], MultiModalFrame)
    f = out[0]
    assert f.complete and f.reference_stamp_ns == T0_NS + 100 * MS
    assert f.member("cam").skew_ns == 4 * MS  # type: ignore[union-attr]
    assert not f.forced and f.waited_on == "cam"


def test_an_earlier_image_is_taken_only_once_the_cameras_next_image_proves_nothing_nearer_comes() -> None:
    spec = spec2(cam={"role": "required", "max_skew_ms": 25})
    asm = Assembler(spec)
    asm.push(sample("cam", 88, 1))
    assert asm.push(sample("lidar", 100, 1)) == []  # no guess from a nominal period
    out = asm.push(sample("cam", 121, 2))  # 21 ms after: the 88 ms image (12 ms) wins
    assert len(out) == 1 and out[0].member("cam").skew_ns == -12 * MS  # type: ignore[union-attr]
    asm = Assembler(spec)
    asm.push(sample("cam", 88, 1))
    asm.push(sample("lidar", 100, 1))
    (f,) = asm.push(sample("cam", 111, 2))  # 11 ms after: nearer than 12 ms before
    assert f.member("cam").skew_ns == 11 * MS  # type: ignore[union-attr]


def test_a_camera_blackout_yields_flagged_partial_frames_not_a_stall() -> None:
    frames, _, asm = run(generate(Scenario(duration_s=8, camera_blackout=(2.0, 2.0))))
    during = [f for f in frames if 2.1e9 <= f.reference_stamp_ns - T0_NS < 3.9e9]
    assert during and all("camera/front" in f.missing and not f.complete for f in during)
    assert all(f.member("lidar/top") for f in during)  # the pipeline kept emitting
    assert all(f.forced and f.waited_on == "camera/front" for f in during)
    assert asm.stats.incomplete >= 18


def test_a_silent_reference_anchors_frames_where_its_samples_were_due() -> None:
    samples = generate(Scenario(duration_s=4))
    cut = [s for s in samples if not (s.stream == "lidar/top" and 1.0e9 <= s.stamp_ns - T0_NS < 2.0e9)]
    frames, _, _ = run(cut)
    gap = [f for f in frames if 1.0e9 <= f.reference_stamp_ns - T0_NS < 2.0e9]
    assert len(gap) == 10 and all(not f.member("lidar/top") and "lidar/top" in f.missing for f in gap)
    assert all(f.member("camera/front") for f in gap)  # the other sensors still reported
    imu_used = Counter(m.sample.seq for f in frames for m in f.members.get("imu", ()))
    assert max(imu_used.values()) == 1


def test_a_frame_without_members_besides_the_reference_has_no_skew_not_zero() -> None:
    frames, _, _ = run(generate(Scenario(duration_s=6, camera_blackout=(2.0, 2.0))))
    spec = spec2()
    lonely, _, _ = run([sample("lidar", t, i + 1) for i, t in enumerate(range(0, 500, 100))], spec)
    assert lonely and all(f.max_skew_ns is None for f in lonely)
    assert all(decode_frame(encode_frame(f)).max_skew_ns is None for f in lonely)
    with_camera = [f for f in frames if f.member("camera/front")]
    assert all(decode_frame(encode_frame(f)).max_skew_ns == f.max_skew_ns for f in with_camera[:5])
    metrics = FusionMetrics.for_spec(spec)
    metrics.record(lonely[0], lonely[0].reference_stamp_ns)
    assert metrics.as_dict()["skew_p99_ms"] is None


def test_incomplete_frames_are_dropped_when_the_spec_says_drop() -> None:
    doc = {
        "bucket_width_ms": 100,
        "bucket_offset_ms": 50,
        "incomplete": "drop",
        "streams": {
            "lidar/top": {"role": "reference", "expected_period_ms": 100},
            "camera/front": {"role": "required", "max_skew_ms": 25},
        },
    }
    frames, other, asm = run(
        generate(Scenario(duration_s=5, camera_blackout=(1.0, 1.0))), spec_from_dict(doc)
    )
    assert all(f.complete for f in frames)
    assert sum(isinstance(e, DroppedFrame) for e in other) == asm.stats.dropped_incomplete >= 9


def test_late_samples_are_counted_and_sent_to_the_side_stream() -> None:
    frames, other, asm = run(generate(Scenario(duration_s=6, camera_delay_spike=(2.0, 1.0, 250 * MS))))
    late = [e for e in other if isinstance(e, LateSample)]
    assert late and all(e.sample.stream == "camera/front" for e in late)
    assert asm.stats.late == len(late)
    assert sum(f.late_count for f in frames) <= len(late)


def test_late_panes_carry_late_samples_when_enabled() -> None:
    doc = dict(__import__("yaml").safe_load((ROOT / "config" / "fusion.yaml").read_text())["fusion"])
    doc["late_panes"] = True
    _, other, _ = run(
        generate(Scenario(duration_s=6, camera_delay_spike=(2.0, 1.0, 250 * MS))), spec_from_dict(doc)
    )
    panes = [e for e in other if isinstance(e, MultiModalFrame) and e.pane > 0]
    assert panes and all(list(p.members) == ["camera/front"] for p in panes)


def test_zero_header_stamps_fall_back_to_receive_time_with_a_flag() -> None:
    frames, _, asm = run(generate(Scenario(duration_s=3, zero_stamps=("gps",))))
    gps = [m for f in frames for m in f.members.get("gps", ())]
    assert gps and all(m.stamp_fallback for m in gps)
    assert asm.stats.stamp_fallbacks == sum(1 for s in generate(Scenario(duration_s=3)) if s.stream == "gps")


def test_a_stamp_jump_backwards_is_reported_and_the_assembler_restarts() -> None:
    first = generate(Scenario(duration_s=3))
    again = generate(Scenario(duration_s=3, seed=2))  # the same clock again, like a looped bag
    shifted = [
        Sample(s.header._replace(seq=s.seq + 10_000), s.payload, s.receive_ns + 4_000_000_000) for s in again
    ]
    frames, other, _ = run(first + shifted)
    jumps = [e for e in other if isinstance(e, StampJump)]
    assert jumps and jumps[0].backwards
    assert len([f for f in frames if f.member("lidar/top")]) == 60


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    loss=st.sampled_from([0.0, 0.05, 0.3]),
    blackout=st.booleans(),
    spike=st.booleans(),
)
def test_invariants_hold_under_loss_blackouts_and_delay_spikes(
    seed: int, loss: float, blackout: bool, spike: bool
) -> None:
    sc = Scenario(
        duration_s=3,
        loss=loss,
        seed=seed,
        camera_blackout=(1.0, 0.5) if blackout else None,
        camera_delay_spike=(0.5, 0.5, 200 * MS) if spike else None,
        rates_hz={"lidar/top": 10.03, "camera/front": 29.97},
    )
    samples = generate(sc)
    asm = Assembler(SPEC)
    frames: list[MultiModalFrame] = []
    peak = 0
    for s in samples:
        frames += [e for e in asm.push(s) if isinstance(e, MultiModalFrame) and e.pane == 0]
        peak = max(peak, asm.buffered_samples)
    frames += [e for e in asm.flush() if isinstance(e, MultiModalFrame)]
    stamps = [f.reference_stamp_ns for f in frames]
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)  # anchor order, once each
    sweeps = Counter(
        (m.sample.header.publisher_id, m.sample.seq) for f in frames for m in f.members.get("lidar/top", ())
    )
    assert len(sweeps) == sum(1 for s in samples if s.stream == "lidar/top") and max(sweeps.values()) == 1
    imu = Counter(
        (m.sample.header.publisher_id, m.sample.seq) for f in frames for m in f.members.get("imu", ())
    )
    assert not imu or max(imu.values()) == 1
    for f in frames:
        cam = f.member("camera/front")
        assert cam is None or abs(cam.skew_ns) <= CAMERA_BOUND_NS  # the skew bound is never exceeded
    assert peak < 250  # memory bounded by the reach of the picks, not the run length


@pytest.mark.parametrize(
    ("doc", "key"),
    [
        ({"streams": {"a": {"role": "required", "expected_period_ms": 10}}}, "exactly one stream"),
        ({"streams": {"a": {"role": "boss", "expected_period_ms": 10}}}, "streams.a.role"),
        ({"streams": {"a": {"role": "reference"}}}, "streams.a.expected_period_ms"),
        ({"streams": {"a": {"role": "reference", "expected_period_ms": -1}}}, "expected_period_ms"),
        (
            {"streams": {"a": {"role": "reference", "expected_period_ms": 10, "pick": "nearest"}}},
            "streams.a.pick: the reference takes no pick.*delete `pick: nearest`",
        ),
        ({"streams": {"a": {"role": "reference", "expected_period_ms": 10, "colour": 1}}}, "unknown key"),
        ({"bucket_width_ms": 100, "bucket_offset_ms": 100, "streams": {}}, "bucket_offset_ms"),
        (
            {"incomplete": "maybe", "streams": {"a": {"role": "reference", "expected_period_ms": 10}}},
            "incomplete",
        ),
        ({"streams": {"bad name": {"role": "reference", "expected_period_ms": 10}}}, "invalid stream name"),
        (
            {"streams": {"a": {"role": "reference", "expected_period_ms": 10, "complete_by_count": True}}},
            "streams.a.complete_by_count: no longer a fusion key.*delete the key",
        ),
        (
            {"streams": {"a": {"role": "reference", "expected_period_ms": 10, "lookahead": 0}}},
            "streams.a.lookahead: no longer a fusion key.*own next sample",
        ),
        (
            {"streams": {"a": {"role": "reference", "expected_period_ms": 10, "max_delay_ms": 0}}},
            "streams.a.max_delay_ms",
        ),
        (
            {
                "streams": {
                    "a": {"role": "reference", "expected_period_ms": 10},
                    "b": {"role": "optional", "window": "around"},
                }
            },
            "streams.b.window: only `all` and `latest` picks take a window",
        ),
        (
            {
                "streams": {
                    "a": {"role": "reference", "expected_period_ms": 10},
                    "b": {"role": "optional", "pick": "all", "window": "sideways"},
                }
            },
            "streams.b.window",
        ),
    ],
)
def test_invalid_specs_are_rejected_naming_the_key(doc: dict[str, object], key: str) -> None:
    with pytest.raises(SpecError, match=key):
        spec_from_dict(doc)


def test_interpolation_brackets_the_reference_stamp() -> None:
    spec = spec2(gps={"role": "optional", "pick": "interpolate", "max_skew_ms": 150})
    asm = Assembler(spec)
    asm.push(sample("gps", 0, 1))
    asm.push(sample("lidar", 100, 1))
    (f,) = asm.push(sample("gps", 200, 2))
    assert isinstance(f, MultiModalFrame)
    assert [m.sample.seq for m in f.members["gps"]] == [1, 2]
    assert f.interpolation["gps"] == pytest.approx(0.5)


def test_at_5_percent_loss_99_percent_of_swept_frames_are_complete_and_none_waits_for_lateness() -> None:
    samples = generate(Scenario(duration_s=30, loss=0.05, seed=3))
    frames, _, _ = run(samples)
    with_lidar = [f for f in frames if f.member("lidar/top")]
    assert len(with_lidar) == sum(1 for s in samples if s.stream == "lidar/top")
    assert sum(f.complete for f in with_lidar) >= 0.99 * len(with_lidar)
    assert not [f for f in with_lidar if f.forced]  # a lost GPS fix is given up after max_delay
    assert all(f.max_skew_ns is not None for f in with_lidar)


def test_at_5_percent_loss_a_frame_whose_every_input_arrived_waits_at_most_for_each_streams_next_sample() -> (
    None
):
    lost: list[tuple[str, int]] = []
    samples = generate(Scenario(duration_s=30, loss=0.05, seed=3), lost=lost)
    by_stream = Counter(s.stream for s in samples)
    for stream, n_lost in Counter(name for name, _ in lost).items():  # `lost` is what seq gaps say
        assert max(s.seq for s in samples if s.stream == stream) == by_stream[stream] + n_lost
    asm = Assembler(SPEC)
    emitted: list[tuple[MultiModalFrame, int]] = []
    for s in samples:
        frames = [ev for ev in asm.push(s) if isinstance(ev, MultiModalFrame) and ev.pane == 0]
        emitted += [(f, s.receive_ns) for f in frames]
    lost_input = scenario_lost_input(SPEC, lost)
    whole = [(f, t) for f, t in emitted if f.complete and not lost_input(f)]
    assert len(whole) >= 10
    # a frame waits for the sample that proves its picks final: the camera's next image (33 ms
    # and its transport jitter), never for the lateness bound
    assert max(t - f.last_arrival_ns for f, t in whole) < 60 * MS
    waits_ns = [t - f.last_arrival_ns for f, t in emitted if lost_input(f) and f.member("lidar/top")]
    assert max(waits_ns) < SPEC.lateness_ns + 100 * MS


def test_a_lost_fix_holds_frames_until_the_lateness_bound_unless_the_stream_has_a_max_delay() -> None:
    def spec(max_delay: dict[str, int]) -> object:
        return spec2(gps={"role": "optional", "pick": "hold_last", "max_age_ms": 500, **max_delay})

    # gps fixes at 0 and 400 ms (200 lost); lidar sweeps every 100 ms, arriving 10 ms late
    samples = sorted(
        [sample("gps", 0, 1, 15), sample("gps", 400, 2, 415)]
        + [sample("lidar", t, i + 1, t + 10) for i, t in enumerate(range(0, 600, 100))],
        key=lambda s: s.receive_ns,
    )
    waited, _, _ = run(samples, spec({}))
    sweep_200 = next(f for f in waited if f.reference_stamp_ns == T0_NS + 200 * MS)
    assert sweep_200.forced  # nothing said the 200 ms fix was lost until the lateness bound
    frames, _, _ = run(samples, spec({"max_delay_ms": 50}))
    sweep_200 = next(f for f in frames if f.reference_stamp_ns == T0_NS + 200 * MS)
    assert not sweep_200.forced
    assert sweep_200.member("gps") is not None and sweep_200.member("gps").stamp_ns == T0_NS  # held fix


def test_a_sample_that_comes_after_its_stream_was_given_up_is_reported_late() -> None:
    spec = spec_from_dict(
        {
            "bucket_width_ms": 100,
            "bucket_offset_ms": 50,
            "lateness_ms": 500,
            "streams": {
                "lidar": {"role": "reference", "expected_period_ms": 100},
                "camera": {"role": "required", "max_skew_ms": 20, "max_delay_ms": 50},
            },
        }
    )
    # the camera image of the 200 ms sweep is delayed by 300 ms; lidar keeps event time moving
    samples = sorted(
        [sample("lidar", t, i + 1, t + 5) for i, t in enumerate(range(0, 700, 100))]
        + [
            sample("camera", t, i + 1, t + (300 if t == 200 else 5)) for i, t in enumerate(range(0, 700, 100))
        ],
        key=lambda s: s.receive_ns,
    )
    frames, other, asm = run(samples, spec)
    sweep_200 = next(f for f in frames if f.reference_stamp_ns == T0_NS + 200 * MS)
    assert not sweep_200.complete and "camera" in sweep_200.missing and not sweep_200.forced
    late = [e for e in other if isinstance(e, LateSample)]
    assert [(e.sample.stream, e.sample.stamp_ns) for e in late] == [("camera", T0_NS + 200 * MS)]
    assert asm.stats.late == 1


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), loss=st.sampled_from([0.0, 0.05, 0.3]))
def test_skipping_frames_held_back_by_another_stream_changes_no_event(seed: int, loss: float) -> None:
    class Exhaustive(Assembler):
        def _emit_ready(self, changed=None):  # type: ignore[no-untyped-def]
            return super()._emit_ready(None)  # re-decide the oldest frame on every sample

    def events(asm: Assembler) -> list[object]:
        out = [e for s in samples for e in asm.push(s)] + asm.flush()
        return [
            (
                type(e).__name__,
                getattr(e, "reference_stamp_ns", None),
                getattr(e, "forced", None),
                {k: [m.sample.seq for m in v] for k, v in e.members.items()}
                if isinstance(e, MultiModalFrame)
                else None,
            )
            for e in out
        ]

    samples = generate(Scenario(duration_s=3, loss=loss, seed=seed, camera_blackout=(1.0, 0.5)))
    fast = events(Assembler(SPEC))
    assert fast and fast == events(Exhaustive(SPEC))


def test_the_fast_member_constructor_builds_an_equal_frozen_member() -> None:
    import dataclasses

    from embodied_bus.fusion.frame import Member, new_member

    h = Header(
        stream="imu",
        modality=Modality.IMU,
        seq=3,
        stamp_ns=5,
        bucket=0,
        bucket_width_ns=100,
        bucket_offset_ns=0,
        encoding="raw",
        frame_id="imu_link",
        publisher_id=1,
        publish_ns=6,
    )
    s = Sample(h, b"x", 7)
    fast = new_member(s, 5, -2, True)
    assert fast == Member(s, 5, -2, True) and fast.stamp_fallback is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.skew_ns = 0  # type: ignore[misc]


def test_pipeline_metrics_name_what_the_slow_frames_waited_on_and_give_skew_per_stream() -> None:
    samples = generate(Scenario(duration_s=8, camera_blackout=(2.0, 2.0)))
    asm = Assembler(SPEC)
    metrics = FusionMetrics.for_spec(SPEC)
    for s in samples:
        for ev in asm.push(s):
            if isinstance(ev, MultiModalFrame) and ev.pane == 0:
                metrics.record(ev, s.receive_ns)
    doc = metrics.as_dict()
    assert doc["forced"] == asm.stats.forced > 0
    assert doc["added_latency_on_completion_p99_ms"] < 60 < doc["added_latency_p99_ms"]
    assert doc["waited_on"]["camera/front"] >= 18  # the blackout's frames
    slowest = doc["slowest_frames"]
    assert len(slowest) == 5 and all(f["waited_on"] == "camera/front" and f["forced"] for f in slowest)
    assert slowest[0]["added_latency_ms"] >= slowest[-1]["added_latency_ms"]
    by_stream = doc["skew_ms_by_stream"]
    assert set(by_stream) == {"camera/front", "gps", "imu"}
    assert 45 <= by_stream["imu"]["p99"] <= 60  # the IMU reaches half a sweep either side
    assert by_stream["camera/front"]["p99"] <= 40


def test_end_to_end_latency_of_frames_stamped_off_the_wall_clock_is_not_available_with_the_reason() -> None:
    from embodied_bus.fusion import frame_summary
    from embodied_bus.fusion.metrics import E2E_UNAVAILABLE, FusionMetrics

    frames, _, _ = run(generate(Scenario(duration_s=1)))
    now_ns = time.time_ns()
    replayed = FusionMetrics.for_spec(SPEC)  # a recording's stamps, years before now
    for f in frames:
        replayed.record(f, f.reference_stamp_ns + 40 * MS + 3 * 365 * 86_400 * 10**9)
    doc = replayed.as_dict()
    assert doc["end_to_end_p50_ms"] is None and doc["end_to_end_p99_ms"] is None
    assert doc["end_to_end"] == E2E_UNAVAILABLE
    assert frame_summary(frames[0], now_ns)["end_to_end_ms"] is None
    live = FusionMetrics.for_spec(SPEC)
    for f in frames:
        live.record(f, f.reference_stamp_ns + 40 * MS)
    assert live.as_dict()["end_to_end_p50_ms"] == 40.0 and "end_to_end" not in live.as_dict()


def _frames_by_stamp(
    samples: list[Sample], hold: tuple[float, float] | None = None, held: frozenset[str] = frozenset()
) -> dict[int, object]:
    """Frames (their records) of ``samples`` pushed in arrival order; ``held`` streams are held
    while arrivals are in ``hold`` = [start, end) s."""
    asm = Assembler(SPEC)
    out: list[object] = []
    for s in sorted(samples, key=lambda s: s.receive_ns):
        at_s = (s.receive_ns - T0_NS) / 1e9
        if hold is not None:
            asm.hold(held if hold[0] <= at_s < hold[1] else frozenset())
        out.extend(asm.push(s))
    out.extend(asm.flush())
    return {
        f.reference_stamp_ns: frame_record(f) for f in out if isinstance(f, MultiModalFrame) and f.pane == 0
    }


@pytest.mark.parametrize(("dead", "back_s"), [(("lidar/top", "gps"), 3.5), (("gps",), 3.5), (("imu",), 14.0)])
def test_a_held_stream_that_comes_back_late_gives_the_frames_it_would_have_given_on_time(
    dead: tuple[str, ...], back_s: float
) -> None:
    """The broker of the ``dead`` streams' topics dies at 1.0 s and they are served again at
    ``back_s``: what they stored meanwhile arrives then, in order, over 300 ms while the others
    go on. Held while their subscriptions reconnect (the GPS past its ``max_delay_ms``, the IMU
    13 s behind the others, past the 10 s a stream may lag), the frames are those of an
    undisturbed run; not held, those frames lack them (and their samples come late)."""
    samples = generate(Scenario(duration_s=back_s + 1.5, seed=3))
    back_ns = T0_NS + int(back_s * 1e9)
    late = [
        Sample(s.header, s.payload, max(s.receive_ns, back_ns + i * 20_000))
        if s.stream in dead and s.receive_ns >= T0_NS + int(1.0e9)
        else s
        for i, s in enumerate(samples)
    ]
    undisturbed = _frames_by_stamp(samples)
    assert _frames_by_stamp(late, hold=(1.0, back_s), held=frozenset(dead)) == undisturbed
    given_up = _frames_by_stamp(late)
    assert sum(1 for k, r in given_up.items() if r != undisturbed.get(k)) >= 10
