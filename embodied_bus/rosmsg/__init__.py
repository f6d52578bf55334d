"""ROS messages without ROS: CDR ↔ NumPy conversions (via rosbags), ROS 1 → ROS 2 CDR, type
names and their modalities, and the rmw_zenoh wire format (key expressions, attachments, type
hashes). Used by fusion, replay and the bridges in :mod:`embodied_bus.ros`."""

from embodied_bus.rosmsg.conversions import (
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
