"""ROS message conversions (ROS-free, via rosbags) and, later, the rclpy nodes."""

from embodied_bus.ros.conversions import (
    ConversionError,
    array_to_pointcloud2_cdr,
    compressed_image_to_array,
    decode_cdr,
    image_to_array,
    imu_to_array,
    laserscan_to_points,
    navsatfix_to_array,
    pointcloud2_dtype,
    pointcloud2_to_array,
    sample_to_numpy,
    typestore,
)

__all__ = [
    "ConversionError",
    "array_to_pointcloud2_cdr",
    "compressed_image_to_array",
    "decode_cdr",
    "image_to_array",
    "imu_to_array",
    "laserscan_to_points",
    "navsatfix_to_array",
    "pointcloud2_dtype",
    "pointcloud2_to_array",
    "sample_to_numpy",
    "typestore",
]
