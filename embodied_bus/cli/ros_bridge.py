"""``embodied-bus ros-bridge``: bridge ROS 2 nodes on rmw_zenoh and the bus, without rclpy."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from typing import Any

from embodied_bus.bus import open_bus
from embodied_bus.cli.common import install_stop_signals, serve_until
from embodied_bus.engines.urls import parse_bus_url, with_connect
from embodied_bus.fusion.worker import FusionWorker
from embodied_bus.ros.config import RosLink, load_robot_config
from embodied_bus.ros.launching import router_connect_endpoint
from embodied_bus.ros.rmw_bridge import RmwZenohBridge, open_rmw_session
from embodied_bus.ros.sealing import bridge_credentials, bridge_planner

__all__ = ["add_parser", "bus_beside_ros"]


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "ros-bridge",
        help="bridge ROS 2 nodes that use rmw_zenoh (Jazzy or newer) and the bus, no rclpy needed",
        description="Subscribe to ROS 2 topics of rmw_zenoh nodes and publish them as bus streams; "
        "publish bus streams and fused frames back as ROS 2 topics (see config/robot.yaml).",
    )
    p.add_argument("--config", required=True, help="robot YAML (see config/robot.yaml)")
    p.add_argument("--bus", default=None, help="bus URL (default: the config's bus:, else $EMBODIED_BUS_URL)")
    p.add_argument("--ns", default=None, help="bus namespace (default: the config's namespace:)")
    p.add_argument(
        "--domain-id",
        type=int,
        default=None,
        help="ROS domain (default: the config's, else $ROS_DOMAIN_ID, else 0)",
    )
    p.add_argument(
        "--ros-namespace",
        metavar="NS",
        default=None,
        help="ROS namespace of the bridge node; relative topic names resolve under it (default: "
        "the config's ros.namespace)",
    )
    p.add_argument(
        "--host-router",
        metavar="ENDPOINT",
        default=None,
        help="host the Zenoh router on ENDPOINT (e.g. tcp/[::]:7447) so rmw_zenoh nodes need no rmw_zenohd",
    )
    p.add_argument(
        "--connect", metavar="ENDPOINT", action="append", default=None, help="the robot's Zenoh router(s)"
    )
    p.add_argument("--fuse", action="store_true", help="also run a fusion worker for the config's fusion:")
    p.add_argument(
        "--actions",
        action="store_true",
        help="run routed action kinds on ROS 2 action servers, offer kinds as ROS 2 action servers, "
        "accept JSON submissions (needs the action queue)",
    )
    p.add_argument("--duration", type=float, default=0.0, help="stop after S seconds (0 = Ctrl-C)")
    p.add_argument("--json", action="store_true", help="print the final counters as JSON only")
    p.set_defaults(func=run)


async def run(args: argparse.Namespace) -> int:
    cfg = load_robot_config(args.config)
    link = cfg.ros
    if args.domain_id is not None:
        link = dataclasses.replace(link, domain_id=args.domain_id)
    if args.ros_namespace is not None:
        link = dataclasses.replace(link, namespace=args.ros_namespace)
    if args.host_router:
        link = dataclasses.replace(link, host_router=args.host_router)
    if args.connect:
        link = dataclasses.replace(link, connect=tuple(args.connect), host_router=None)
    cfg = dataclasses.replace(cfg, ros=link).resolved()  # relative ROS names under the node's namespace
    url = bus_beside_ros(cfg.bus_url(args.bus), link)
    stop = asyncio.Event()
    install_stop_signals(stop)
    # the ROS side first: a hosted router must be up before a bus that connects to it
    session = await open_rmw_session(link)
    try:
        bus_cm = open_bus(url, namespace=args.ns or cfg.namespace)
        bus = await bus_cm.__aenter__()
    except BaseException:
        await asyncio.to_thread(session.close)
        raise
    try:
        planner = bridge_planner(bus, bridge_credentials(cfg.security)) if args.actions else None
        bridge = RmwZenohBridge(bus, cfg, planner=planner, session=session)
        summary = await _serve(args, bridge, url, stop)
    finally:
        await bus_cm.__aexit__(None, None, None)
    print(json.dumps(summary, indent=2 if args.json else None))
    return 0


def bus_beside_ros(url: str, link: RosLink) -> str:
    """The bus URL, joined to the robot's Zenoh router when it names an isolated peer: a bus
    nobody else can reach would bridge ROS into nowhere."""
    if parse_bus_url(url).reaches_other_processes:
        return url
    router = router_connect_endpoint(link.host_router) if link.host_router else None
    return with_connect(url, [router] if router else list(link.connect))


async def _serve(
    args: argparse.Namespace, bridge: RmwZenohBridge, url: str, stop: asyncio.Event
) -> dict[str, Any]:
    """Run the bridge (and a fusion worker with ``--fuse``) until stopped; the final counters."""
    cfg, link = bridge.config, bridge.config.ros
    tasks: list[asyncio.Task[None]] = []
    worker = None
    try:
        if args.fuse and cfg.fusion is not None:
            worker = FusionWorker(bridge.bus, cfg.fusion)
            tasks.append(asyncio.create_task(worker.run(stop)))
            await worker.ready.wait()
        await bridge.start()
        where = (
            f"hosting the router on {link.host_router}"
            if link.host_router
            else f"via {', '.join(link.connect)}"
        )
        if not args.json:
            print(
                f"ros-bridge: node /{link.node_name} on ROS domain {link.domain_id} ({link.distro}) "
                f"{where}; bus {url}",
                flush=True,
            )

        def status() -> None:
            if not args.json:
                c = bridge.counters
                print(
                    f"from ROS {sum(c.from_ros.values())}  to ROS {sum(c.to_ros.values())}  "
                    f"frames {c.frames}  rejected {dict(c.rejected)}",
                    flush=True,
                )

        await serve_until(stop, tasks, duration_s=args.duration, every_s=2.0, on_tick=status)
    finally:
        stop.set()
        await bridge.close()
        await asyncio.gather(*tasks, return_exceptions=True)
    summary = bridge.counters.as_dict()
    if worker is not None:
        summary["fusion"] = worker.summary()
    return summary
