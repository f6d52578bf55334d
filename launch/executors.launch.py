"""The action queue service and the action bridge (ROS planners in, ROS action servers out).

ros2 launch embodied_bus executors.launch.py config:=robot.yaml bus:=zenoh: namespace:=robot1
"""

from launch.actions import DeclareLaunchArgument
from launch.conditions import IfCondition
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
                description="robot YAML with an actions: section",
            ),
            DeclareLaunchArgument("bus", default_value="", description="bus URL (empty: the config's bus:)"),
            DeclareLaunchArgument(
                "namespace", default_value="", description="ROS and bus namespace (empty: the config's)"
            ),
            DeclareLaunchArgument(
                "queue",
                default_value="true",
                description="host the durable queue service here (false: use another)",
            ),
            DeclareLaunchArgument("queue_db", default_value="actions.db", description="queue SQLite file"),
            Node(
                package="embodied_bus",
                executable="queue_service",
                arguments=[
                    "--config",
                    config,
                    "--bus",
                    bus,
                    "--ns",
                    namespace,
                    "--db",
                    LaunchConfiguration("queue_db"),
                ],
                condition=IfCondition(LaunchConfiguration("queue")),
                output="screen",
            ),
            Node(
                package="embodied_bus",
                executable="action_bridge",
                namespace=namespace,
                parameters=[{"config": config, "bus": bus, "bus_namespace": namespace}],
                output="screen",
            ),
        ]
    )
