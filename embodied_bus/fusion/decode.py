"""Turn a frame's members into NumPy arrays (views of the payloads where layouts allow)."""

from __future__ import annotations

from typing import Any

import numpy as np

from embodied_bus.fusion.frame import MultiModalFrame
from embodied_bus.rosmsg.conversions import ConversionError, sample_to_numpy

__all__ = ["frame_arrays"]


def frame_arrays(frame: MultiModalFrame, *, strict: bool = False) -> dict[str, list[np.ndarray[Any, Any]]]:
    """Arrays per stream: PointCloud2 → structured points (any field layout), Image and
    CompressedImage → HxWxC, NavSatFix / Imu → vectors, LaserScan → Nx2 points, ``npy`` → the
    array itself.

    Args:
        frame: A frame (from the assembler or :func:`decode_frame`).
        strict: Raise on a member that cannot be converted instead of leaving it out.

    Raises:
        ConversionError: With ``strict``, a member has no conversion or is malformed.
    """
    out: dict[str, list[np.ndarray[Any, Any]]] = {}
    for name, members in frame.members.items():
        arrays = []
        for m in members:
            try:
                arrays.append(sample_to_numpy(m.sample))
            except ConversionError:
                if strict:
                    raise
        if arrays:
            out[name] = arrays
    return out
