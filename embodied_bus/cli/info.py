"""``embodied-bus info``: what a recording holds, as ``ros2 bag info`` prints it, plus what a
replay needs to know (stamp sources, lag behind the log time, gaps, stamps going backwards)."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime

from embodied_bus.cli.common import fmt_table
from embodied_bus.replay.inspect import GAP_FACTOR, RecordingReport, inspect_recording

__all__ = ["add_parser", "describe"]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "info", help="a recording's storage, duration, and per topic: type, count, rate, stamps, gaps"
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="rosbag2 folder, .db3, .mcap or ROS 1 .bag")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def _when(ns: int) -> str:
    return f"{datetime.fromtimestamp(ns / 1e9, UTC).isoformat(timespec='milliseconds')} ({ns / 1e9:.9f})"


def describe(report: RecordingReport) -> str:
    """The report as ``ros2 bag info`` lays it out, with a table of topics."""
    rows = [
        {
            "topic": t.topic,
            "type": t.msgtype,
            "count": t.count,
            "rate_hz": "-" if t.rate_hz is None else f"{t.rate_hz:.2f}",
            "serialization": t.serialization,
            "stamps": t.stamps if t.skipped is None else f"skipped: {t.skipped}",
            "lag_p50_ms": "-" if t.stamp_lag_p50_ms is None else f"{t.stamp_lag_p50_ms:.1f}",
            "gaps": t.gaps,
            "backwards": t.out_of_order,
        }
        for t in report.topics
    ]
    head = [
        f"Files:             {', '.join(report.paths)}",
        f"Storage:           {report.storage}",
        f"Duration:          {report.duration_s:.3f} s",
        f"Start:             {_when(report.start_ns)}",
        f"End:               {_when(report.end_ns)}",
        f"Messages:          {report.message_count}",
        f"Topics:            {len(report.topics)}",
        "",
    ]
    cols = ["topic", "type", "count", "rate_hz", "serialization", "stamps", "lag_p50_ms", "gaps", "backwards"]
    foot = [
        "",
        "stamps: where replay takes each message's stamp (header, or the log time, flagged);",
        "lag_p50_ms: log time minus header stamp; gaps: intervals over "
        f"{GAP_FACTOR:g}x the topic's mean; backwards: header stamps earlier than the one before",
    ]
    return "\n".join([*head, fmt_table(rows, cols), *foot])


async def run(args: argparse.Namespace) -> int:
    def progress(n: int) -> None:
        print(f"read {n} messages...", file=sys.stderr, flush=True)

    report = inspect_recording(args.paths, progress=progress if sys.stderr.isatty() else None)
    print(json.dumps(report.as_dict(), indent=2) if args.json else describe(report))
    return 0
