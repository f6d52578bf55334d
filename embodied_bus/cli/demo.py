"""``embodied-bus demo``: the whole product on a real recording, on embedded Zenoh.

The shipped ``tilt_laser`` recording (LaserScan, IMU, GPS; MPL-2.0) is replayed into the bus by a
"robot" session, a fusion worker assembles one frame per scan, a planner sends an action for every
ten fused frames to three executors (one of them fails its first attempts, so those actions are
retried elsewhere) plus one poison action that ends in the dead-letter queue, a recorder writes the
streams and frames to MCAP, and the run ends with a summary, a timeline PNG and the MCAP file.
``--synthetic`` runs synthetic lidar / camera / GPS / IMU publishers instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embodied_bus.actions import (
    Action,
    ActionContext,
    ActionHandle,
    ActionStatus,
    Executor,
    Planner,
    QueueService,
    RetryPolicy,
)
from embodied_bus.bus import open_bus
from embodied_bus.cli.common import fmt_ms, fmt_table, install_stop_signals
from embodied_bus.cli.replay import mapping_from_config
from embodied_bus.cli.streams import drain, stream_rows
from embodied_bus.cli.view import add_view_arg, serving_view
from embodied_bus.fusion.codec import frame_summary
from embodied_bus.fusion.frame import MultiModalFrame
from embodied_bus.fusion.spec import FusionSpec, load_spec
from embodied_bus.fusion.worker import FusionWorker, frames_stream
from embodied_bus.model.qos import SubscriptionOptions
from embodied_bus.replay.player import ReplayOptions, replay
from embodied_bus.replay.recorder import record
from embodied_bus.ros.launching import share_dirs
from embodied_bus.sim.synthetic import DEFAULT_SENSORS, run_sensor
from embodied_bus.testing.ports import free_port
from embodied_bus.viz.timeline import plot_timeline

__all__ = ["add_parser", "demo_files"]

LIVE_COLUMNS = [
    "stream",
    "received",
    "rate_hz",
    "bandwidth_MBps",
    "gaps",
    "dropped",
    "latency_p50_ms",
    "latency_p99_ms",
]


def demo_files() -> tuple[Path, Path]:
    """The shipped recording and the demo config: through the ament index, in this Python's
    ``share/``, or in the source tree."""
    for base in share_dirs():
        bag, cfg = base / "data" / "tilt_laser" / "tilt_laser.bag", base / "config" / "demo.yaml"
        if bag.exists() and cfg.exists():
            return bag, cfg
    where = ", ".join(map(str, share_dirs()))
    raise SystemExit(f"demo data (data/tilt_laser/tilt_laser.bag, config/demo.yaml) not found in {where}")


#: How long ``demo --synthetic`` runs without ``--duration``, seconds.
SYNTHETIC_S = 10.0


def _positive_s(text: str) -> float:
    """An argparse type: seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="replay a real recording, fuse it, record MCAP, draw a timeline")
    p.add_argument("--rate", type=float, default=2.0, help="replay speed (default 2x: ~9 s)")
    p.add_argument("--out", default="out/demo", help="directory for frames.jsonl, demo.mcap, timeline.png")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--synthetic", action="store_true", help="synthetic sensors instead of the recording")
    p.add_argument(
        "--duration",
        type=_positive_s,
        default=None,
        metavar="S",
        help="replay only the recording's first S seconds (--synthetic: run S seconds, default 10)",
    )
    add_view_arg(p)
    p.set_defaults(func=run)


def live_status(elapsed_s: float, replayed: float, worker: FusionWorker, fleet: ActionDemo) -> str:
    """One line of progress: replay, frames, skew, late samples and actions."""
    m = worker.metrics.as_dict()
    return (
        f"t={elapsed_s:4.1f}s replay {100 * replayed:5.1f}%  frames {m['frames']} complete "
        f"{m['completeness_pct']}%  skew p99 {fmt_ms(m['skew_p99_ms'])}  late {m['late']}  "
        f"actions {fleet.progress()}"
    )


