"""A ROS 2 peer written with ros-z (an independent ROS 2 implementation over Zenoh), run as its
own process by the interoperability tests: it imports nothing of embodied_bus.

    python ros_z_peer.py sensors --connect EP --duration-s 4          publish lidar, camera, GPS, IMU
    python ros_z_peer.py listen --connect EP --topic T --type T --count N --timeout-s S
    python ros_z_peer.py graph --connect EP --topic T --timeout-s S  wait until T has a publisher
    python ros_z_peer.py clock --connect EP --count N --timeout-s S   receive /clock
    python ros_z_peer.py pub --connect EP --topic T --type T --count N --rate HZ [--qos Q]   publish
    python ros_z_peer.py flood --connect EP --topic T --size B --count N --rate HZ   publish clouds
    python ros_z_peer.py sink --connect EP --topic T --count N --timeout-s S        receive clouds

Each prints one JSON line with what it saw.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import threading
import time
from typing import Any, ClassVar

import msgspec
import ros_z_py as rz
from ros_z_py import builtin_interfaces, geometry_msgs, sensor_msgs, std_msgs

FLOAT32 = 7


class Clock(msgspec.Struct, frozen=True, kw_only=True):
    """rosgraph_msgs/msg/Clock, which ros-z's message package lacks (its Jazzy RIHS01 hash as
    rosbags' Jazzy typestore gives it)."""

    clock: Any = msgspec.field(default_factory=lambda: builtin_interfaces.Time())

    __msgtype__: ClassVar[str] = "rosgraph_msgs/msg/Clock"
    __hash__: ClassVar[str] = "RIHS01_692f7a66e93a3c83e71765d033b60349ba68023a8c689a79e48078bcb5c58564"


class Note(msgspec.Struct, frozen=True, kw_only=True):
    """A message type of no ROS distribution (a robot's own package), with a made-up hash: a
    bridge can only learn it from the graph."""

    text: str = ""

    __msgtype__: ClassVar[str] = "eb_test_msgs/msg/Note"
    __hash__: ClassVar[str] = "RIHS01_" + "5e" * 32


def _note(stamp_ns: int) -> bytes:
    """A Note as little-endian CDR (ros-z publishes types it lacks as raw bytes)."""
    text = f"note {stamp_ns}".encode() + b"\x00"
    return b"\x00\x01\x00\x00" + struct.pack("<I", len(text)) + text


def _node(connect: str, name: str, domain_id: int = 0, namespace: str = "") -> Any:
    ctx = (
        rz.ZContextBuilder()
        .with_domain_id(domain_id)
        .with_mode("peer")
        .disable_multicast_scouting()
        .with_connect_endpoints([connect])
        .build()
    )
    builder = ctx.create_node(name)
    if namespace:
        builder = builder.with_namespace(namespace)
    return ctx, builder.build()


