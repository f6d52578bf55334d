"""Everything on a robot: sensor and frame bridges, fusion, the action queue and action bridge.

ros2 launch embodied_bus robot.launch.py config:=robot.yaml namespace:=robot1   # via rmw_zenohd
ros2 launch embodied_bus robot.launch.py router:=true rclpy:=false             # own router, no rclpy
ros2 launch embodied_bus robot.launch.py bus:=pulsar://broker:6650             # fleet bus, no queue service

Every process meets the others through the robot's Zenoh router (bus:=zenoh://localhost:7447 by
default, rmw_zenohd's endpoint); an isolated bus (zenoh:) is refused with the fix in the message.
The processes are listed by embodied_bus.ros.launching, which the tests start as they are.
"""

from embodied_bus.ros.launching import launch_description


def generate_launch_description():  # type: ignore[no-untyped-def]
    return launch_description("robot")