class FrameLog:
    """The demo's frames: one JSON line each, and every tenth bucket to the planner."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = path.open("w")
        self.summaries: list[dict[str, Any]] = []
        self.buckets: asyncio.Queue[int] = asyncio.Queue()

    def __call__(self, frame: MultiModalFrame, emitted_ns: int) -> None:
        line = frame_summary(frame, emitted_ns)
        self.summaries.append(line)
        self.file.write(json.dumps(line) + "\n")
        if len(self.summaries) % ACTION_EVERY_FRAMES == 0:
            self.buckets.put_nowait(frame.bucket)  # the planner reacts to perception

    def close(self) -> None:
        self.file.close()


async def run(args: argparse.Namespace) -> int:
    if args.synthetic:
        return await run_synthetic(args)
    bag, cfg = demo_files()
    spec = load_spec(cfg)
    mapping = mapping_from_config(str(cfg))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    if not args.json:
        print(
            f"embodied_bus demo: replaying {bag.name} ({', '.join(sorted(mapping))}) over embedded Zenoh "
            f"(tcp/127.0.0.1:{port}) at {args.rate:g}x, fusing into {frames_stream(spec)}",
            flush=True,
        )
    t0 = time.monotonic()
    frames = FrameLog(out / "frames.jsonl")
    try:
        results = await run_pipeline(args, Pipeline(bag, spec, mapping, out, port), frames)
    finally:
        frames.close()
    png = (
        plot_timeline(
            frames.summaries, out / "timeline.png", title=f"{bag.name}: {len(frames.summaries)} frames"
        )
        if frames.summaries
        else None
    )
    summary = {
        "recording": str(bag),
        "rate": args.rate,
        "wall_s": round(time.monotonic() - t0, 2),
        **{k: results[k] for k in ("replayed", "streams", "fusion", "actions")},
        "outputs": {
            "frames": str(frames.path),
            "mcap": str(out / "demo.mcap"),
            "timeline_png": str(png) if png else None,
            "mcap_messages": results["mcap_messages"],
        },
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary)
    return 0 if summary["fusion"]["frames"] > 0 and summary["actions"]["dead_letters"] else 1


@dataclass(frozen=True, slots=True)
class Pipeline:
    """What the demo runs: the recording, its fusion spec, topic → stream names, where to write."""

    bag: Path
    spec: FusionSpec
    mapping: dict[str, str]
    out: Path
    port: int


async def run_pipeline(args: argparse.Namespace, p: Pipeline, frames: FrameLog) -> dict[str, Any]:
    """Replay the recording on a "robot" bus; fuse, act and record on a "cloud" bus."""
    stop = asyncio.Event()
    install_stop_signals(stop)
    streams = sorted(p.mapping.values())
    async with (
        open_bus(f"zenoh:?listen=tcp/127.0.0.1:{p.port}", namespace="demo") as robot,
        open_bus(f"zenoh://127.0.0.1:{p.port}", namespace="demo") as cloud,
        serving_view(cloud, args.view),
    ):
        worker = FusionWorker(cloud, p.spec, on_frame=frames, idle_flush_s=0.5)
        fleet = await ActionDemo.start(robot, cloud, p.out / "actions.db")
        worker_stop, rec_stop, rec_ready, mon_stop = (asyncio.Event() for _ in range(4))
        worker_task = asyncio.create_task(worker.run(worker_stop))
        rec_task = asyncio.create_task(
            record(cloud, p.out / "demo.mcap", [*streams, frames_stream(p.spec)], rec_stop, ready=rec_ready)
        )
        monitor = await cloud.subscribe(streams, options=SubscriptionOptions(capacity=4096))
        mon_task = asyncio.create_task(drain(monitor, mon_stop))
        await worker.ready.wait()
        await rec_ready.wait()
        progress = {"frac": 0.0}
        opts = ReplayOptions(
            rate=args.rate,
            topics=tuple(p.mapping),
            mapping=p.mapping,
            clock=p.spec.clock,
            duration_s=args.duration,
        )
        replay_task = asyncio.create_task(
            replay(robot, [p.bag], opts, stop=stop, progress=lambda f, n: progress.update(frac=f))
        )
        planner_task = asyncio.create_task(fleet.plan(frames.buckets, replay_task))
        t0 = time.monotonic()
        while not replay_task.done():
            await asyncio.wait({replay_task}, timeout=1.0)
            status = live_status(time.monotonic() - t0, progress["frac"], worker, fleet)
            if sys.stdout.isatty() and not args.json:
                print(
                    "\x1b[2J\x1b[H" + status + "\n\n" + fmt_table(stream_rows(monitor), LIVE_COLUMNS),
                    flush=True,
                )
            elif not args.json:
                print(status, flush=True)
        deadline = time.monotonic() + 5
        while worker.assembler.pending_frames and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # the worker flushes once input stops
        worker_stop.set()
        await worker_task
        await planner_task
        actions = await fleet.finish()
        await asyncio.sleep(0.3)  # the last frames and results reach the recorder
        rec_stop.set()
        mon_stop.set()
        recorded = await rec_task
        await mon_task
        return {
            "replayed": replay_task.result().as_dict(),
            "streams": stream_rows(monitor),
            "fusion": worker.summary(),
            "actions": actions,
            "mcap_messages": recorded,
        }


def fusion_summary(fusion: dict[str, Any]) -> str:
    """A pipeline's figures for a person: frames, completeness, skew per stream, added latency
    p50/p99 and what the slowest frames waited on (``n/a`` where a figure is undefined)."""
    by_stream = ", ".join(
        f"{name} {fmt_ms(v['p50'])}/{fmt_ms(v['p99'])}" for name, v in fusion["skew_ms_by_stream"].items()
    )
    waits = ", ".join(f"{name} {n}" for name, n in fusion["waited_on"].items()) or "nothing"
    slowest = "; ".join(
        f"{f['added_latency_ms']} ms (waited on {f['waited_on']}{', forced' if f['forced'] else ''})"
        for f in fusion["slowest_frames"][:3]
    )
    return (
        f"{fusion['frames']} frames, {fusion['completeness_pct']}% complete, "
        f"{fusion['reference_lost']} with the reference lost, presence {fusion['presence_pct']}\n"
        f"  skew p50/p99 to the reference by stream: {by_stream or 'n/a'}\n"
        f"  added latency p50/p99 {fmt_ms(fusion['added_latency_p50_ms'])}/"
        f"{fmt_ms(fusion['added_latency_p99_ms'])} ({fusion['forced']} frames forced out by the "
        f"lateness bound or the end of the data); the frames waited last on: {waits}; "
        f"slowest: {slowest or 'n/a'}; late samples {fusion['late']}"
    )


def print_summary(summary: dict[str, Any]) -> None:
    """The demo's summary for a person: streams, fusion, actions and where the outputs are."""
    streams, fusion, actions = summary["streams"], summary["fusion"], summary["actions"]
    print("\nstreams")
    print(fmt_table(streams, ["stream", "received", "gaps", "dropped", "latency_p50_ms", "latency_p99_ms"]))
    print(f"\nfusion: {fusion_summary(fusion)}")
    print(
        f"actions: {actions['succeeded']} of {actions['submitted']} succeeded on executors "
        f"{actions['by_executor']}; {len(actions['retried'])} retried on another executor after a "
        f"failure; dead letters: {[(d['kind'], d['reasons'][-1]) for d in actions['dead_letters']]}"
    )
    print(
        f"outputs: {summary['outputs']['frames']}, {summary['outputs']['mcap']}, "
        f"{summary['outputs']['timeline_png']}"
    )


