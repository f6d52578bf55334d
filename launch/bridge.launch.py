"""Sensor topics into the bus, fused frames back to ROS 2, action submissions from ROS planners.

ros2 launch embodied_bus bridge.launch.py config:=robot.yaml bus:=zenoh://localhost:7447 namespace:=robot1
ros2 launch embodied_bus bridge.launch.py rclpy:=false router:=true   # rmw_zenoh, no rclpy, own router
"""

from embodied_bus.ros.launching import launch_description


def generate_launch_description():  # type: ignore[no-untyped-def]
    return launch_description("bridge")
