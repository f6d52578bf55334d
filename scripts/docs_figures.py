"""MkDocs hook: draw the documentation's diagrams (SVG, with matplotlib) into docs/images before
each build, so the pictures are made from this source and never drift from it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

IMAGES = Path(__file__).resolve().parents[1] / "docs" / "images"


def fusion_timing(out: Path) -> None:
    """Buckets, sweeps anchoring frames whatever their phase, the IMU windows tiling time, a
    lost sweep, and the lateness bound of one frame."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    period = 99.0  # the lidar's learned period, ms
    width, offset = 100.0, 50.0
    sweeps = [55.0, 147.0, 249.0, 352.0, 451.0, 548.0, 651.0]  # jittering, drifting sweeps
    lost = 4  # this sweep never arrives
    fig, ax = plt.subplots(figsize=(10, 3.4))
    for b in range(-1, 7):
        x = offset + b * width
        if b % 2 == 0:
            ax.axvspan(x, x + width, color="#f0f0f0", zorder=0, lw=0)
        if b >= 0:
            ax.text(x + width / 2, 2.55, f"bucket {b}", ha="center", fontsize=8, color="#777777")
    colors = ["#4c78a8", "#f58518"]
    lo = sweeps[0] - period / 2
    for k, t in enumerate(sweeps):
        hi = t + period / 2
        ax.add_patch(plt.Rectangle((lo, 0.9), hi - lo, 0.5, color=colors[k % 2], alpha=0.18, lw=0))
        for imu in range(int(lo // 5) * 5, int(hi), 5):
            if lo <= imu < hi:
                ax.plot([imu, imu], [1.0, 1.3], color=colors[k % 2], lw=1)
        if k == lost:
            ax.plot([t], [2.0], marker="o", ms=10, mfc="white", mec="#d6404a", mew=1.5)
            ax.text(t, 2.25, "lost: anchored\none period on", ha="center", fontsize=7, color="#d6404a")
        else:
            ax.plot([t], [2.0], marker="o", ms=10, color=colors[k % 2])
        ax.annotate("", xy=(t, 1.45), xytext=(t, 1.85), arrowprops={"arrowstyle": "->", "color": "#555555"})
        lo = hi
    # the lateness bound of one frame: its window end plus the bound (event time)
    t = sweeps[1]
    need = t + period / 2
    ax.annotate(
        "",
        xy=(need + 120, 0.65),
        xytext=(need, 0.65),
        arrowprops={"arrowstyle": "<->", "color": "#c0392b"},
    )
    ax.text(
        need + 60,
        0.05,
        "lateness_ms past what the\nframe needs: a silent stream\nis given up",
        ha="center",
        fontsize=7,
        color="#c0392b",
    )
    ax.text(-45, 2.0, "lidar sweeps\n(reference)", ha="right", va="center", fontsize=8)
    ax.text(-45, 1.15, "IMU, window: around\n(one frame's colour each)", ha="right", va="center", fontsize=8)
    ax.set_title(
        "One frame per sweep: bucket 0 holds two sweeps (two frames), bucket 5 none (no frame)",
        fontsize=9,
    )
    ax.set_xlim(-60, offset + 7 * width)
    ax.set_ylim(-0.1, 2.75)
    ax.set_yticks([])
    ax.set_xlabel("sensor time (ms)")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    fig.savefig(out, format="svg")
    plt.close(fig)


def fleet_deployment(out: Path) -> None:
    """Robots with their own Zenoh bus and an uplink (spool on disk) reach a Pulsar cluster over
    links that drop; fleet services read the robots' namespaces there."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.2))
    ax.set_xlim(0, 100)
    ax.set_ylim(0, 44)
    ax.axis("off")

    def box(x: float, y: float, w: float, h: float, text: str, color: str, size: int = 8) -> None:
        ax.add_patch(plt.Rectangle((x, y), w, h, fc=color, ec="#555555", lw=0.8))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size)

    for i, y in enumerate((28.0, 4.0)):
        name = f"robot r{i + 1}"
        ax.add_patch(plt.Rectangle((1, y), 36, 13, fc="#f4f4f4", ec="#999999", lw=0.8, ls="--"))
        ax.text(2, y + 11.6, f"{name}: its own Zenoh bus", fontsize=8, color="#555555")
        box(3, y + 1.5, 10, 8, "sensors\nfusion\nexecutors", "#dbe8f5", 7)
        box(16, y + 1.5, 9, 8, "queue &\nstate\nservice", "#dbe8f5", 7)
        box(28, y + 1.5, 8, 8, "uplink\n+ spool\n(disk)", "#fde2c8", 7)
        ax.annotate(
            "",
            xy=(57, y + 6),
            xytext=(36, y + 5.5),
            arrowprops={"arrowstyle": "<->", "color": "#c0392b", "ls": "--"},
        )
        ax.text(46.5, y + 7.0, "Wi-Fi / LTE\n(drops)", ha="center", fontsize=7, color="#c0392b")
    ax.add_patch(plt.Rectangle((57, 2), 24, 40, fc="#eef5ea", ec="#999999", lw=0.8))
    ax.text(69, 39.5, "Pulsar cluster", ha="center", fontsize=9)
    for k, y in enumerate((28.0, 19.0)):
        box(60, y, 18, 7, f"broker {k}", "#cfe8c8")
    for k, x in enumerate((60.0, 70.0)):
        box(x, 8, 8, 6, f"bookie {k}", "#e3f1de", 7)
    box(60, 3, 18, 3.5, "metadata store", "#e3f1de", 7)
    box(85, 26, 14, 9, "fleet\nplanners,\ndashboards", "#e8e0f3", 7)
    box(85, 12, 14, 9, "fleet fusion\n(Key_Shared)", "#e8e0f3", 7)
    for y in (30.5, 16.5):
        ax.annotate("", xy=(85, y), xytext=(81, y), arrowprops={"arrowstyle": "<->", "color": "#555555"})
    ax.text(
        46.5,
        0.5,
        "up: chosen streams and frames, by class and rate; down: actions, state",
        ha="center",
        fontsize=7,
        color="#555555",
    )
    fig.savefig(out, format="svg", bbox_inches="tight")
    plt.close(fig)


def on_pre_build(config: Any) -> None:
    IMAGES.mkdir(exist_ok=True)
    fusion_timing(IMAGES / "fusion-timing.svg")
    fleet_deployment(IMAGES / "fleet-deployment.svg")
