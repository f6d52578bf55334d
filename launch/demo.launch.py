"""Launch the embodied_bus demo (the README's main job, over embedded Zenoh) from ROS 2.

ros2 launch embodied_bus demo.launch.py
"""

from launch.actions import DeclareLaunchArgument
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node

from launch import LaunchDescription


def generate_launch_description() -> LaunchDescription:
    return LaunchDescription(
        [
            DeclareLaunchArgument("out", default_value="out/demo", description="output directory"),
            Node(
                package="embodied_bus",
                executable="embodied-bus",
                arguments=["demo", "--out", LaunchConfiguration("out")],
                output="screen",
            ),
        ]
    )
