"""The rclpy-free ROS 2 bridge: a ROS 2 node on rmw_zenoh publishes sensor_msgs/NavSatFix on
/gps/fix; the bridge (hosting the Zenoh router, as ``embodied-bus ros-bridge --host-router``)
turns it into the bus stream ``gps``. The "ROS node" here writes rmw_zenoh's wire format by hand;
a real one (rclpy or rclcpp with RMW_IMPLEMENTATION=rmw_zenoh_cpp) connects the same way."""

import asyncio
import json
import time

import numpy as np
import zenoh

from embodied_bus import open_bus
from embodied_bus.ros.config import robot_config_from_dict
from embodied_bus.ros.rmw_bridge import RmwZenohBridge
from embodied_bus.rosmsg import typestore
from embodied_bus.rosmsg.rmw_zenoh import gid_of, pack_attachment, topic_key, type_hash
from embodied_bus.testing.ports import free_port

NAVSATFIX = "sensor_msgs/msg/NavSatFix"


def ros_node(router: str) -> tuple[zenoh.Session, zenoh.Publisher]:
    """A stand-in ROS 2 node: a Zenoh peer of the robot's router with a NavSatFix publisher."""
    conf = zenoh.Config()
    conf.insert_json5("connect/endpoints", json.dumps([router]))
    conf.insert_json5("scouting/multicast/enabled", "false")
    session = zenoh.open(conf)
    return session, session.declare_publisher(topic_key(0, "/gps/fix", NAVSATFIX, type_hash(NAVSATFIX)))


def navsatfix_cdr(lat: float, lon: float) -> bytes:
    store = typestore()
    t = store.types
    now = time.time_ns()
    header = t["std_msgs/msg/Header"](t["builtin_interfaces/msg/Time"](now // 10**9, now % 10**9), "gps")
    status = t["sensor_msgs/msg/NavSatStatus"](0, 1)
    fix = t[NAVSATFIX](header, status, lat, lon, 500.0, np.zeros(9), 0)
    return bytes(store.serialize_cdr(fix, NAVSATFIX))


async def main() -> None:
    router = f"tcp/127.0.0.1:{free_port()}"
    config = robot_config_from_dict(
        {"ros": {"host_router": router}, "streams": {"gps": {"topic": "/gps/fix", "type": NAVSATFIX}}}
    )
    async with open_bus("zenoh:", namespace="robot1") as bus, RmwZenohBridge(bus, config):
        sub = await bus.subscribe("gps")
        session, pub = ros_node(router)
        await asyncio.sleep(1.0)  # the node finds the bridge's subscription through the router
        for seq in range(1, 4):
            cdr = navsatfix_cdr(47.3763 + seq * 1e-5, 8.5503)
            pub.put(cdr, attachment=pack_attachment(seq, time.time_ns(), gid_of("example-node")))
            s = await sub.recv(timeout_s=5)
            print(f"bus stream {s.stream}: seq {s.seq}, {s.header.encoding}, {len(s.payload)} bytes")
        session.close()


asyncio.run(main())
