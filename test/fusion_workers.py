"""Fusion worker processes for the scale-out tests: start them, know when they listen, collect
their frames while one is killed, and compare the frames with one worker's."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from embodied_bus.fusion import Assembler, FusionSpec, MultiModalFrame, decode_frame
from embodied_bus.model import Sample
from embodied_bus.streams.subscriber import Subscription

CLI = [sys.executable, "-m", "embodied_bus.cli.main"]

#: What a frame took: its reference stamp and each member's stamps.
Signature = tuple[int, dict[str, tuple[int, ...]]]


def worker(
    url: str, ns: str, wid: str, mode: str, config: Path, *, json_summary: bool = True
) -> subprocess.Popen[str]:
    """A ``fuse`` worker process (``json_summary=False``: it says "fusing ..." once subscribed,
    and prints its summary as one JSON line at the end)."""
    return subprocess.Popen(
        [
            *CLI,
            *("fuse", "--config", str(config), "--bus", url, "--ns", ns),
            *("--scale-out", mode, "--worker-id", wid),
            *(["--json"] if json_summary else []),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def ready_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The process's first stdout line, or "" if none came within ``timeout_s``."""
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline() if proc.stdout else ""))
    reader.start()
    reader.join(timeout_s)
    return box[0] if box else ""


def last_json(out: str) -> Any:
    """The JSON document at the end of a process's output (after any log lines)."""
    start = 0 if out.startswith("{") else out.rindex("\n{") + 1
    return json.loads(out[start:])


def key_shared_consumers(web_url: str, ns: str, stream: str, subscription: str) -> int:
    """Consumers of a Pulsar subscription on a stream's topic (0 before the topic exists)."""
    topic = f"public/default/eb.{ns}.{stream.replace('/', '.')}"
    try:
        with urllib.request.urlopen(f"{web_url}/admin/v2/persistent/{topic}/stats", timeout=5) as resp:
            stats = json.load(resp)
    except urllib.error.HTTPError as err:
        if err.code == 404:  # no consumer has subscribed yet
            return 0
        raise
    return len(stats.get("subscriptions", {}).get(subscription, {}).get("consumers", []))


def signature(frame: MultiModalFrame) -> Signature:
    """What a frame took: its reference stamp and each member's stamps."""
    members = {name: tuple(m.stamp_ns for m in ms) for name, ms in sorted(frame.members.items())}
    return frame.reference_stamp_ns, members


def one_worker_frames(spec: FusionSpec, samples: Iterable[Sample]) -> dict[int, Signature]:
    """The frames one worker alone makes of ``samples`` (in this order), by bucket."""
    asm = Assembler(spec)
    frames = [e for s in samples for e in asm.push(s) if isinstance(e, MultiModalFrame)]
    frames += [e for e in asm.flush() if isinstance(e, MultiModalFrame)]
    return {f.bucket: signature(f) for f in frames if f.pane == 0}


async def frames_killing_one(
    frames_sub: Subscription,
    expected: Iterable[int] | None,
    victim: subprocess.Popen[str],
    kill_at: float,
    quiet_s: float = 8.0,
) -> tuple[list[MultiModalFrame], int]:
    """Receive frames until every ``expected`` bucket came (None: any) or none came for
    ``quiet_s``, SIGKILLing ``victim`` at ``kill_at`` (monotonic s). Returns the frames and how
    many had come when the victim was killed."""
    frames: list[MultiModalFrame] = []
    missing = set(expected) if expected is not None else {-1}
    killed_at = -1
    while missing:
        if killed_at < 0 and time.monotonic() >= kill_at:
            victim.send_signal(signal.SIGKILL)
            killed_at = len(frames)
        try:
            wait_s = max(0.05, kill_at - time.monotonic()) if killed_at < 0 else quiet_s
            frame = decode_frame((await frames_sub.recv(timeout_s=wait_s)).payload)
        except TimeoutError:
            if killed_at >= 0:
                break  # nothing for quiet_s: the rest is lost
            continue
        frames.append(frame)
        missing.discard(frame.bucket)
    return frames, killed_at


def stop_all(procs: Iterable[subprocess.Popen[str] | None]) -> list[str]:
    """SIGINT the processes still running; their standard outputs."""
    procs = list(procs)
    for p in procs:
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGINT)
    return [p.communicate(timeout=30)[0] if p is not None else "" for p in procs]


def assert_one_workers_frames(
    frames: list[MultiModalFrame], expected: dict[int, Signature], summaries: list[Any], *, lossless: bool
) -> list[int]:
    """Each frame once, each with one worker's members; no bucket lost if ``lossless`` (Pulsar),
    else at most the few in flight when a worker was killed (Zenoh ring). The lost buckets."""
    buckets = [f.bucket for f in frames]
    assert len(buckets) == len(set(buckets)), "a bucket was published twice"
    got = {f.bucket: signature(f) for f in frames}
    differ = {b: (got[b], expected.get(b)) for b in got if got[b] != expected.get(b)}
    assert not differ, (
        f"{len(differ)} of {len(got)} frames differ from one worker's: {list(differ.items())[:3]}"
    )
    lost = sorted(set(expected) - set(got))
    assert all(not s["foreign_clock"] for s in summaries), summaries
    if lossless:
        assert not lost, f"lost buckets {lost}"
        # the survivors assembled the killed worker's unacknowledged buckets, with the context
        # streams they keep; every shared sample came to the owner of its bucket's slot
        assert sum(s["recovered"] + s["already_published"] for s in summaries) > 0, summaries
        assert all(s["outside_slots"] == 0 and s["context"] > 0 for s in summaries), summaries
    else:
        # a crash loses at most the frames the killed worker published but had not yet sent
        assert len(lost) <= 3, f"lost buckets {lost}"
    return lost
