"""``embodied-bus plot``: a fusion timeline PNG from frames JSON lines or an MCAP recording."""

from __future__ import annotations

import argparse

from embodied_bus.viz.timeline import load_frame_summaries, plot_timeline

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("plot", help="draw which modalities arrived per frame, skew and latency")
    p.add_argument("source", metavar="FRAMES.jsonl|MCAP")
    p.add_argument("-o", "--out", default="timeline.png", help="PNG to write (default timeline.png)")
    p.add_argument("--title", default="")
    p.set_defaults(func=run)


async def run(args: argparse.Namespace) -> int:
    frames = load_frame_summaries(args.source)
    out = plot_timeline(frames, args.out, title=args.title)
    print(f"wrote {out} ({len(frames)} frames)")
    return 0
