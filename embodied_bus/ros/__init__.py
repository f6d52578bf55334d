"""ROS 2 integration: message conversions (ROS-free, via rosbags), the rmw_zenoh wire format and
bridge (no rclpy), the robot YAML, and the rclpy nodes in :mod:`embodied_bus.ros.nodes`."""

from embodied_bus.ros.conversions import (
    ConversionError,
    array_to_compressed_image_cdr,
    array_to_image_cdr,
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
    "array_to_compressed_image_cdr",
    "array_to_image_cdr",
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