#: The planner sends a navigate_to action for every this many fused frames.
ACTION_EVERY_FRAMES = 10


class ActionDemo:
    """Three executors (one faulty) and a planner on the demo's buses, with one poison action."""

    def __init__(
        self,
        service_task: asyncio.Task[None],
        executors: list[Executor],
        tasks: list[Any],
        planner: Planner,
        stop: asyncio.Event,
        service_stop: asyncio.Event,
    ) -> None:
        self.service_task = service_task
        self.service_stop = service_stop
        self.executors = executors
        self.tasks = tasks
        self.planner = planner
        self.stop = stop
        self.handles: list[ActionHandle] = []

    @classmethod
    async def start(cls, robot: Any, cloud: Any, db: Path) -> ActionDemo:
        for suffix in ("", "-wal", "-shm"):
            Path(str(db) + suffix).unlink(missing_ok=True)
        stop, ready = asyncio.Event(), asyncio.Event()
        policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.05, max_backoff_s=0.5)
        service_stop = asyncio.Event()  # the queue stops after its executors
        service_task = asyncio.create_task(QueueService(cloud, db, policy).run(service_stop, ready))
        await ready.wait()
        executors = []
        for name in ("exec-a", "exec-b", "exec-flaky"):
            ex = Executor(robot, name)

            async def navigate_to(action: Action, ctx: ActionContext, name: str = name) -> dict[str, Any]:
                if name == "exec-flaky" and ctx.attempt == 1:
                    raise RuntimeError("motor stalled (injected fault)")
                ctx.feedback({"progress": 1.0})
                await asyncio.sleep(0.02)
                return {"bucket": action.payload["bucket"], "by": name, "attempt": ctx.attempt}

            async def inspect(action: Action, ctx: ActionContext) -> None:
                raise ValueError("camera calibration file missing (poison action)")

            ex.handler("navigate_to")(navigate_to)
            ex.handler("inspect")(inspect)
            executors.append(ex)
        tasks = [asyncio.create_task(ex.run(stop)) for ex in executors]
        planner = Planner(cloud)
        for _ in range(100):
            try:
                await planner.backlog()
                break
            except Exception:
                await asyncio.sleep(0.05)
        return cls(service_task, executors, tasks, planner, stop, service_stop)

    async def plan(self, buckets: asyncio.Queue[int], until: asyncio.Task[Any]) -> None:
        """Send one poison action, then a navigate_to per batch of fused frames."""
        self.handles.append(await self.planner.submit("inspect", {"target": "dock"}, priority=1))
        while not (until.done() and buckets.empty()):
            try:
                bucket = await asyncio.wait_for(buckets.get(), 0.2)
            except TimeoutError:
                continue
            self.handles.append(await self.planner.submit("navigate_to", {"bucket": bucket}, priority=5))

    def progress(self) -> str:
        done = sum(ex.completed for ex in self.executors)
        failed = sum(ex.failed for ex in self.executors)
        return f"{len(self.handles)} sent, {done} done, {failed} failed attempts"

    async def finish(self) -> dict[str, Any]:
        """Wait for every action to end, stop the fleet, and summarize."""
        ended = [await h.result(timeout_s=30) for h in self.handles]
        self.stop.set()
        await asyncio.gather(*self.tasks)
        self.service_stop.set()
        await self.service_task
        ok = [a for a in ended if a.status is ActionStatus.SUCCEEDED]
        by: dict[str, int] = {}
        for a in ok:
            by[a.attempts[-1].executor] = by.get(a.attempts[-1].executor, 0) + 1
        return {
            "submitted": len(ended),
            "succeeded": len(ok),
            "by_executor": dict(sorted(by.items())),
            "retried": [
                {
                    "id": a.id[:8],
                    "executors": [t.executor for t in a.attempts],
                    "first_failure": a.attempts[0].reason,
                }
                for a in ok
                if a.attempt_count > 1
            ],
            "dead_letters": [
                {
                    "id": a.id[:8],
                    "kind": a.kind,
                    "reasons": [t.reason for t in a.attempts],
                    "executors": [t.executor for t in a.attempts],
                }
                for a in ended
                if a.status is ActionStatus.DEAD
            ],
        }


