"""Timeline pictures from frames JSON lines and from MCAP recordings."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from embodied_bus import EmbodiedBusError
from embodied_bus.fusion import Assembler, MultiModalFrame, encode_frame, frame_summary, load_spec
from embodied_bus.model import Header, Modality, Sample
from embodied_bus.replay.recorder import McapRecorder
from embodied_bus.sim.scenario import Scenario, generate
from embodied_bus.viz import added_latency_series, load_frame_summaries, plot_timeline

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


def frames() -> list[tuple[MultiModalFrame, int]]:
    asm = Assembler(load_spec(ROOT / "config" / "fusion.yaml"))
    out = []
    for s in generate(Scenario(duration_s=5, camera_blackout=(2.0, 1.0))):
        out += [(e, s.receive_ns) for e in asm.push(s) if isinstance(e, MultiModalFrame)]
    return out


def test_a_timeline_png_is_drawn_from_frames_json_lines(tmp_path: Path) -> None:
    src = tmp_path / "frames.jsonl"
    src.write_text("".join(json.dumps(frame_summary(f, t)) + "\n" for f, t in frames()))
    loaded = load_frame_summaries(src)
    assert len(loaded) >= 49 and any("camera/front" in f["missing"] for f in loaded)
    out = plot_timeline(loaded, tmp_path / "timeline.png")
    assert out.read_bytes()[:8] == PNG and out.stat().st_size > 10_000


def test_a_timeline_png_is_drawn_from_an_mcap_recording(tmp_path: Path) -> None:
    path = tmp_path / "rec.mcap"
    with McapRecorder(path) as rec:
        for i, (f, t) in enumerate(frames(), 1):
            h = Header(
                stream="frames/fused",
                modality=Modality.FRAME,
                seq=i,
                stamp_ns=f.reference_stamp_ns,
                bucket=f.bucket,
                bucket_width_ns=100,
                bucket_offset_ns=0,
                encoding="ebframe",
                frame_id="",
                publisher_id=1,
                publish_ns=t,
            )
            rec.write(Sample(h, bytes(encode_frame(f)), t))
    assert rec.counts["/frames/fused/meta"] >= 49 and rec.counts["/frames/fused/imu"] > 0
    out = plot_timeline(load_frame_summaries(path), tmp_path / "t.png")
    assert out.read_bytes()[:8] == PNG


def test_plotting_nothing_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(EmbodiedBusError, match="no frames"):
        load_frame_summaries(tmp_path / "empty.jsonl")
    with pytest.raises(EmbodiedBusError, match="does not exist"):
        load_frame_summaries(tmp_path / "missing.jsonl")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(EmbodiedBusError, match=r"bad\.jsonl:1"):
        load_frame_summaries(tmp_path / "bad.jsonl")


def test_frames_forced_out_are_drawn_apart_from_the_usual_added_latency() -> None:
    summaries = [
        {"added_latency_ms": 2.0, "forced": False},
        {"added_latency_ms": 540.0, "forced": True},  # the end of the stream forced it out
        {"added_latency_ms": None, "forced": False},
    ]
    usual, forced = added_latency_series(summaries)
    assert usual[0] == 2.0 and math.isnan(usual[1]) and math.isnan(usual[2])
    assert forced[1] == 540.0 and math.isnan(forced[0]) and math.isnan(forced[2])
