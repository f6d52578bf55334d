"""``embodied-bus info`` on every recording in ``test/data``: storage, extent and per-topic
counts agree with reading every message; rates, stamp sources, gaps and stamps going backwards
are what the messages show."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from itertools import pairwise
from pathlib import Path

import pytest

from embodied_bus.replay import RecordedMessage, read_recording
from embodied_bus.replay.inspect import inspect_recording

from recordings import RECORDINGS

CLI = [sys.executable, "-m", "embodied_bus.cli.main"]
#: Every recording: ROS 1 bags, bare .db3 files and rosbag2 folders (sqlite3, MCAP).
PATHS = sorted(
    {
        *RECORDINGS.rglob("*.bag"),
        *(p.parent for p in RECORDINGS.rglob("metadata.yaml")),
        *(p for p in RECORDINGS.rglob("*.db3") if not (p.parent / "metadata.yaml").exists()),
    }
)


def test_every_kind_of_recording_is_found() -> None:
    kinds = {inspect_recording(p).storage for p in PATHS}
    assert kinds == {"ROS 1 bag", "rosbag2 (sqlite3)", "rosbag2 (mcap)"}
    assert len(PATHS) == 12


@pytest.mark.parametrize("path", PATHS, ids=lambda p: str(p.relative_to(RECORDINGS)))
def test_info_agrees_with_reading_every_message(path: Path) -> None:
    report = inspect_recording(path)
    read = [m for m in read_recording(path, decode=False) if isinstance(m, RecordedMessage)]
    counts = Counter(m.topic for m in read)
    assert {t.topic: t.count for t in report.topics if t.skipped is None} == dict(counts)
    assert report.message_count >= len(read) and report.duration_s >= 0
    for t in report.topics:
        if t.skipped is not None:
            continue
        mine = [m for m in read if m.topic == t.topic]
        stamps = [m.stamp_ns for m in mine if m.stamp_ns]
        assert t.stamps == "header" if len(stamps) == len(mine) else t.stamps != "header"
        assert t.out_of_order == sum(1 for a, b in pairwise(stamps) if b < a)
        if t.count > 1:
            span_s = (mine[-1].log_time_ns - mine[0].log_time_ns) / 1e9
            assert t.rate_hz == pytest.approx((t.count - 1) / span_s, rel=1e-3, abs=1e-3)


def test_the_command_prints_a_table_and_json(tmp_path: Path) -> None:
    bag = RECORDINGS / "plotjuggler_tilt_laser" / "tilt_laser.bag"
    text = subprocess.run(
        [*CLI, "info", str(bag)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert "Storage:           ROS 1 bag" in text and "Duration:          17.694 s" in text
    scan = next(line for line in text.splitlines() if line.startswith("/scan "))
    assert scan.split()[1:5] == ["sensor_msgs/msg/LaserScan", "178", "10.00", "ros1"], scan
    doc = json.loads(
        subprocess.run([*CLI, "info", str(bag), "--json"], capture_output=True, text=True, timeout=60).stdout
    )
    assert doc["message_count"] == 4093 and doc["duration_s"] == pytest.approx(17.694, abs=1e-3)
    missing = subprocess.run([*CLI, "info", str(tmp_path / "none.bag")], capture_output=True, text=True)
    assert missing.returncode != 0 and "does not exist" in missing.stderr
