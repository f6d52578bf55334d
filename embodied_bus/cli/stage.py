"""``embodied-bus stage``: run processing stages in their own process."""

from __future__ import annotations

import argparse
import asyncio
import json

from embodied_bus.bus import open_bus
from embodied_bus.cli.common import add_bus_args, install_stop_signals, serve_until
from embodied_bus.fusion.stages import load_stages, run_stage

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("stage", help="run processing stages (voxel downsample, crop, merge lidars)")
    p.add_argument("--config", required=True, help="YAML with a stages: list (see config/stages.yaml)")
    p.add_argument("--name", action="append", help="run only these stages (repeatable)")
    add_bus_args(p)
    p.add_argument("--duration", type=float, default=0.0, help="stop after S seconds (0 = Ctrl-C)")
    p.set_defaults(func=run)


async def run(args: argparse.Namespace) -> int:
    specs = [s for s in load_stages(args.config) if not args.name or s.name in args.name]
    if not specs:
        raise SystemExit(f"no stage selected from {args.config}")
    stop = asyncio.Event()
    install_stop_signals(stop)
    async with open_bus(args.bus, namespace=args.ns) as bus:
        tasks = [asyncio.create_task(run_stage(bus, s, stop)) for s in specs]
        print(f"running {', '.join(s.name for s in specs)} on {args.bus}", flush=True)
        await serve_until(stop, tasks, duration_s=args.duration)
        results = await asyncio.gather(*tasks)
    print(
        json.dumps(
            {
                s.name: {"processed": r.processed, "published": r.published, "failed": r.failed}
                for s, r in zip(specs, results, strict=True)
            }
        )
    )
    return 0
