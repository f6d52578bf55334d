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
    "RELAY_DEPTH",
    "NodeParams",
    "declare_params",
    "rclpy_qos",
    "require_rclpy",
    "run_node",
    "to_asyncio",
]

#: Threads of the rclpy executor of a node whose callbacks block.
EXECUTOR_THREADS = 8
#: Longest wait for the executor's thread to stop spinning at shutdown, seconds.
SHUTDOWN_JOIN_S = 5.0


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


#: Least history depth of the bridge's own best-effort subscriptions: a relay must not drop a
#: burst while it is busy with a large message (depth is local buffering; it changes no QoS
#: compatibility).
RELAY_DEPTH = 64


def rclpy_qos(q: QosProfile, *, relay: bool = False) -> Any:
    """The rclpy QoSProfile for a config profile. ``relay``: for a subscription the node
    forwards: a reliable one keeps all history (the publisher waits rather than the relay
    dropping what it has not yet taken), a best-effort one at least :data:`RELAY_DEPTH`."""
    from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy

    depth = q.depth or 10
    if relay and q.durability is not Durability.TRANSIENT_LOCAL:
        if q.reliability is not Reliability.BEST_EFFORT:
            return QoSProfile(
                depth=max(depth, RELAY_DEPTH),
                reliability=ReliabilityPolicy.RELIABLE,
                durability=DurabilityPolicy.VOLATILE,
                history=HistoryPolicy.KEEP_ALL,
            )
        depth = max(depth, RELAY_DEPTH)
    return QoSProfile(
        depth=depth,
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


def _executor(blocking_callbacks: bool) -> Any:
    """The rclpy executor of a node: several threads where callbacks block (an offered action
    goal waits for its queue action), else one (each extra thread of rclpy's Python executors
    costs more per message than it brings). rclpy's events executor is not used: it holds the
    GIL while it waits, so the node's asyncio side would never run beside it."""
    from rclpy.executors import MultiThreadedExecutor, SingleThreadedExecutor

    if blocking_callbacks:
        return MultiThreadedExecutor(num_threads=EXECUTOR_THREADS)
    return SingleThreadedExecutor()


def run_node(
    node_name: str,
    args: list[str] | None,
    serve: Callable[[Any, NodeParams, asyncio.Event], Awaitable[None]],
    *,
    blocking_callbacks: bool = False,
) -> int:
    """Init rclpy, create the node, spin it on a thread, run ``serve`` on asyncio until SIGINT
    or SIGTERM, then shut everything down cleanly.

    Args:
        blocking_callbacks: Some callbacks of the node block (spin several threads).
    """
    rclpy = require_rclpy(node_name)

    try:
        from rclpy.signals import SignalHandlerOptions

        rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)
    except ImportError:  # older rclpy: its own handler shuts the context down on SIGINT
        rclpy.init(args=args)
    node = rclpy.create_node(node_name)
    executor = _executor(blocking_callbacks)
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
        spinner.join(SHUTDOWN_JOIN_S)  # spinning ended before the node and context go
        node.destroy_node()
        rclpy.try_shutdown()
