"""Everything on a robot: sensor and frame bridges, fusion, the action queue and action bridge.

ros2 launch embodied_bus robot.launch.py config:=robot.yaml bus:=zenoh: namespace:=robot1
"""

from launch.actions import DeclareLaunchArgument, IncludeLaunchDescription
from launch.launch_description_sources import PythonLaunchDescriptionSource
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.substitutions import FindPackageShare

from launch import LaunchDescription


def generate_launch_description() -> LaunchDescription:
    share = FindPackageShare("embodied_bus")
    forwarded = {
        "config": LaunchConfiguration("config"),
        "bus": LaunchConfiguration("bus"),
        "namespace": LaunchConfiguration("namespace"),
    }

    def include(name: str) -> IncludeLaunchDescription:
        return IncludeLaunchDescription(
            PythonLaunchDescriptionSource(PathJoinSubstitution([share, "launch", name])),
            launch_arguments=forwarded.items(),
        )

    return LaunchDescription(
        [
            DeclareLaunchArgument(
                "config",
                default_value=PathJoinSubstitution([share, "config", "robot.yaml"]),
                description="robot YAML: topics -> streams, fusion spec, frame and action routes",
            ),
            DeclareLaunchArgument("bus", default_value="", description="bus URL (empty: the config's bus:)"),
            DeclareLaunchArgument(
                "namespace", default_value="", description="ROS and bus namespace (empty: the config's)"
            ),
            include("bridge.launch.py"),
            include("fusion.launch.py"),
            include("executors.launch.py"),
        ]
    )
