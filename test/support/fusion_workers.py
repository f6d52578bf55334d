"""Fusion worker processes for the scale-out tests: start them, know when they listen, collect
their frames while one is killed, and compare the frames with the offline computation's."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from embodied_bus.fusion import FusionSpec, MultiModalFrame, decode_frame
from embodied_bus.fusion.offline import FrameRecord, frame_record, offline_frames
from embodied_bus.model import Header, HeaderFlags, Modality, Sample
from embodied_bus.replay import RecordedMessage, modality_of, read_recording, topic_to_stream
from embodied_bus.replay.synthetic import write_recording
from embodied_bus.sim.scenario import Scenario, generate
from embodied_bus.streams.subscriber import Subscription

CLI = [sys.executable, "-m", "embodied_bus.cli.main"]


#: Each spawned process's standard error (see :func:`spawn`).
_STDERR: dict[int, IO[str]] = {}


#: The topics of :func:`drifting_recording`.
DRIFTING_TOPICS = ("/lidar/top", "/camera/front", "/gps", "/imu")


def drifting_recording(path: Path, duration_s: float, seed: int) -> tuple[str, ...]:
    """Write an MCAP recording of a drifting 10.03 Hz lidar, a 29.97 Hz camera with 6 ms of
    jitter, GPS and IMU to ``path``; its topics."""
    sc = Scenario(
        duration_s=duration_s,
        rates_hz={"lidar/top": 10.03, "camera/front": 29.97},
        jitter_ns={"camera/front": 6_000_000},
        seed=seed,
    )
    write_recording(path, generate(sc))
    return DRIFTING_TOPICS


def spawn(cmd: list[str]) -> subprocess.Popen[str]:
    """``cmd`` with its standard output piped and its standard error in an unbounded temporary
    file (:func:`stderr_tail`): a pipe nobody reads until the end stalls the process once 64 KiB
    fill it, and a Pulsar client logs every reconnection attempt while a broker is down."""
    err = tempfile.TemporaryFile("w+")  # noqa: SIM115  (kept open: read after the process ended)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    _STDERR[proc.pid] = err
    return proc


def stderr_tail(proc: subprocess.Popen[str], chars: int = 2000) -> str:
    """The last ``chars`` a process started by :func:`spawn` wrote to its standard error."""
    err = _STDERR.get(proc.pid)
    if err is None:
        return ""
    err.seek(0)
    return err.read()[-chars:]


def worker(
    url: str, ns: str, wid: str, mode: str | None, config: Path, *, json_summary: bool = True
) -> subprocess.Popen[str]:
    """A ``fuse`` worker process (``mode`` None: alone; ``json_summary=False``: it says
    "fusing ..." once subscribed, and prints its summary as one JSON line at the end)."""
    return spawn(
        [
            *CLI,
            *("fuse", "--config", str(config), "--bus", url, "--ns", ns),
            *(("--scale-out", mode, "--worker-id", wid) if mode is not None else ()),
            *(["--json"] if json_summary else []),
        ]
    )


def start_replay(
    url: str, ns: str, path: Path, spec_path: Path, topics: Iterable[str], duration_s: float, *, fast: bool
) -> subprocess.Popen[str]:
    """An ``embodied-bus replay`` of ``topics`` (the first ``duration_s`` of ``path``) at
    recorded speed or as fast as it goes, once each stream has a subscriber (JSON summary)."""
    return spawn(
        [
            *(*CLI, "replay", str(path), "--bus", url, "--ns", ns, "--spec", str(spec_path)),
            *("--topics", *topics, "--duration", str(duration_s)),
            *(("--fast",) if fast else ("--rate", "1")),
            *("--wait-subscribers", "30", "--json"),
        ]
    )


def replayed(proc: subprocess.Popen[str] | None, timeout_s: float = 60.0) -> Any:
    """The JSON summary of a :func:`start_replay` once it ended; fails with its standard error if it
    did not end well."""
    assert proc is not None, "the replay did not start"
    try:
        out = proc.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate()[0]
    assert proc.returncode == 0, f"replay exited {proc.returncode}: {stderr_tail(proc)}"
    return last_json(out)


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


def one_worker_frames(spec: FusionSpec, samples: Iterable[Sample]) -> dict[int, FrameRecord]:
    """The frames of ``samples`` (computed offline: what one worker gives when no stream is
    late), by reference stamp."""
    return {r.reference_stamp_ns: r for r in offline_frames(spec, samples)}


async def frames_killing_one(
    frames_sub: Subscription,
    expected: Iterable[int] | None,
    victim: subprocess.Popen[str] | None,
    kill_at: float | None,
    quiet_s: float = 8.0,
    *,
    kill_after_frames: int | None = None,
) -> tuple[list[MultiModalFrame], int]:
    """Receive frames until every ``expected`` one came (reference stamps; None: any) or none
    came for ``quiet_s``, SIGKILLing ``victim`` at ``kill_at`` (monotonic s; None: never).
    ``kill_after_frames``: SIGKILL it once that many frames came instead. Returns the frames and
    how many had come when the victim was killed."""
    frames: list[MultiModalFrame] = []
    missing = set(expected) if expected is not None else {-1}
    killed_at = -1
    armed = victim is not None and (kill_at is not None or kill_after_frames is not None)
    while missing:
        due = (kill_at is not None and time.monotonic() >= kill_at) or (
            kill_after_frames is not None and len(frames) >= kill_after_frames
        )
        if armed and killed_at < 0 and due:
            victim.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
            killed_at = len(frames)
        try:
            timed = armed and killed_at < 0 and kill_at is not None
            wait_s = max(0.05, kill_at - time.monotonic()) if timed else quiet_s  # type: ignore[operator]
            frame = decode_frame((await frames_sub.recv(timeout_s=wait_s)).payload)
        except TimeoutError:
            if killed_at >= 0 or not timed:
                break  # nothing for quiet_s: the rest is lost
            continue
        frames.append(frame)
        missing.discard(frame.reference_stamp_ns)
    return frames, killed_at


def stop_all(procs: Iterable[subprocess.Popen[str] | None]) -> list[str]:
    """SIGINT the processes still running; their standard outputs."""
    procs = list(procs)
    for p in procs:
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGINT)
    return [_ended(p) if p is not None else "" for p in procs]


def _ended(proc: subprocess.Popen[str]) -> str:
    """Its standard output once it ended; killed after 30 s (a test never leaves one behind)."""
    try:
        return proc.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[0]


def fusion_log(procs: Iterable[subprocess.Popen[str]]) -> str:
    """What workers started by :func:`spawn` logged of fusion (waits on reconnecting inputs,
    streams given up), without the client libraries' lines."""
    lines = []
    for i, proc in enumerate(procs):
        err = _STDERR.get(proc.pid)
        if err is not None:
            err.seek(0)
            lines += [f"[{i}] {line}" for line in err.read().splitlines() if "embodied_bus" in line]
    return "\n".join(lines[-40:])


