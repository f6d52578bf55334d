"""Fusion timeline PNG: per frame, which modalities arrived, the skew and the latency."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from embodied_bus.errors import EmbodiedBusError
from embodied_bus.rosmsg.conversions import typestore

__all__ = ["added_latency_series", "load_frame_summaries", "plot_timeline"]


def load_frame_summaries(path: str | Path) -> list[dict[str, Any]]:
    """Frame summaries from ``fuse --frames-out`` JSON lines or from an MCAP made by ``record``
    (its ``/frames/<name>/meta`` channels).

    Raises:
        EmbodiedBusError: The file is missing, empty or not one of those formats.
    """
    p = Path(path)
    if not p.exists():
        raise EmbodiedBusError(f"{str(p)!r} does not exist")
    frames: list[dict[str, Any]] = []
    if p.suffix == ".mcap":
        from mcap.reader import make_reader

        with open(p, "rb") as fh:
            for schema, channel, message in make_reader(fh).iter_messages():
                if (
                    channel.topic.endswith("/meta")
                    and schema is not None
                    and schema.name == "std_msgs/msg/String"
                ):
                    text = typestore().deserialize_cdr(message.data, "std_msgs/msg/String").data
                    frames.append(json.loads(text))
    else:
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if line.strip():
                try:
                    frames.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise EmbodiedBusError(f"{p}:{n}: not a JSON frame line: {err}") from err
    frames = [f for f in frames if f.get("pane", 0) == 0 and "bucket" in f]
    if not frames:
        raise EmbodiedBusError(f"no frames in {str(p)!r}")
    return sorted(frames, key=lambda f: f["reference_stamp_ns"])


def added_latency_series(frames: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """The latency fusion added per frame (ms; NaN where none), split into the frames that
    completed and those forced out by the lateness bound or the end of the stream (these wait
    longest, and are drawn apart so they are not read as the pipeline's usual latency)."""
    nan = float("nan")
    usual, forced = [], []
    for f in frames:
        v = f.get("added_latency_ms")
        ms = nan if v is None else float(v)
        usual.append(nan if f.get("forced") else ms)
        forced.append(ms if f.get("forced") else nan)
    return usual, forced


def _clip_outliers(ax: Any, values: list[list[float]], unit: str) -> None:
    """Keep a panel readable: if a few points lie far above the rest (a blackout's forced
    frames, a stalled sensor), cut the axis at a little above the 99th percentile and mark the
    points above it at the top edge, saying how many and up to how far."""
    import numpy as np

    flat = np.asarray([v for series in values for v in series], dtype=float)
    flat = flat[np.isfinite(flat)]
    if flat.size < 20:
        return
    p99, top = float(np.percentile(flat, 99)), float(flat.max())
    if top <= 3 * p99 or p99 <= 0:
        return
    limit = 1.3 * p99
    ax.set_ylim(bottom=0, top=limit)
    above = int((flat > limit).sum())
    ax.text(
        0.01,
        0.97,
        f"{above} point(s) above, up to {top:.0f} {unit}: axis cut at {limit:.0f} {unit}",
        transform=ax.transAxes,
        fontsize=8,
        va="top",
        color="#c0392b",
    )


def plot_timeline(frames: list[dict[str, Any]], out: str | Path, *, title: str = "") -> Path:
    """Draw the timeline and write a PNG.

    Rows: one band per stream (green = present, red = missing, grey = no data expected);
    then each stream's largest |member stamp - reference stamp| per frame, then added and
    end-to-end latency (ms). Far outliers are cut off at the top of their panel and counted.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    streams = sorted({s for f in frames for s in list(f.get("members", {})) + list(f.get("missing", []))})
    t0 = frames[0]["reference_stamp_ns"]
    t = np.array([(f["reference_stamp_ns"] - t0) / 1e9 for f in frames])
    width = np.median(np.diff(t)) if len(t) > 1 else 0.1
    fig, axes = plt.subplots(
        3,
        1,
        figsize=(12, 2.2 + 0.45 * len(streams) + 4),
        sharex=True,
        gridspec_kw={"height_ratios": [max(1.0, 0.45 * len(streams)), 1.4, 1.4]},
    )
    ax = axes[0]
    for row, stream in enumerate(streams):
        present = [stream in f.get("members", {}) for f in frames]
        missing = [stream in f.get("missing", []) for f in frames]
        colors = [
            "#2e9d4f" if p else "#d6404a" if m else "#d9d9d9" for p, m in zip(present, missing, strict=True)
        ]
        ax.bar(t, 0.8, width=width * 0.95, bottom=row - 0.4, color=colors, align="center", linewidth=0)
    ax.set_yticks(range(len(streams)), streams)
    ax.set_ylim(-0.6, len(streams) - 0.4)
    n_complete = sum(1 for f in frames if f.get("complete"))
    ax.set_title(
        title
        or f"{len(frames)} frames, {100 * n_complete / len(frames):.1f} % complete "
        "(green: present, red: missing)"
    )
    skews: list[list[float]] = []
    for stream in streams:  # each stream's largest |member stamp - reference stamp| per frame
        sk = [
            max(abs(float(m.get("skew_ms") or 0.0)) for m in f["members"][stream])
            if f.get("members", {}).get(stream) and isinstance(f["members"][stream][0], dict)
            else np.nan
            for f in frames
        ]
        if np.nanmax(np.asarray(sk, dtype=float), initial=0.0) > 0:
            axes[1].plot(t, sk, ".", ms=3, label=stream)
            skews.append(sk)
    _clip_outliers(axes[1], skews, "ms")
    axes[1].set_ylabel("|skew| to\nreference (ms)")
    if axes[1].get_legend_handles_labels()[0]:
        axes[1].legend(loc="upper right", fontsize=8)
    e2e = [f.get("end_to_end_ms") for f in frames]
    e2e_ok = [v for v in e2e if v is not None and abs(v) < 60_000]
    if len(e2e_ok) == len(e2e):
        axes[2].plot(t, e2e, ".", ms=3, label="end to end", color="#7a4fb0")
    else:
        axes[2].set_title(
            "end-to-end latency not drawn: stamps are not on the wall clock (a replayed recording)",
            fontsize=8,
        )
    usual, late = added_latency_series(frames)
    axes[2].plot(
        t,
        usual,
        ".",
        ms=3,
        label="added by fusion",
        color="#e08a1e",
    )
    if not np.all(np.isnan(np.asarray(late, dtype=float))):
        # frames the lateness bound or the end of the stream forced out wait longest: marked
        # apart so they are not read as the pipeline's usual added latency
        axes[2].plot(
            t,
            late,
            "x",
            ms=5,
            label="added, frame forced out (lateness bound or end of stream)",
            color="#c0392b",
        )
    _clip_outliers(axes[2], [usual, late, [v for v in e2e if v is not None]], "ms")
    axes[2].set_ylabel("latency\n(ms)")
    axes[2].legend(loc="upper right", fontsize=8)
    axes[2].set_xlabel("sensor time since the first frame's reference stamp (s)")
    for a in axes[1:]:
        a.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
