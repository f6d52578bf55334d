"""The action queue service (not on Pulsar) and the action bridge (ROS planners in, ROS action
servers out).

ros2 launch embodied_bus executors.launch.py config:=robot.yaml bus:=zenoh://localhost:7447 queue:=false
"""

from embodied_bus.ros.launching import launch_description


def generate_launch_description():  # type: ignore[no-untyped-def]
    return launch_description("executors")
