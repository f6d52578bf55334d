"""The Foxglove layout of the live view (the classic layout file Foxglove and Lichtblick import).

``config/foxglove/embodied_bus.json`` is :func:`demo_layout` written by
``embodied-bus view --write-layout``: the 3D view with the lidar and the fused members, the
camera, a map with the GPS track, IMU plots, the frame status table and the action queue.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["demo_layout", "layout", "write_layout"]


def _split(direction: str, first: Any, second: Any, percent: float) -> dict[str, Any]:
    return {"direction": direction, "first": first, "second": second, "splitPercentage": percent}


def layout(
    *,
    points: Sequence[str],
    image: str,
    gps: Sequence[str],
    imu: str,
) -> dict[str, Any]:
    """A layout for these topics (``/<stream>`` and ``/fused/<stream>``).

    Args:
        points: PointCloud2 / LaserScan topics drawn in the 3D view.
        image: The camera topic.
        gps: NavSatFix topics drawn on the map.
        imu: The Imu topic whose accelerations and rates are plotted.
    """
    palette = ["#4e98e2", "#f5774d", "#8ad174", "#d67ad1"]
    config: dict[str, Any] = {
        "3D!points": {
            "topics": {
                t: {
                    "visible": True,
                    "pointSize": 2,
                    "colorMode": "flat",
                    "flatColor": palette[i % len(palette)],
                }
                for i, t in enumerate(points)
            },
        },
        "Image!camera": {"imageMode": {"imageTopic": image}},
        "map!gps": {
            "layer": "map",
            "topicColors": {t: palette[i % len(palette)] for i, t in enumerate(gps)},
            "followTopic": gps[0] if gps else "",
        },
        "Plot!imu": {
            "paths": [
                {"value": f"{imu}.{field}.{axis}", "enabled": True, "timestampMethod": "receiveTime"}
                for field in ("linear_acceleration", "angular_velocity")
                for axis in "xyz"
            ],
            "showLegend": True,
        },
        "Table!frames": {"topicPath": "/fused/status"},
        "RawMessages!actions": {"topicPath": "/actions/queue", "expansion": "all"},
        "Table!streams": {"topicPath": "/bus/streams.streams"},
    }
    left = _split("column", "3D!points", _split("row", "Image!camera", "map!gps", 50), 60)
    right = _split(
        "column",
        _split("column", "Plot!imu", "Table!frames", 45),
        _split("row", "RawMessages!actions", "Table!streams", 50),
        65,
    )
    return {
        "configById": config,
        "globalVariables": {},
        "userNodes": {},
        "playbackConfig": {"speed": 1},
        "layout": _split("row", left, right, 55),
    }


def demo_layout() -> dict[str, Any]:
    """The layout for ``embodied-bus demo`` (the recording's ``scan``, ``gps``, ``imu``) and
    ``demo --synthetic`` (``lidar/top``, ``camera/front``, ``gps``, ``imu``)."""
    return layout(
        points=["/lidar/top", "/fused/lidar/top", "/scan", "/fused/scan"],
        image="/camera/front",
        gps=["/gps", "/fused/gps"],
        imu="/imu",
    )


def write_layout(path: str | Path, doc: dict[str, Any] | None = None) -> Path:
    """Write a layout (default: :func:`demo_layout`) as JSON; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc or demo_layout(), indent=2) + "\n", encoding="utf-8")
    return out
