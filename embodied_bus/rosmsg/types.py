"""ROS type names: ROS 1 → ROS 2 spelling, and the modality a sensor type maps to."""

from __future__ import annotations

__all__ = ["modality_of", "normalize_msgtype"]

_MODALITIES = {
    "sensor_msgs/msg/PointCloud2": "lidar",
    "sensor_msgs/msg/Image": "camera",
    "sensor_msgs/msg/CompressedImage": "camera",
    "sensor_msgs/msg/NavSatFix": "gps",
    "sensor_msgs/msg/Imu": "imu",
    "sensor_msgs/msg/LaserScan": "laser_scan",
    "nav_msgs/msg/Odometry": "odometry",
}


def normalize_msgtype(msgtype: str) -> str:
    """``pkg/Type`` → ``pkg/msg/Type``; other forms unchanged."""
    parts = msgtype.split("/")
    return f"{parts[0]}/msg/{parts[1]}" if len(parts) == 2 else msgtype


def modality_of(msgtype: str) -> str:
    """The modality name a ROS type maps to (``other`` if unknown)."""
    return _MODALITIES.get(msgtype, "other")
