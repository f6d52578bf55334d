"""Synthetic lidar, camera, GPS and IMU publishers with realistic rates and payload sizes."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from embodied_bus.model.header import Modality
from embodied_bus.streams.publisher import Publisher

__all__ = ["DEFAULT_SENSORS", "SensorSpec", "make_payload", "run_sensor"]

POINT_DTYPE = np.dtype([("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("intensity", "<f4")])


@dataclass(frozen=True, slots=True)
class SensorSpec:
    """One synthetic sensor.

    Attributes:
        stream: Stream name.
        modality: Sensor kind.
        rate_hz: Samples per second.
        encoding: Payload encoding.
        frame_id: Coordinate frame.
        jitter_ns: Uniform stamp jitter, nanoseconds.
    """

    stream: str
    modality: Modality
    rate_hz: float
    encoding: str
    frame_id: str
    jitter_ns: int = 0


#: lidar 10 Hz, camera 30 Hz, GPS 5 Hz, IMU 200 Hz.
DEFAULT_SENSORS = (
    SensorSpec("lidar/top", Modality.LIDAR, 10.0, "npy", "lidar_top", 2_000_000),
    SensorSpec("camera/front", Modality.CAMERA, 30.0, "raw:rgb8:480x640", "camera_front", 1_000_000),
    SensorSpec("gps", Modality.GPS, 5.0, "npy", "gps", 0),
    SensorSpec("imu", Modality.IMU, 200.0, "npy", "imu_link", 200_000),
)


def make_payload(spec: SensorSpec, i: int, rng: np.random.Generator) -> Any:
    """A plausible payload for sample ``i`` of a sensor."""
    if spec.modality is Modality.LIDAR:
        pts = np.empty(30_000, dtype=POINT_DTYPE)
        angle = np.linspace(0, 2 * np.pi, len(pts), dtype=np.float32)
        r = 10 + rng.standard_normal(len(pts)).astype(np.float32)
        pts["x"], pts["y"] = r * np.cos(angle), r * np.sin(angle)
        pts["z"] = rng.standard_normal(len(pts)).astype(np.float32) * 0.2
        pts["intensity"] = rng.random(len(pts), dtype=np.float32)
        return pts
    if spec.modality is Modality.CAMERA:
        img = np.full((480, 640, 3), i % 255, dtype=np.uint8)
        return img.tobytes()
    if spec.modality is Modality.GPS:  # latitude_deg, longitude_deg, altitude_m, status (a fix)
        return np.array([47.3763 + i * 1e-6, 8.5503, 499.5, 0.0], dtype=np.float64)
    # the array form of sensor_msgs/Imu (rosmsg.imu_to_array): quaternion, rad/s, m/s^2
    return np.concatenate(
        [[0.0, 0.0, 0.0, 1.0], rng.standard_normal(3) * 0.01, rng.standard_normal(3) * 0.05 + [0, 0, 9.81]]
    )


async def run_sensor(
    pub: Publisher, spec: SensorSpec, stop: asyncio.Event, *, count: int | None = None, seed: int = 0
) -> int:
    """Publish ``spec`` at its rate on an absolute schedule until ``stop`` (or ``count``).

    Returns:
        Number of samples published.
    """
    rng = np.random.default_rng(seed)
    period_s = 1.0 / spec.rate_hz
    start = time.monotonic()
    n = 0
    while not stop.is_set() and (count is None or n < count):
        stamp_ns = time.time_ns()
        if spec.jitter_ns:
            stamp_ns -= int(rng.integers(0, spec.jitter_ns))
        await pub.publish(make_payload(spec, n, rng), stamp_ns=stamp_ns)
        n += 1
        delay = start + n * period_s - time.monotonic()
        if delay > 0:
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except TimeoutError:
                pass
    return n
