"""The embodied_bus demo (the README's main job, over embedded Zenoh), with its recording and
config found through the ament index.

ros2 launch embodied_bus demo.launch.py out:=out/demo
"""

from embodied_bus.ros.launching import launch_description


def generate_launch_description():  # type: ignore[no-untyped-def]
    return launch_description("demo")
