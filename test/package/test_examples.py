"""Every example in ``examples/`` runs as shown in its README and prints what it promises."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
#: What each example's output must contain.
EXPECTED = {
    "pubsub.py": r"lidar_top \(100000,\)",
    "batches.py": r"published seq 1\.\.1000; counters \{'received': 1000",
    "fusion_worker.py": r"% complete of \d+ frames",
    "actions.py": r"slippery succeeded .*\['nack', 'ok'\]",
    "signed_actions.py": r"signed: succeeded docked at 1",
    "replay_into_fusion.py": r"end to end: not available",
    "ros_bridge.py": r"bus stream gps: seq 3, cdr:sensor_msgs/msg/NavSatFix",
    "failover.py": r"active: 1\.\.10; after it left, the standby: 11\.\.20",
    "sessions.py": r"ran in order: task-1:navigate, task-1:pick, task-1:place\n"
    r"task-2 navigate: succeeded \ntask-2 pick: dead \ntask-2 place: canceled \(step \w+ \(pick\) of session "
    r"'task-2' was dead-lettered: no such object\)",
    "state.py": r"late joiner: .*'mission/step': 'picking'\}\nchanged: mission/step = placing",
}


#: Examples that are ROS 2 nodes, run by the ROS tests under a ROS 2 Python (named here).
ROS_EXAMPLES = {"message_filters_node.py": "ros/test_ros_message_filters.py"}


def test_every_example_is_listed_in_the_examples_readme_and_here() -> None:
    files = sorted(p.name for p in EXAMPLES.glob("*.py"))
    readme = (EXAMPLES / "README.md").read_text()
    assert files == sorted([*EXPECTED, *ROS_EXAMPLES])
    for name, test in ROS_EXAMPLES.items():
        assert name in (ROOT / "test" / test).read_text()
    assert all(f"`{name}`" in readme for name in files)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_example_runs(name: str) -> None:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=180, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(EXPECTED[name], out.stdout), out.stdout[-3000:]