async def run_synthetic(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    install_stop_signals(stop)
    port = free_port()
    tty = sys.stdout.isatty() and not args.json
    async with (
        open_bus(f"zenoh:?listen=tcp/127.0.0.1:{port}", namespace="demo") as robot,
        open_bus(f"zenoh://127.0.0.1:{port}", namespace="demo") as monitor,
        serving_view(monitor, args.view),
    ):
        sub = await monitor.subscribe(None, options=SubscriptionOptions(capacity=4096))
        pubs = [
            await robot.publisher(s.stream, modality=s.modality, encoding=s.encoding, frame_id=s.frame_id)
            for s in DEFAULT_SENSORS
        ]
        for p in pubs:
            await p.wait_for_subscribers(5.0)
        drainer = asyncio.create_task(drain(sub, stop))
        sensors = [
            asyncio.create_task(run_sensor(p, s, stop, seed=i))
            for i, (p, s) in enumerate(zip(pubs, DEFAULT_SENSORS, strict=True))
        ]
        t0 = time.monotonic()
        while not stop.is_set() and time.monotonic() - t0 < (args.duration or SYNTHETIC_S):
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass
            if not args.json:
                table = fmt_table(stream_rows(sub), LIVE_COLUMNS)
                prefix = "\x1b[2J\x1b[H" if tty else "-- "
                print(f"{prefix}t = {time.monotonic() - t0:4.1f} s\n{table}", flush=True)
        stop.set()
        sent = dict(zip([s.stream for s in DEFAULT_SENSORS], await asyncio.gather(*sensors), strict=True))
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and any(
            sub.stats.get(k) is None or sub.stats[k].received < v for k, v in sent.items()
        ):
            await asyncio.sleep(0.02)
        await drainer
        rows = stream_rows(sub)
        for r in rows:
            r["sent"] = sent.get(str(r["stream"]), 0)
    if args.json:
        print(json.dumps({"streams": rows}, indent=2))
    else:
        print(
            fmt_table(
                rows, ["stream", "sent", "received", "gaps", "dropped", "latency_p50_ms", "latency_p99_ms"]
            )
        )
    return 0 if len(rows) == len(DEFAULT_SENSORS) else 1
