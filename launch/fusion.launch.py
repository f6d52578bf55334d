"""Fusion workers for the config's fusion spec (plain processes, no rclpy).

ros2 launch embodied_bus fusion.launch.py config:=robot.yaml bus:=zenoh: namespace:=robot1
"""

from launch.actions import DeclareLaunchArgument
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.actions import Node
from launch_ros.substitutions import FindPackageShare

from launch import LaunchDescription


def generate_launch_description() -> LaunchDescription:
    config = LaunchConfiguration("config")
    bus = LaunchConfiguration("bus")
    namespace = LaunchConfiguration("namespace")
    return LaunchDescription(
        [
            DeclareLaunchArgument(
                "config",
                default_value=PathJoinSubstitution(
                    [FindPackageShare("embodied_bus"), "config", "robot.yaml"]
                ),
                description="robot YAML with a fusion: section",
            ),
            DeclareLaunchArgument("bus", default_value="", description="bus URL (empty: the config's bus:)"),
            DeclareLaunchArgument(
                "namespace", default_value="", description="bus namespace (empty: the config's)"
            ),
            Node(
                package="embodied_bus",
                executable="fusion_worker",
                arguments=["--config", config, "--bus", bus, "--ns", namespace],
                output="screen",
            ),
        ]
    )
