"""Fusion workers for the config's fusion spec (plain processes, no rclpy).

ros2 launch embodied_bus fusion.launch.py config:=robot.yaml bus:=zenoh://localhost:7447 namespace:=robot1
"""

from embodied_bus.ros.launching import launch_description


def generate_launch_description():  # type: ignore[no-untyped-def]
    return launch_description("fusion")
