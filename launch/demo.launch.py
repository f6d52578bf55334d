"""Launch the embodied_bus demo (synthetic sensors over embedded Zenoh) from ROS 2.

    ros2 launch embodied_bus demo.launch.py duration:=20
"""

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, ExecuteProcess
from launch.substitutions import LaunchConfiguration


def generate_launch_description() -> LaunchDescription:
    duration = LaunchConfiguration("duration")
    return LaunchDescription([
        DeclareLaunchArgument("duration", default_value="10", description="seconds to run"),
        ExecuteProcess(cmd=["embodied-bus", "demo", "--duration", duration], output="screen"),
    ])