def assert_one_workers_frames(
    frames: list[MultiModalFrame],
    expected: dict[int, FrameRecord],
    summaries: list[Any],
    log: str = "",
) -> list[int]:
    """Each frame once, each with the members computed offline, none lost (``log``: what the
    workers logged, for the failure message). The lost ones."""
    keys = [f.reference_stamp_ns for f in frames]
    twice = sorted({i for i, k in enumerate(keys) if keys.count(k) > 1})
    order = sorted(set(keys))
    assert not twice, (
        f"frames published twice: arrival index {twice}, frame index "
        f"{sorted({order.index(keys[i]) for i in twice})} of {len(order)}; worker summaries {summaries}"
    )
    got = {f.reference_stamp_ns: frame_record(f) for f in frames}
    differ = {k: (got[k], expected.get(k)) for k in got if got[k] != expected.get(k)}
    assert not differ, (
        f"{len(differ)} of {len(got)} frames differ from the offline ones: {list(differ.items())[:3]}\n{log}"
    )
    lost = sorted(set(expected) - set(got))
    assert all(not s["foreign_clock"] for s in summaries), summaries
    assert all(s.get("outside_slots", 0) == 0 for s in summaries), summaries
    assert not lost, f"lost {len(lost)} frame(s): {lost[:10]}\n{log}"
    return lost


def recorded_samples(
    path: Path, topics: tuple[str, ...], spec: FusionSpec, duration_s: float
) -> list[Sample]:
    """The recording's samples as replay publishes them (its first ``duration_s`` of log time),
    in its order."""
    seqs: dict[str, int] = {}
    out = []
    first: int | None = None
    for m in read_recording(path, topics=list(topics)):
        assert isinstance(m, RecordedMessage)
        first = m.log_time_ns if first is None else first
        if m.log_time_ns - first > duration_s * 1e9:
            break
        stream = topic_to_stream(m.topic)
        seqs[stream] = seqs.get(stream, 0) + 1
        h = Header(
            stream=stream,
            modality=Modality.parse(modality_of(m.msgtype)),
            seq=seqs[stream],
            stamp_ns=m.stamp_ns,
            bucket=spec.clock.bucket_of(m.stamp_ns),
            bucket_width_ns=spec.clock.width_ns,
            bucket_offset_ns=spec.clock.offset_ns,
            encoding=f"cdr:{m.msgtype}",
            frame_id=m.frame_id,
            publisher_id=hash(stream) & 0xFFFFFFFF,
            publish_ns=m.log_time_ns,
            flags=HeaderFlags.NONE,
        )
        out.append(Sample(h, b"", m.log_time_ns))
    return out
