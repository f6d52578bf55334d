"""Generated samples (e.g. a :mod:`embodied_bus.sim.scenario`) as a ROS 2 MCAP recording: real
message types whose header stamps carry the scenario's drifting, jittering sensor clocks, logged
at their arrival times. Replay it like any recording (``embodied-bus replay``) to try a fusion
spec on sensor timing you choose."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from embodied_bus.model.header import Modality
from embodied_bus.model.sample import Sample
from embodied_bus.replay.recorder import McapRecorder
from embodied_bus.rosmsg.conversions import array_to_image_cdr, array_to_pointcloud2_cdr, typestore

__all__ = ["write_recording"]

_TYPES = {
    Modality.LIDAR: "sensor_msgs/msg/PointCloud2",
    Modality.CAMERA: "sensor_msgs/msg/Image",
    Modality.GPS: "sensor_msgs/msg/NavSatFix",
    Modality.IMU: "sensor_msgs/msg/Imu",
}
_POINTS = np.zeros((16, 3), dtype=np.float32)
_PIXELS = np.zeros((2, 2), dtype=np.uint8)


def _cdr(modality: Modality, frame_id: str, stamp_ns: int) -> bytes:
    """A small message of the modality's ROS 2 type with the given header."""
    if modality is Modality.LIDAR:
        return array_to_pointcloud2_cdr(_POINTS, frame_id=frame_id, stamp_ns=stamp_ns)
    if modality is Modality.CAMERA:
        return array_to_image_cdr(_PIXELS, frame_id=frame_id, stamp_ns=stamp_ns)
    ts = typestore()
    header = ts.types["std_msgs/msg/Header"](
        stamp=ts.types["builtin_interfaces/msg/Time"](sec=stamp_ns // 10**9, nanosec=stamp_ns % 10**9),
        frame_id=frame_id,
    )
    if modality is Modality.GPS:
        msg = ts.types["sensor_msgs/msg/NavSatFix"](
            header=header,
            status=ts.types["sensor_msgs/msg/NavSatStatus"](status=0, service=1),
            latitude=47.0,
            longitude=8.0,
            altitude=400.0,
            position_covariance=np.zeros(9),
            position_covariance_type=0,
        )
    else:
        vec = ts.types["geometry_msgs/msg/Vector3"]
        msg = ts.types["sensor_msgs/msg/Imu"](
            header=header,
            orientation=ts.types["geometry_msgs/msg/Quaternion"](x=0.0, y=0.0, z=0.0, w=1.0),
            orientation_covariance=np.zeros(9),
            angular_velocity=vec(x=0.0, y=0.0, z=0.0),
            angular_velocity_covariance=np.zeros(9),
            linear_acceleration=vec(x=0.0, y=0.0, z=9.81),
            linear_acceleration_covariance=np.zeros(9),
        )
    return bytes(ts.serialize_cdr(msg, _TYPES[modality]))


def write_recording(path: str | Path, samples: Iterable[Sample]) -> dict[str, int]:
    """Write samples (e.g. :func:`~embodied_bus.sim.scenario.generate`'s) as an MCAP recording:
    topic ``/<stream>``, a message of the modality's ROS 2 type stamped with the sample's stamp
    and frame, logged at its receive time. Returns the messages written per topic.

    Raises:
        RecorderError: The file cannot be written.
        KeyError: A sample of a modality without a ROS 2 type here (lidar, camera, GPS, IMU).
    """
    with McapRecorder(path) as rec:
        for s in samples:
            h = s.header
            payload = _cdr(h.modality, h.frame_id, h.stamp_ns)
            header = h._replace(encoding="cdr:" + _TYPES[h.modality])
            rec.write(Sample(header, payload, s.receive_ns))
        return dict(rec.counts)
