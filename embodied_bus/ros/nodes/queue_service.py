"""``ros2 run embodied_bus queue_service [--config robot.yaml] [--db FILE] [--bus URL] [--ns NS]``

The durable action queue service (``embodied-bus queue``, no rclpy needed) for launch files;
an empty ``--bus`` or ``--ns`` means the config's ``bus:`` / ``namespace:``. ROS arguments
appended by ``ros2 launch`` are ignored.
"""

from __future__ import annotations

import sys

from embodied_bus.cli.main import main as cli_main
from embodied_bus.errors import EmbodiedBusError
from embodied_bus.ros.nodes.fusion_worker import resolve_bus

__all__ = ["main"]


def main(args: list[str] | None = None) -> int:
    """Run ``embodied-bus queue``."""
    try:
        _, opts = resolve_bus("queue_service", sys.argv[1:] if args is None else args, config_required=False)
    except EmbodiedBusError as err:
        print(f"queue_service: error: {err}", file=sys.stderr)
        return 1
    return cli_main(["queue", *opts])


if __name__ == "__main__":
    raise SystemExit(main())
