"""ament_python package that is also pip-installable (``pip install -e .``)."""

import re
from glob import glob
from pathlib import Path

from setuptools import find_packages, setup

package_name = "embodied_bus"
version = re.search(r'^__version__ = "([^"]+)"', Path("embodied_bus/__init__.py").read_text(), re.M).group(1)

setup(
    name=package_name,
    version=version,
    description="Robot middleware: ordered, time-bucketed sensor streams over Zenoh and Apache Pulsar",
    long_description=Path("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(exclude=["test", "test.*", "bench", "bench.*"]),
    package_data={package_name: ["py.typed", "rosmsg/definitions/*.md", "rosmsg/definitions/*/*/*"]},
    data_files=[
        ("share/ament_index/resource_index/packages", ["resource/" + package_name]),
        ("share/" + package_name, ["package.xml"]),
        ("share/" + package_name + "/launch", glob("launch/*.launch.py")),
        ("share/" + package_name + "/config", glob("config/*.yaml")),
        ("share/" + package_name + "/config/foxglove", glob("config/foxglove/*.json")),
        ("share/" + package_name + "/data/tilt_laser", glob("data/tilt_laser/*")),
    ],
    install_requires=[
        "eclipse-zenoh>=1.10,<2",
        "pillow>=10",
        "rosbags>=0.10",
        "numpy>=1.24",
        "pyyaml>=6",
        "rich>=13",
        "matplotlib>=3.7",
        "mcap>=1.1",
        "prometheus-client>=0.17",
        "xxhash>=3",
        "msgspec>=0.18",
        "cryptography>=41",
        # the command line's event loop (embodied_bus.loop); none for Windows
        'uvloop>=0.19; sys_platform != "win32"',
    ],
    extras_require={
        "pulsar": ["pulsar-client>=3.9,<4"],
        "pointcloud": ["open3d>=0.18"],
        # the live view for Foxglove (embodied-bus view, --view)
        "view": ["foxglove-sdk>=0.30,<1"],
        "test": [
            "foxglove-sdk>=0.30,<1",
            "websockets>=13",
            "pulsar-client>=3.9,<4",
            "open3d>=0.18",
            "pytest>=8",
            "pytest-asyncio>=0.23",
            "pytest-timeout>=2.3",
            "pytest-rerunfailures>=14",
            "pytest-xdist>=3.5",
            "hypothesis>=6.100",
            "catkin-pkg>=1.0",
            "wheel>=0.40",
            "ruff>=0.6",
            "mypy>=1.10",
            "import-linter>=2.1",
            "build>=1.2",
            "twine>=5",
            "mkdocs>=1.6",
            "mkdocstrings[python]>=0.26",
            "types-PyYAML",
        ],
    },
    zip_safe=True,
    maintainer="embodied_bus developers",
    maintainer_email="dev@embodied-bus.invalid",
    entry_points={
        "console_scripts": [
            "embodied-bus = embodied_bus.cli.main:main",
            "sensor_bridge = embodied_bus.ros.nodes.sensor_bridge:main",
            "frame_bridge = embodied_bus.ros.nodes.frame_bridge:main",
            "action_bridge = embodied_bus.ros.nodes.action_bridge:main",
            "fusion_worker = embodied_bus.cli.launch_nodes:fusion_worker",
            "queue_service = embodied_bus.cli.launch_nodes:queue_service",
        ],
    },
)
