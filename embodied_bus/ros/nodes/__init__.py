"""ROS 2 nodes, one module each with ``main(args=None)`` (registered as console scripts so
``ros2 run embodied_bus <node>`` finds them).

* ``sensor_bridge``, ``frame_bridge``, ``action_bridge``: rclpy nodes, thin over
  :mod:`embodied_bus.ros.bridge_core`; importing them never needs rclpy, running them does.
* ``fusion_worker``, ``queue_service``: plain processes (no rclpy) started by the launch files.
"""

__all__: list[str] = []
