"""``embodied-bus fuse``: run a fusion worker with a live summary."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import IO, Any

from embodied_bus.bus import open_bus
from embodied_bus.cli.common import add_bus_args, add_metrics_arg, fmt_ms, install_stop_signals, serve_until
from embodied_bus.cli.view import add_view_arg, serving_view
from embodied_bus.fusion.codec import frame_summary
from embodied_bus.fusion.frame import MultiModalFrame
from embodied_bus.fusion.spec import load_spec
from embodied_bus.fusion.stages import load_stages, run_stage
from embodied_bus.fusion.worker import FusionWorker, ScaleOutMode, frames_stream
from embodied_bus.metrics import MetricsExporter

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("fuse", help="assemble one multi-modal frame per reference sample from sensor streams")
    p.add_argument("--config", required=True, help="fusion spec YAML (see config/fusion.yaml)")
    add_bus_args(p)
    add_view_arg(p)
    p.add_argument("--frames-out", metavar="FILE", help="write one JSON line per frame")
    p.add_argument("--duration", type=float, default=0.0, help="stop after S seconds (0 = Ctrl-C)")
    p.add_argument("--json", action="store_true", help="print the final summary as JSON")
    p.add_argument(
        "--scale-out",
        choices=[m.value for m in ScaleOutMode],
        default=None,
        help="share the frames with other workers of the same spec: ring (Zenoh ownership ring) "
        "or key-shared (Pulsar Key_Shared slots of the reference stream)",
    )
    p.add_argument("--worker-id", default=None, help="ring member id (default: random)")
    p.add_argument("--stages", metavar="FILE", help="also run the stages of this YAML in this process")
    add_metrics_arg(p)
    p.set_defaults(func=run)


def status_line(m: dict[str, Any]) -> str:
    """One line of a pipeline's figures: frames, completeness, skew and added latency p50/p99,
    and what the frames waited on."""
    waits = ", ".join(f"{name} {n}" for name, n in list(m["waited_on"].items())[:3]) or "nothing"
    return (
        f"frames {m['frames']} ({m['frames_per_s']}/s)  complete {m['completeness_pct']}%  "
        f"skew p50/p99 {fmt_ms(m['skew_p50_ms'])}/{fmt_ms(m['skew_p99_ms'])}  "
        f"added latency p50/p99 {fmt_ms(m['added_latency_p50_ms'])}/{fmt_ms(m['added_latency_p99_ms'])} "
        f"({m['forced']} forced)  waited on {waits}  late {m['late']}"
    )


async def run(args: argparse.Namespace) -> int:
    spec = load_spec(args.config)
    stages = load_stages(args.stages) if args.stages else []
    stop = asyncio.Event()
    install_stop_signals(stop)
    out: IO[str] | None = open(args.frames_out, "w") if args.frames_out else None  # noqa: SIM115

    def on_frame(frame: MultiModalFrame, emitted_ns: int) -> None:
        if out is not None:
            out.write(json.dumps(frame_summary(frame, emitted_ns)) + "\n")

    try:
        async with open_bus(args.bus, namespace=args.ns) as bus, serving_view(bus, args.view):
            worker = FusionWorker(
                bus, spec, on_frame=on_frame, scale_out=args.scale_out, worker_id=args.worker_id
            )
            exporter = MetricsExporter(args.metrics_port) if args.metrics_port is not None else None
            if exporter is not None:
                exporter.add_fusion(worker.summary)
            task = asyncio.create_task(worker.run(stop))
            stage_tasks = [asyncio.create_task(run_stage(bus, st, stop)) for st in stages]
            ready = asyncio.ensure_future(worker.ready.wait())
            await asyncio.wait([task, ready], return_when=asyncio.FIRST_COMPLETED)
            ready.cancel()
            if not args.json and not task.done():
                print(
                    f"fusing {', '.join(s.name for s in spec.streams)} -> {frames_stream(spec)} "
                    f"on {args.bus}",
                    flush=True,
                )

            def status() -> None:
                if args.json:
                    return
                print(status_line(worker.metrics.as_dict()), flush=True)

            await serve_until(
                stop, [task, *stage_tasks], duration_s=args.duration, every_s=2.0, on_tick=status
            )
            await task
            await asyncio.gather(*stage_tasks)
            summary = worker.summary()
            if exporter is not None:
                exporter.close()
    finally:
        if out is not None:
            out.close()
    print(json.dumps(summary, indent=None if not args.json else 2), file=sys.stdout)
    return 0
