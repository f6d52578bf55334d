"""The rclpy-free bridge as a ROS 2 citizen, against ros-z (an independent ROS 2 implementation
over Zenoh, run as its own processes): every sensor type both ways with its QoS, 8 MiB clouds,
latched topics both ways (ROS → bus from a publisher made as rmw_zenoh makes one: ros-z's
publishers keep no cache), a 1 kHz reliable Imu stream with no loss, restarts of either side,
and domain ids. The tests skip with the reason where ros-z is not beside the repository."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import zenoh
import zenoh.ext

from embodied_bus import open_bus
from embodied_bus.bus import Bus
from embodied_bus.ros.bridge_core import string_from_cdr
from embodied_bus.ros.config import RobotConfig, RosLink, robot_config_from_dict
from embodied_bus.ros.rmw_bridge import RmwZenohBridge, open_rmw_session
from embodied_bus.rosmsg.rmw_zenoh import pack_attachment, topic_key, type_hash, typestore_for
from embodied_bus.testing.ports import free_ports

from ros_z import peer_command, peer_env

#: Type, its QoS, how many and how fast (8 MiB clouds: a few, slowly).
SENSORS = {
    "cloud": ("sensor_msgs/msg/PointCloud2", "default", 4, 2.0),
    "image": ("sensor_msgs/msg/Image", "default", 20, 20.0),
    "compressed": ("sensor_msgs/msg/CompressedImage", "sensor_data", 20, 20.0),
    "fix": ("sensor_msgs/msg/NavSatFix", "default", 20, 20.0),
    "imu": ("sensor_msgs/msg/Imu", "sensor_data", 20, 20.0),
    "scan": ("sensor_msgs/msg/LaserScan", "sensor_data", 20, 20.0),
}
CLOUD_BYTES = 8 << 20


@contextlib.asynccontextmanager
async def router_and_bus(namespace: str) -> AsyncIterator[tuple[str, Bus]]:
    router_port, bus_port = free_ports(2)
    endpoint = f"tcp/127.0.0.1:{router_port}"
    router = await open_rmw_session(RosLink(host_router=endpoint))
    try:
        async with open_bus(f"zenoh:?listen=tcp/127.0.0.1:{bus_port}", namespace=namespace) as bus:
            yield endpoint, bus
    finally:
        await asyncio.to_thread(router.close)


def config(endpoint: str, streams: dict[str, Any], publish: list[dict[str, Any]], **ros: Any) -> RobotConfig:
    return robot_config_from_dict(
        {"ros": {"connect": [endpoint], **ros}, "streams": streams, "publish": {"streams": publish}}
    )


async def start_peer(*argv: str, env: dict[str, str]) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        *peer_command(*argv), env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    if argv[0] == "listen":
        assert proc.stdout is not None
        assert json.loads(await asyncio.wait_for(proc.stdout.readline(), 30)) == {"ready": True}
    return proc


async def answer(proc: asyncio.subprocess.Process, timeout_s: float = 90.0) -> dict[str, Any]:
    out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    assert proc.returncode == 0, err.decode()[-2000:]
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


async def test_every_sensor_type_crosses_both_ways_with_its_qos_and_8_mib_clouds() -> None:
    env = peer_env()  # skips where ros-z is absent
    async with router_and_bus("interop1") as (endpoint, bus):
        streams = {
            name: {"topic": f"/in/{name}", "type": t, "qos": q} for name, (t, q, _, _) in SENSORS.items()
        }
        # reliable topics out as keep-all: rmw_zenoh's publishers then wait under congestion
        # (8 MiB clouds on two busy cores) where keep-last ones drop
        keep_all = {"reliability": "reliable", "history": "keep_all"}
        publish = [
            {
                "stream": name,
                "topic": f"/out/{name}",
                "type": t,
                **({"qos": keep_all} if q == "default" else {}),
            }
            for name, (t, q, _, _) in SENSORS.items()
        ]
        async with RmwZenohBridge(bus, config(endpoint, streams, publish)) as bridge:
            listeners, publishers = {}, {}
            for name, (t, _, n, _) in SENSORS.items():
                argv = ["--topic", f"/out/{name}", "--type", t, "--count", str(n), "--timeout-s", "40"]
                listeners[name] = await start_peer("listen", "--connect", endpoint, *argv, env=env)
            for name, (t, q, n, hz) in SENSORS.items():
                argv = [
                    "--topic",
                    f"/in/{name}",
                    "--type",
                    t,
                    "--qos",
                    q,
                    "--count",
                    str(n),
                    "--rate",
                    str(hz),
                ]
                argv += ["--size", str(CLOUD_BYTES), "--node", f"drv_{name}"]
                publishers[name] = await start_peer("pub", "--connect", endpoint, *argv, env=env)
            sent = {name: await answer(p) for name, p in publishers.items()}
            heard = {name: await answer(p) for name, p in listeners.items()}
            counts = dict(bridge.counters.from_ros)
    for name, (_, qos, n, _) in SENSORS.items():
        got, stamps = heard[name]["received"], heard[name]["stamps_ns"]
        if qos == "default":  # reliable: every message, in order, with its header stamp
            assert got == n and stamps == sent[name]["stamps_ns"], (name, got, counts)
        else:  # best effort on loopback: nearly all, and only ones that were sent
            assert got >= n * 0.9 and set(stamps) <= set(sent[name]["stamps_ns"]), (name, got, counts)
    assert heard["cloud"]["sizes"] == [CLOUD_BYTES // 12 * 12] * 4  # 8 MiB of points each, whole


def _fix_cdr(stamp_ns: int) -> bytes:
    store = typestore_for("jazzy")
    t = store.types
    sec, nsec = divmod(stamp_ns, 1_000_000_000)
    fix = t["sensor_msgs/msg/NavSatFix"](
        header=t["std_msgs/msg/Header"](
            stamp=t["builtin_interfaces/msg/Time"](sec=sec, nanosec=nsec), frame_id="gps"
        ),
        status=t["sensor_msgs/msg/NavSatStatus"](status=0, service=1),
        latitude=48.1,
        longitude=11.5,
        altitude=520.0,
        position_covariance=np.zeros(9),
        position_covariance_type=0,
    )
    return bytes(store.serialize_cdr(fix, "sensor_msgs/msg/NavSatFix"))


async def test_latched_topics_reach_late_joiners_both_ways() -> None:
    env = peer_env()
    latched = {"reliability": "reliable", "durability": "transient_local", "depth": 1}
    async with router_and_bus("interop2") as (endpoint, bus):
        # ROS → bus: a latched publisher sent its one fix before the bridge existed. ros-z's
        # publishers keep no cache, so this one is made as rmw_zenoh makes a transient-local
        # publisher (an AdvancedPublisher with a cache and publisher detection, the attachment)
        session = await open_rmw_session(RosLink(connect=(endpoint,)))
        fix_type = "sensor_msgs/msg/NavSatFix"
        key = topic_key(0, "/in/origin", fix_type, type_hash(fix_type))
        early = zenoh.ext.declare_advanced_publisher(
            session,
            key,
            cache=zenoh.ext.CacheConfig(1),
            publisher_detection=True,
            sample_miss_detection=zenoh.ext.MissDetectionConfig(heartbeat=None, sporadic_heartbeat=0.5),
        )
        early.put(_fix_cdr(42_000_000_001), attachment=pack_attachment(1, time.time_ns(), bytes(16)))
        streams = {"origin": {"topic": "/in/origin", "type": fix_type, "qos": latched}}
        publish = [{"stream": "map", "topic": "/out/map", "type": fix_type, "qos": latched}]
        sub = await bus.subscribe("origin")
        try:
            async with RmwZenohBridge(bus, config(endpoint, streams, publish)) as bridge:
                got = await asyncio.wait_for(sub.__anext__(), 10)
                # bus → ROS: a fix published on the bus before any ROS subscriber exists
                pub = await bus.publisher("map", encoding=f"cdr:{fix_type}")
                async with asyncio.timeout(10):
                    while bridge.counters.to_ros["/out/map"] < 1:  # the bridge's subscription is up
                        await pub.publish(_fix_cdr(7_000_000_005), stamp_ns=7_000_000_005)
                        await asyncio.sleep(0.2)
                late = await start_peer(
                    "listen", "--connect", endpoint, "--topic", "/out/map", "--type", fix_type,
                    "--qos", "latched", "--count", "1", "--timeout-s", "10", env=env,
                )  # fmt: skip
                heard = await answer(late)
        finally:
            await sub.close()
            early.undeclare()
            await asyncio.to_thread(session.close)
    assert got.header.stamp_ns == 42_000_000_001
    assert heard["received"] == 1 and heard["stamps_ns"] == [7_000_000_005]  # ros-z, joining late


async def test_a_1_khz_reliable_imu_stream_crosses_without_loss_both_ways() -> None:
    env = peer_env()
    n = 2000
    reliable = {"reliability": "reliable", "depth": 1000}
    async with router_and_bus("interop3") as (endpoint, bus):
        streams = {"imu": {"topic": "/imu/data", "type": "sensor_msgs/msg/Imu", "qos": reliable}}
        publish = [{"stream": "imu", "topic": "/out/imu", "type": "sensor_msgs/msg/Imu", "qos": reliable}]
        sub = await bus.subscribe("imu")
        async with RmwZenohBridge(bus, config(endpoint, streams, publish)):
            listener = await start_peer(
                "listen", "--connect", endpoint, "--topic", "/out/imu", "--type", "sensor_msgs/msg/Imu",
                "--qos", "reliable_1000", "--count", str(n), "--timeout-s", "40", env=env,
            )  # fmt: skip
            driver = await start_peer(
                "pub", "--connect", endpoint, "--topic", "/imu/data", "--type", "sensor_msgs/msg/Imu",
                "--qos", "reliable_1000", "--count", str(n), "--rate", "1000", env=env,
            )  # fmt: skip
            stamps: list[int] = []
            async with asyncio.timeout(40):
                async for sample in sub:
                    stamps.append(sample.header.stamp_ns)
                    if len(stamps) == n:
                        break
            sent = await answer(driver)
            heard = await answer(listener)
        await sub.close()
    assert stamps == sent["stamps_ns"]  # every one, in order, into the bus
    assert heard["received"] == n and heard["stamps_ns"] == sent["stamps_ns"]  # and back out


async def test_a_restarted_ros_node_and_a_restarted_bridge_carry_on() -> None:
    env = peer_env()
    async with router_and_bus("interop4") as (endpoint, bus):
        cfg = config(
            endpoint,
            {"gps": {"topic": "/gps/fix", "type": "sensor_msgs/msg/NavSatFix", "qos": "default"}},
            [{"stream": "gps", "topic": "/out/gps", "type": "sensor_msgs/msg/NavSatFix"}],
        )
        listener = await start_peer(
            "listen", "--connect", endpoint, "--topic", "/out/gps", "--type", "sensor_msgs/msg/NavSatFix",
            "--count", "40", "--timeout-s", "60", env=env,
        )  # fmt: skip
        sent: list[int] = []
        for _run in range(2):  # the bridge restarts, the ROS driver (same node name) too
            async with RmwZenohBridge(bus, cfg) as bridge:
                argv = ["--topic", "/gps/fix", "--type", "sensor_msgs/msg/NavSatFix", "--count", "20"]
                driver = await start_peer(
                    "pub", "--connect", endpoint, *argv, "--node", "gps_driver", env=env
                )
                sent += (await answer(driver))["stamps_ns"]
                async with asyncio.timeout(10):  # every fix went back out before the bridge closes
                    while bridge.counters.to_ros["/out/gps"] < 20:
                        await asyncio.sleep(0.02)
        heard = await answer(listener)
    assert heard["received"] == 40 and heard["stamps_ns"] == sent


async def test_domain_ids_and_namespaces_keep_robots_apart() -> None:
    env = peer_env()
    async with router_and_bus("interop5") as (endpoint, bus):
        cfg = config(
            endpoint,
            {"gps": {"topic": "/gps/fix", "type": "sensor_msgs/msg/NavSatFix", "qos": "default"}},
            [],
            domain_id=7,
            namespace="/robot7",
        )
        sub = await bus.subscribe("gps")
        async with RmwZenohBridge(bus, cfg):
            graph = await start_peer(
                "graph", "--connect", endpoint, "--domain-id", "7", "--topic", "/gps/fix", "--timeout-s", "2",
                env=env,
            )  # fmt: skip
            seen = await answer(graph)
            other = await start_peer(
                "pub", "--connect", endpoint, "--topic", "/gps/fix", "--type", "sensor_msgs/msg/NavSatFix",
                "--count", "10", "--rate", "50", "--domain-id", "0", "--node", "other_robot", env=env,
            )  # fmt: skip
            ours = await start_peer(
                "pub", "--connect", endpoint, "--topic", "/gps/fix", "--type", "sensor_msgs/msg/NavSatFix",
                "--count", "10", "--rate", "50", "--domain-id", "7", "--node", "our_gps", env=env,
            )  # fmt: skip
            theirs = (await answer(other))["stamps_ns"]
            mine = (await answer(ours))["stamps_ns"]
            got: list[int] = []
            async with asyncio.timeout(10):
                async for sample in sub:
                    got.append(sample.header.stamp_ns)
                    if len(got) == 10:
                        break
            with contextlib.suppress(TimeoutError):  # nothing of domain 0 follows
                async with asyncio.timeout(0.5):
                    async for sample in sub:
                        got.append(sample.header.stamp_ns)
        await sub.close()
    assert got == mine and not set(got) & set(theirs)
    assert "/robot7/embodied_bus_bridge" in seen["nodes"], seen["nodes"]


async def test_discovered_topics_are_bridged_by_pattern_with_types_from_the_graph() -> None:
    """``discover:`` instead of a topic list: ros-z nodes that appear after the bridge started
    are bridged when their topic is allowed and not denied, sensors by their type's modality and
    a type of no distribution (a made-up hash) as its CDR bytes."""
    env = peer_env()
    async with router_and_bus("interop6") as (endpoint, bus):
        cfg = robot_config_from_dict(
            {
                "ros": {"connect": [endpoint]},
                "discover": {
                    "allow": ["^/sensors/", "^/notes$"],
                    "deny": ["/debug$"],
                    "stream_prefix": "ros/",
                },
            }
        )
        streams = ("ros/sensors/fix", "ros/sensors/imu", "ros/notes", "ros/sensors/debug", "ros/other/fix")
        subs = {s: await bus.subscribe(s) for s in streams}
        got: dict[str, list[Any]] = {s: [] for s in streams}

        async def collect(stream: str) -> None:
            async for sample in subs[stream]:
                got[stream].append(sample)

        readers = [asyncio.create_task(collect(s)) for s in streams]
        async with RmwZenohBridge(bus, cfg) as bridge:
            assert bridge.discovered == []
            pubs = {
                "/sensors/fix": ("sensor_msgs/msg/NavSatFix", "default"),
                "/sensors/imu": ("sensor_msgs/msg/Imu", "sensor_data"),
                "/notes": ("eb_test_msgs/msg/Note", "default"),
                "/sensors/debug": ("sensor_msgs/msg/NavSatFix", "default"),
                "/other/fix": ("sensor_msgs/msg/NavSatFix", "default"),
            }
            drivers = {}
            for i, (topic, (ros_type, qos)) in enumerate(pubs.items()):
                argv = ["--topic", topic, "--type", ros_type, "--qos", qos, "--count", "20", "--rate", "40"]
                drivers[topic] = await start_peer(
                    "pub", "--connect", endpoint, *argv, "--node", f"driver{i}", env=env
                )
            sent = {topic: (await answer(proc))["stamps_ns"] for topic, proc in drivers.items()}
            async with asyncio.timeout(10):
                while len(got["ros/sensors/fix"]) < 20 or len(got["ros/notes"]) < 20:
                    await asyncio.sleep(0.02)
            discovered = {r.topic: r for r in bridge.discovered}
        for task in readers:
            task.cancel()
        for sub in subs.values():
            await sub.close()
    assert set(discovered) == {"/sensors/fix", "/sensors/imu", "/notes"}
    assert discovered["/sensors/fix"].qos.reliable and not discovered["/sensors/imu"].qos.reliable
    fix = got["ros/sensors/fix"]
    assert [s.header.stamp_ns for s in fix] == sent["/sensors/fix"]  # reliable: every one, in order
    assert fix[0].header.modality.name == "GPS" and fix[0].header.encoding == "cdr:sensor_msgs/msg/NavSatFix"
    imu = got["ros/sensors/imu"]
    assert len(imu) >= 18 and imu[0].header.modality.name == "IMU"
    notes = got["ros/notes"]
    assert notes[0].header.encoding == "cdr:eb_test_msgs/msg/Note"
    assert [string_from_cdr(s.payload) for s in notes] == [f"note {t}" for t in sent["/notes"]]
    assert got["ros/sensors/debug"] == [] and got["ros/other/fix"] == []
