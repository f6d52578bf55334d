"""MkDocs hook: draw the documentation's diagrams (SVG, matplotlib) into ``docs/img/`` before
each build, from the code below: the data flow, the timing of a fused frame, and a robot
beside a fleet."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch

IMG = Path(__file__).resolve().parents[1] / "docs" / "img"
BOX: dict[str, Any] = {"boxstyle": "round,pad=0.02,rounding_size=0.02", "linewidth": 1.2}
COLORS = {"ros": "#dbeafe", "bus": "#fde68a", "work": "#dcfce7", "out": "#f3e8ff", "fleet": "#fee2e2"}


def _box(ax: Any, x: float, y: float, w: float, h: float, text: str, kind: str) -> None:
    ax.add_patch(FancyBboxPatch((x, y), w, h, facecolor=COLORS[kind], edgecolor="#334155", **BOX))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=9, wrap=True)


def _arrow(ax: Any, a: tuple[float, float], b: tuple[float, float], label: str = "") -> None:
    ax.annotate("", xy=b, xytext=a, arrowprops={"arrowstyle": "->", "color": "#334155", "lw": 1.2})
    if label:
        ax.text((a[0] + b[0]) / 2, (a[1] + b[1]) / 2 + 0.02, label, ha="center", va="bottom", fontsize=7.5)


def _canvas(w: float, h: float) -> tuple[Any, Any]:
    fig, ax = plt.subplots(figsize=(w, h))
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.axis("off")
    return fig, ax


def _save(fig: Any, name: str) -> None:
    IMG.mkdir(exist_ok=True)
    fig.savefig(IMG / name, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)


def dataflow() -> None:
    fig, ax = _canvas(11, 4)
    _box(ax, 0.0, 0.62, 0.15, 0.3, "ROS 2 drivers\nlidar, camera,\nGPS, IMU", "ros")
    _box(ax, 0.0, 0.1, 0.15, 0.3, "Recordings\nrosbag2, MCAP,\nROS 1", "ros")
    _box(ax, 0.21, 0.62, 0.15, 0.3, "sensor_bridge\n(rclpy) or\nros-bridge", "ros")
    _box(ax, 0.21, 0.1, 0.15, 0.3, "replay\n(recorded timing)", "ros")
    bus = "bus\nZenoh (robot)\nor Pulsar (fleet)\n\nstreams:\nstamp, seq,\nbucket"
    _box(ax, 0.42, 0.1, 0.14, 0.82, bus, "bus")
    _box(ax, 0.62, 0.66, 0.17, 0.26, "fusion workers:\na frame\nper sweep", "work")
    _box(ax, 0.62, 0.36, 0.17, 0.22, "action queue:\nexecutors,\nretries, DLQ", "work")
    _box(ax, 0.62, 0.1, 0.17, 0.18, "record (MCAP)", "work")
    _box(ax, 0.84, 0.62, 0.16, 0.3, "frame_bridge,\nmessage_filters:\nback to ROS 2", "out")
    _box(ax, 0.84, 0.24, 0.16, 0.3, "live view\n(Foxglove),\nembodied-bus top", "out")
    _arrow(ax, (0.15, 0.77), (0.21, 0.77), "topics")
    _arrow(ax, (0.15, 0.25), (0.21, 0.25))
    _arrow(ax, (0.36, 0.77), (0.42, 0.77))
    _arrow(ax, (0.36, 0.25), (0.42, 0.25))
    _arrow(ax, (0.56, 0.79), (0.62, 0.79))
    _arrow(ax, (0.56, 0.47), (0.62, 0.47), "actions")
    _arrow(ax, (0.56, 0.19), (0.62, 0.19))
    _arrow(ax, (0.79, 0.79), (0.84, 0.79), "frames")
    _arrow(ax, (0.79, 0.42), (0.84, 0.42))
    _save(fig, "dataflow.svg")


def timing() -> None:
    fig, ax = plt.subplots(figsize=(9, 3.2))
    width, offset = 100, 50
    for i in range(5):
        x = offset + i * width
        ax.axvline(x, color="#94a3b8", lw=0.8, ls="--")
        ax.text(x + width / 2, 3.75, f"bucket {i}", ha="center", fontsize=8, color="#475569")
    sweeps = [93, 194, 296, 397, 497]  # a 9.9 Hz lidar drifting through its buckets
    camera = [t for t in range(0, 560, 33)]
    imu = list(range(0, 560, 10))
    ax.scatter(sweeps, [3] * len(sweeps), marker="|", s=400, color="#1d4ed8", label="lidar (reference)")
    ax.scatter(camera, [2] * len(camera), marker="|", s=200, color="#15803d", label="camera (nearest)")
    ax.scatter(imu, [1] * len(imu), marker="|", s=80, color="#b45309", label="IMU (all, around)")
    s = sweeps[2]
    mid_lo, mid_hi = (sweeps[1] + s) / 2, (s + sweeps[3]) / 2
    ax.axvspan(mid_lo, mid_hi, ymin=0.12, ymax=0.35, color="#fde68a", alpha=0.7)
    ax.text(mid_hi + 5, 1.35, "IMU window of this sweep:\nbetween the midpoints", fontsize=8, color="#92400e")
    near = min(camera, key=lambda t: abs(t - s))
    ax.annotate("", xy=(near, 2.1), xytext=(s, 2.9), arrowprops={"arrowstyle": "->", "color": "#15803d"})
    ax.axvspan(s, s + 120, ymin=0.86, ymax=0.9, color="#fca5a5")
    ax.text(s + 125, 3.38, "lateness bound: the\nframe waits at most this", fontsize=8, color="#b91c1c")
    ax.set_yticks([1, 2, 3], ["IMU", "camera", "lidar"])
    ax.set_ylim(0.4, 4.0)
    ax.set_xlabel("sensor time (ms): one frame per sweep, whatever its phase in its bucket")
    ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), fontsize=7, ncol=3, frameon=False)
    _save(fig, "timing.svg")


def deployment() -> None:
    fig, ax = _canvas(9, 3.4)
    ax.add_patch(FancyBboxPatch((0.0, 0.05), 0.45, 0.9, facecolor="#f8fafc", edgecolor="#334155", **BOX))
    ax.text(0.225, 0.9, "one robot: embedded Zenoh, no server", ha="center", fontsize=9, weight="bold")
    _box(ax, 0.03, 0.55, 0.18, 0.25, "ROS 2 nodes\n+ bridges", "ros")
    _box(ax, 0.24, 0.55, 0.18, 0.25, "Zenoh router\n(rmw_zenohd or\nembodied-bus router)", "bus")
    _box(ax, 0.03, 0.12, 0.18, 0.3, "fusion worker(s)\nring scale-out", "work")
    _box(ax, 0.24, 0.12, 0.18, 0.3, "queue service\n(SQLite)\n+ executors", "work")
    ax.add_patch(FancyBboxPatch((0.55, 0.05), 0.45, 0.9, facecolor="#f8fafc", edgecolor="#334155", **BOX))
    ax.text(0.775, 0.9, "a fleet: Apache Pulsar cluster", ha="center", fontsize=9, weight="bold")
    _box(ax, 0.58, 0.55, 0.18, 0.25, "robots\n(bridges, replay)", "ros")
    _box(ax, 0.79, 0.55, 0.18, 0.25, "brokers +\nbookies", "fleet")
    _box(ax, 0.58, 0.12, 0.18, 0.3, "fusion workers\nKey_Shared", "work")
    _box(ax, 0.79, 0.12, 0.18, 0.3, "executors\n(the cluster is\nthe queue)", "work")
    _arrow(ax, (0.21, 0.67), (0.24, 0.67))
    _arrow(ax, (0.76, 0.67), (0.79, 0.67))
    _arrow(ax, (0.45, 0.5), (0.55, 0.5), "same API")
    _save(fig, "deployment.svg")


def on_pre_build(config: Any) -> None:
    """Draw every diagram (a few hundred milliseconds)."""
    plt.rcParams["svg.hashsalt"] = "embodied_bus"
    for draw in (dataflow, timing, deployment):
        draw()
