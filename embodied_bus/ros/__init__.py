"""ROS 2 on the robot: the rmw_zenoh bridge (no rclpy), the robot YAML and the rclpy nodes in
:mod:`embodied_bus.ros.nodes`. The message layer below them (CDR conversions, ROS 1 → ROS 2,
the rmw_zenoh wire format) is :mod:`embodied_bus.rosmsg`."""
