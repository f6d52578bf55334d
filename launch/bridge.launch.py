"""Sensor topics into the bus and fused frames back into ROS (rclpy nodes).

ros2 launch embodied_bus bridge.launch.py config:=robot.yaml bus:=zenoh: namespace:=robot1
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
    params = [{"config": config, "bus": bus, "bus_namespace": namespace}]
    return LaunchDescription(
        [
            DeclareLaunchArgument(
                "config",
                default_value=PathJoinSubstitution(
                    [FindPackageShare("embodied_bus"), "config", "robot.yaml"]
                ),
                description="robot YAML: topics -> streams, fusion spec, frame and action routes",
            ),
            DeclareLaunchArgument("bus", default_value="", description="bus URL (empty: the config's bus:)"),
            DeclareLaunchArgument(
                "namespace", default_value="", description="ROS and bus namespace (empty: the config's)"
            ),
            Node(
                package="embodied_bus",
                executable="sensor_bridge",
                namespace=namespace,
                parameters=params,
                output="screen",
            ),
            Node(
                package="embodied_bus",
                executable="frame_bridge",
                namespace=namespace,
                parameters=params,
                output="screen",
            ),
        ]
    )
