"""rclpy plumbing shared by the nodes: parameters, QoS, and an asyncio loop next to the rclpy
executor. Imported only from the nodes' ``main``, after rclpy was found."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from embodied_bus.errors import EmbodiedBusError
from embodied_bus.loop import install_stop_signals
from embodied_bus.ros.config import RobotConfig, load_robot_config
from embodied_bus.ros.launching import require_shared_bus
from embodied_bus.rosmsg.rmw_zenoh import Durability, History, QosProfile, Reliability

__all__ = [
    "EXECUTOR_THREADS",
    "NodeParams",
    "declare_params",
    "rclpy_qos",
    "require_rclpy",
    "run_node",
    "to_asyncio",
]

#: Threads of the rclpy executor each node spins.
EXECUTOR_THREADS = 8


def require_rclpy(node_name: str) -> Any:
    """Import rclpy or exit with a clear message (the rmw_zenoh bridge needs no rclpy)."""
    try:
        import rclpy
    except ImportError:
        print(
            f"{node_name}: rclpy is not available; source a ROS 2 setup (Jazzy or newer), or use "
            "`embodied-bus ros-bridge`, which talks to rmw_zenoh nodes without rclpy",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    return rclpy


class NodeParams:
    """The parameters every embodied_bus node declares."""

    def __init__(self, config: RobotConfig, config_path: str, bus: str, bus_namespace: str | None) -> None:
        self.config, self.config_path, self.bus, self.bus_namespace = config, config_path, bus, bus_namespace


def declare_params(node: Any) -> NodeParams:
    """Declare ``config``, ``bus`` and ``bus_namespace`` with descriptors and load the config."""
    from rcl_interfaces.msg import ParameterDescriptor

    def declare(name: str, default: str, description: str) -> str:
        desc = ParameterDescriptor(description=description, read_only=True)
        return str(node.declare_parameter(name, default, desc).value)

    path = declare("config", "", "robot YAML (topics, fusion spec, frame and action routes)")
    bus = declare(
        "bus",
        "",
        "bus URL (zenoh: embedded peer, zenoh://HOST:PORT, pulsar://HOST:PORT); default from config",
    )
    ns = declare("bus_namespace", "", "bus namespace of this robot; default from config")
    if not path:
        raise EmbodiedBusError("parameter 'config' is required (path to a robot YAML)")
    cfg = load_robot_config(path)
    url = cfg.bus_url(bus)
    require_shared_bus(url, who=node.get_name())
    return NodeParams(cfg, path, url, ns or cfg.namespace)


def rclpy_qos(q: QosProfile) -> Any:
    """The rclpy QoSProfile for a config profile."""
    from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy

    return QoSProfile(
        depth=q.depth or 10,
        reliability=ReliabilityPolicy.BEST_EFFORT
        if q.reliability is Reliability.BEST_EFFORT
        else ReliabilityPolicy.RELIABLE,
        durability=DurabilityPolicy.TRANSIENT_LOCAL
        if q.durability is Durability.TRANSIENT_LOCAL
        else DurabilityPolicy.VOLATILE,
        history=HistoryPolicy.KEEP_ALL if q.history is History.KEEP_ALL else HistoryPolicy.KEEP_LAST,
    )


def to_asyncio(loop: asyncio.AbstractEventLoop, future: Any) -> asyncio.Future[Any]:
    """Wrap an rclpy future (completed on the executor thread) as an asyncio future."""
    out: asyncio.Future[Any] = loop.create_future()

    def done(f: Any) -> None:
        def settle() -> None:
            if out.done():
                return
            exc = f.exception()
            if exc is not None:
                out.set_exception(exc)
            else:
                out.set_result(f.result())

        loop.call_soon_threadsafe(settle)

    future.add_done_callback(done)
    return out


def run_node(
    node_name: str,
    args: list[str] | None,
    serve: Callable[[Any, NodeParams, asyncio.Event], Awaitable[None]],
) -> int:
    """Init rclpy, create the node, spin it on a thread, run ``serve`` on asyncio until SIGINT
    or SIGTERM, then shut everything down cleanly."""
    rclpy = require_rclpy(node_name)
    from rclpy.executors import MultiThreadedExecutor

    try:
        from rclpy.signals import SignalHandlerOptions

        rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)
    except ImportError:  # older rclpy: its own handler shuts the context down on SIGINT
        rclpy.init(args=args)
    node = rclpy.create_node(node_name)
    # threads for blocking callbacks (an offered goal waits for its queue action) beside the
    # subscriptions and services
    executor = MultiThreadedExecutor(num_threads=EXECUTOR_THREADS)
    executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, name=f"{node_name}-spin", daemon=True)
    spinner.start()

    async def main() -> None:
        stop = asyncio.Event()
        install_stop_signals(stop)
        params = declare_params(node)
        await serve(node, params, stop)

    try:
        asyncio.run(main())
        return 0
    except EmbodiedBusError as err:
        node.get_logger().error(str(err))
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()