def _header(stamp_ns: int, frame_id: str) -> Any:
    return std_msgs.Header(
        stamp=builtin_interfaces.Time(sec=stamp_ns // 1_000_000_000, nanosec=stamp_ns % 1_000_000_000),
        frame_id=frame_id,
    )


def _cloud(stamp_ns: int, points: int) -> Any:
    fields = [
        sensor_msgs.PointField(name=n, offset=4 * i, datatype=FLOAT32, count=1) for i, n in enumerate("xyz")
    ]
    return sensor_msgs.PointCloud2(
        header=_header(stamp_ns, "lidar"),
        height=1,
        width=points,
        fields=fields,
        is_bigendian=False,
        point_step=12,
        row_step=12 * points,
        data=bytes(12 * points),
        is_dense=True,
    )


def _image(stamp_ns: int) -> Any:
    return sensor_msgs.CompressedImage(
        header=_header(stamp_ns, "camera"), format="jpeg", data=b"\xff\xd8" + bytes(2000)
    )


def _fix(stamp_ns: int) -> Any:
    return sensor_msgs.NavSatFix(
        header=_header(stamp_ns, "gps"),
        status=sensor_msgs.NavSatStatus(status=0, service=1),
        latitude=48.1,
        longitude=11.5,
        altitude=520.0,
        position_covariance=[0.0] * 9,
    )


def _imu(stamp_ns: int) -> Any:
    return sensor_msgs.Imu(
        header=_header(stamp_ns, "imu"),
        orientation=geometry_msgs.Quaternion(x=0.0, y=0.0, z=0.0, w=1.0),
        orientation_covariance=[0.0] * 9,
        angular_velocity=geometry_msgs.Vector3(x=0.0, y=0.0, z=0.1),
        angular_velocity_covariance=[0.0] * 9,
        linear_acceleration=geometry_msgs.Vector3(x=0.0, y=0.0, z=9.81),
        linear_acceleration_covariance=[0.0] * 9,
    )


#: Topic, type, rate in Hz and message maker of each simulated driver (as config/robot.yaml).
SENSORS = (
    ("/lidar/points", sensor_msgs.PointCloud2, 10.0, lambda t: _cloud(t, 1000)),
    ("/camera/image_raw/compressed", sensor_msgs.CompressedImage, 30.0, _image),
    ("/gps/fix", sensor_msgs.NavSatFix, 5.0, _fix),
    ("/imu/data", sensor_msgs.Imu, 100.0, _imu),
)


def _raw_image(stamp_ns: int) -> Any:
    return sensor_msgs.Image(
        header=_header(stamp_ns, "camera"), height=48, width=64, encoding="rgb8", step=192, data=bytes(9216)
    )


def _scan(stamp_ns: int) -> Any:
    return sensor_msgs.LaserScan(
        header=_header(stamp_ns, "laser"),
        angle_min=-1.5,
        angle_max=1.5,
        angle_increment=0.01,
        range_min=0.1,
        range_max=30.0,
        ranges=[1.0] * 300,
        intensities=[],
    )


#: Message makers for ``pub`` by type (PointCloud2 takes --size bytes of points).
MAKERS = {
    "sensor_msgs/msg/PointCloud2": None,
    "sensor_msgs/msg/Image": _raw_image,
    "sensor_msgs/msg/CompressedImage": _image,
    "sensor_msgs/msg/NavSatFix": _fix,
    "sensor_msgs/msg/Imu": _imu,
    "sensor_msgs/msg/LaserScan": _scan,
    "eb_test_msgs/msg/Note": _note,
}
#: Types that are not ros-z's own messages.
CUSTOM: dict[str, Any] = {"eb_test_msgs/msg/Note": Note}


def _qos(name: str) -> Any:
    """``sensor_data``, ``default``, ``reliable`` or ``latched`` (reliable, transient local, depth 1)."""
    if name == "sensor_data":
        return rz.QOS_SENSOR_DATA
    if name == "latched":
        return rz.QosProfile(reliability="reliable", durability="transient_local", depth=1)
    if name == "reliable_1000":
        return rz.QosProfile(reliability="reliable", history="keep_last", depth=1000)
    return rz.QOS_DEFAULT


def pub(args: argparse.Namespace) -> dict[str, Any]:
    """Publish ``count`` messages of a sensor type at ``rate`` Hz with a QoS, header stamps
    from the wall clock; then stay ``linger_s`` (a latched publisher serves late joiners)."""
    ctx, node = _node(args.connect, args.node, args.domain_id, args.namespace)
    module, _, name = args.type.partition("/msg/")
    cls = CUSTOM.get(args.type) or getattr(getattr(rz, module), name)
    publisher = node.create_publisher(args.topic, cls, qos=_qos(args.qos))
    make = MAKERS[args.type] or (lambda t: _cloud(t, max(1, args.size // 12)))
    time.sleep(args.settle_s)
    stamps: list[int] = []
    t0 = time.monotonic()
    for i in range(args.count):
        delay = t0 + i / args.rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        stamp = time.time_ns()
        message = make(stamp)
        if isinstance(message, bytes):
            publisher.publish_raw(message)
        else:
            publisher.publish(message)
        stamps.append(stamp)
    time.sleep(args.linger_s)
    ctx.shutdown()
    return {"published": len(stamps), "stamps_ns": stamps}


def sensors(args: argparse.Namespace) -> dict[str, Any]:
    """Publish every sensor at its rate, stamped with the wall clock, for ``duration_s``."""
    ctx, node = _node(args.connect, "ros_z_sensors", args.domain_id)
    counts: dict[str, int] = {}
    pubs = [(topic, node.create_publisher(topic, cls), rate, make) for topic, cls, rate, make in SENSORS]
    time.sleep(args.settle_s)  # discovery: the bridge's subscriptions match ours
    t0 = time.monotonic()
    due = {topic: t0 for topic, _, _, _ in pubs}
    while time.monotonic() - t0 < args.duration_s:
        now = time.monotonic()
        for topic, pub, rate, make in pubs:
            if now >= due[topic]:
                pub.publish(make(time.time_ns()))
                counts[topic] = counts.get(topic, 0) + 1
                due[topic] += 1.0 / rate
        time.sleep(max(0.0, min(due.values()) - time.monotonic()))
    ctx.shutdown()
    return {"published": counts}


def listen(args: argparse.Namespace) -> dict[str, Any]:
    """Receive up to ``count`` messages of one topic within ``timeout_s``; their stamps."""
    ctx, node = _node(args.connect, "ros_z_listener", args.domain_id)
    module, _, name = args.type.partition("/msg/")
    cls = getattr(getattr(rz, module), name)
    sub = node.create_subscriber(args.topic, cls, qos=_qos(args.qos))
    print(json.dumps({"ready": True}), flush=True)
    stamps: list[int] = []
    sizes: list[int] = []
    deadline = time.monotonic() + args.timeout_s
    while len(stamps) < args.count and time.monotonic() < deadline:
        msg = sub.recv(timeout=max(0.01, deadline - time.monotonic()))
        if msg is None:
            continue
        header = getattr(msg, "header", None)
        stamp = header.stamp if header is not None else None
        stamps.append(stamp.sec * 1_000_000_000 + stamp.nanosec if stamp is not None else 0)
        sizes.append(len(getattr(msg, "data", b"") or getattr(msg, "ranges", [])))
    ctx.shutdown()
    return {"received": len(stamps), "stamps_ns": stamps, "sizes": sizes}


def graph(args: argparse.Namespace) -> dict[str, Any]:
    """Wait until ``topic`` has a publisher in the ROS graph; what the graph showed then."""
    ctx, node = _node(args.connect, "ros_z_graph", args.domain_id)
    deadline = time.monotonic() + args.timeout_s
    t0 = time.monotonic()
    while time.monotonic() < deadline and node.count_publishers(args.topic) == 0:
        time.sleep(0.05)
    out = {
        "publishers": node.count_publishers(args.topic),
        "seen_after_s": round(time.monotonic() - t0, 3),
        "topics": sorted(f"{t} {ty}" for t, ty in node.get_topic_names_and_types()),
        "nodes": sorted(f"{ns.rstrip('/')}/{n}" for n, ns in node.get_node_names()),
    }
    ctx.shutdown()
    return out


def clock(args: argparse.Namespace) -> dict[str, Any]:
    """Receive up to ``count`` /clock messages within ``timeout_s``; their times (decoded by
    hand: ros-z's Python bindings deserialize only the types they ship)."""
    ctx, node = _node(args.connect, "ros_z_clock", args.domain_id)
    sub = node.create_subscriber("/clock", Clock)
    print(json.dumps({"ready": True}), flush=True)
    times: list[int] = []
    deadline = time.monotonic() + args.timeout_s
    while len(times) < args.count and time.monotonic() < deadline:
        raw = sub.recv_serialized(timeout=max(0.01, deadline - time.monotonic()))
        if raw is not None:  # CDR: encapsulation header, int32 sec, uint32 nanosec
            sec, nanosec = struct.unpack_from("<iI" if raw[1] == 1 else ">iI", raw, 4)
            times.append(sec * 1_000_000_000 + nanosec)
    ctx.shutdown()
    return {"received": len(times), "clock_ns": times}


def flood(args: argparse.Namespace) -> dict[str, Any]:
    """Publish ``count`` PointCloud2 of ``size`` data bytes at ``rate`` Hz (0: as fast as it
    can), each stamped with the wall clock as it is sent."""
    ctx, node = _node(args.connect, "ros_z_flood", args.domain_id)
    pub = node.create_publisher(args.topic, sensor_msgs.PointCloud2)
    points = max(1, args.size // 12)
    template = _cloud(0, points)
    time.sleep(args.settle_s)  # discovery: the subscriber matches
    t0 = time.monotonic()
    for i in range(args.count):
        if args.rate > 0:
            delay = t0 + i / args.rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        now = time.time_ns()
        header = _header(now, "lidar")
        pub.publish(msgspec.structs.replace(template, header=header))
    elapsed = time.monotonic() - t0
    time.sleep(0.5)  # let the last ones leave before the session closes
    ctx.shutdown()
    return {"published": args.count, "elapsed_s": round(elapsed, 4)}


def sink(args: argparse.Namespace) -> dict[str, Any]:
    """Receive PointCloud2 until ``count`` arrived or none came for ``idle_s``; the rate and
    the latency from each header stamp (same machine, same clock)."""
    ctx, node = _node(args.connect, "ros_z_sink", args.domain_id)
    sub = node.create_subscriber(args.topic, sensor_msgs.PointCloud2)
    print(json.dumps({"ready": True}), flush=True)
    latencies_ns: list[int] = []
    first = last = 0.0
    deadline = time.monotonic() + args.timeout_s
    while len(latencies_ns) < args.count and time.monotonic() < deadline:
        msg = sub.recv(timeout=args.idle_s if latencies_ns else max(0.01, deadline - time.monotonic()))
        if msg is None:
            if latencies_ns:
                break  # idle: the flood is over
            continue
        now = time.time_ns()
        last = time.monotonic()
        first = first or last
        stamp = msg.header.stamp
        latencies_ns.append(now - (stamp.sec * 1_000_000_000 + stamp.nanosec))
    ctx.shutdown()
    latencies_ns.sort()

    def pct(q: float) -> float | None:
        return round(latencies_ns[int(q * (len(latencies_ns) - 1))] / 1e6, 4) if latencies_ns else None

    n = len(latencies_ns)
    return {
        "received": n,
        "rate_hz": round((n - 1) / (last - first), 1) if n > 1 and last > first else None,
        "latency_p50_ms": pct(0.5),
        "latency_p99_ms": pct(0.99),
    }


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("sensors", "listen", "graph", "clock", "flood", "sink", "pub"):
        s = sub.add_parser(name)
        s.add_argument("--connect", required=True)
        s.add_argument("--domain-id", type=int, default=0)
        s.add_argument("--timeout-s", type=float, default=10.0)
    sub.choices["sensors"].add_argument("--duration-s", type=float, default=4.0)
    sub.choices["sensors"].add_argument("--settle-s", type=float, default=1.0)
    sub.choices["listen"].add_argument("--topic", required=True)
    sub.choices["listen"].add_argument("--type", required=True)
    sub.choices["listen"].add_argument("--count", type=int, default=1)
    sub.choices["listen"].add_argument("--qos", default="default")
    pa = sub.choices["pub"]
    pa.add_argument("--topic", required=True)
    pa.add_argument("--type", required=True, choices=sorted(MAKERS))
    pa.add_argument("--count", type=int, default=10)
    pa.add_argument("--rate", type=float, default=10.0)
    pa.add_argument("--qos", default="default")
    pa.add_argument("--size", type=int, default=12000)
    pa.add_argument("--settle-s", type=float, default=1.0)
    pa.add_argument("--linger-s", type=float, default=0.5)
    pa.add_argument("--node", default="ros_z_pub")
    pa.add_argument("--namespace", default="")
    sub.choices["graph"].add_argument("--topic", required=True)
    sub.choices["clock"].add_argument("--count", type=int, default=1)
    for name in ("flood", "sink"):
        sub.choices[name].add_argument("--topic", required=True)
        sub.choices[name].add_argument("--count", type=int, default=1000)
    sub.choices["flood"].add_argument("--size", type=int, default=1024)
    sub.choices["flood"].add_argument("--rate", type=float, default=0.0)
    sub.choices["flood"].add_argument("--settle-s", type=float, default=1.0)
    sub.choices["sink"].add_argument("--idle-s", type=float, default=2.0)
    args = p.parse_args()
    run = {
        "sensors": sensors,
        "listen": listen,
        "graph": graph,
        "clock": clock,
        "flood": flood,
        "sink": sink,
        "pub": pub,
    }[args.cmd]
    print(json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    threading.excepthook = lambda a: print(a, file=sys.stderr)
    raise SystemExit(main())
