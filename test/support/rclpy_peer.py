"""A ROS 2 peer written with rclpy (real ROS 2 Jazzy, on whatever middleware its environment
selects: Fast DDS by default, rmw_zenoh_cpp when preloaded), run as its own process by the
interoperability tests. It imports nothing of embodied_bus.

    python rclpy_peer.py pub --topic T --type T --count N --rate HZ [--qos Q] [--size B]
    python rclpy_peer.py pubs --plan '[{"topic": T, "type": T, "count": N, "rate": HZ, ...}]'
    python rclpy_peer.py listens --plan '[{"topic": T, "type": T, "qos": Q}]' [--use-sim-time] [--idle-s S]
    python rclpy_peer.py listen --topic T --type T --count N --timeout-s S [--qos Q]
    python rclpy_peer.py sensors --duration-s S [--namespace NS]
    python rclpy_peer.py fibonacci-server --action A [--abort-orders 5,6] [--step-s S]
    python rclpy_peer.py fibonacci-client --action A --order N [--cancel-after-s S] [--timeout-s S]
    python rclpy_peer.py clock --count N --timeout-s S
    python rclpy_peer.py sync --topics A B --types T U --count N --timeout-s S --slop-s S

Each prints one JSON line with what it saw (after "ready" on stderr once it is set up).
QoS: ``sensor`` (best effort, keep last 5), ``reliable`` (keep last 10), ``latched``
(reliable, transient local, keep last 1), ``reliable-all`` (keep all).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from typing import Any

import rclpy
from rclpy.action import ActionClient, ActionServer, CancelResponse, GoalResponse
from rclpy.executors import MultiThreadedExecutor
from rclpy.node import Node
from rclpy.parameter import Parameter
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from rosidl_runtime_py.utilities import get_message


def qos(name: str) -> QoSProfile:
    if name == "sensor":
        return QoSProfile(depth=5, reliability=ReliabilityPolicy.BEST_EFFORT)
    if name == "latched":
        return QoSProfile(
            depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL
        )
    if name == "reliable-all":
        return QoSProfile(depth=10, history=HistoryPolicy.KEEP_ALL, reliability=ReliabilityPolicy.RELIABLE)
    return QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)


def now_ns(node: Node) -> int:
    return int(node.get_clock().now().nanoseconds)


def stamp(msg: Any, ns: int, frame_id: str) -> None:
    msg.header.stamp.sec = ns // 1_000_000_000
    msg.header.stamp.nanosec = ns % 1_000_000_000
    msg.header.frame_id = frame_id


def stamp_of(msg: Any) -> int:
    return int(msg.header.stamp.sec) * 1_000_000_000 + int(msg.header.stamp.nanosec)


def fill(msg: Any, type_name: str, size: int) -> None:
    """Give a sensor message a plausible body of about ``size`` bytes."""
    if type_name.endswith("PointCloud2"):
        from sensor_msgs.msg import PointField

        n = max(1, size // 16)
        msg.height, msg.width, msg.point_step, msg.row_step = 1, n, 16, 16 * n
        msg.fields = [PointField(name=c, offset=4 * i, datatype=7, count=1) for i, c in enumerate("xyzi")]
        msg.data = bytes(16 * n)
    elif type_name.endswith("/Image"):
        w = max(1, size // (3 * 8))
        msg.height, msg.width, msg.encoding, msg.step = 8, w, "rgb8", 3 * w
        msg.data = bytes(3 * w * 8)
    elif type_name.endswith("CompressedImage"):
        msg.format = "jpeg"
        msg.data = bytes(max(1, size))
    elif type_name.endswith("NavSatFix"):
        msg.latitude, msg.longitude, msg.altitude = 47.37, 8.54, 408.0
    elif type_name.endswith("Imu"):
        msg.orientation.w = 1.0
        msg.linear_acceleration.z = 9.81
    elif type_name.endswith("LaserScan"):
        msg.angle_min, msg.angle_max, msg.range_max = -3.14, 3.14, 30.0
        msg.ranges = [1.0] * max(1, size // 4)


def ready() -> None:
    print("ready", file=sys.stderr, flush=True)


def spin_until(node: Node, done: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        rclpy.spin_once(node, timeout_sec=0.05)


def cmd_pub(args: argparse.Namespace) -> dict[str, Any]:
    node = rclpy.create_node("rclpy_peer_pub", namespace=args.namespace)
    cls = get_message(args.type)
    pub = node.create_publisher(cls, args.topic, qos(args.qos))
    deadline = time.monotonic() + args.match_timeout_s
    while pub.get_subscription_count() < args.subscribers and time.monotonic() < deadline:
        rclpy.spin_once(node, timeout_sec=0.05)
    matched = pub.get_subscription_count()
    ready()
    stamps = []
    period = 1.0 / args.rate
    t0 = time.monotonic()
    for i in range(args.count):
        msg = cls()
        fill(msg, args.type, args.size)
        ns = 0 if args.zero_stamp else now_ns(node)
        stamp(msg, ns, f"frame{i}")
        pub.publish(msg)
        stamps.append(ns)
        delay = t0 + (i + 1) * period - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    spin_until(node, lambda: False, args.linger_s)  # latched history, reliable retransmissions
    return {"published": len(stamps), "stamps": stamps, "matched": matched}


def cmd_pubs(args: argparse.Namespace) -> dict[str, Any]:
    """Several topics from one node, as ``--plan`` (JSON: [{topic, type, count, rate, qos,
    size, jitter_ms, skip_s}]) says, once every one has ``--subscribers`` subscribers. A sensor
    clock: each header stamp is the publish time plus Gaussian jitter (``jitter_ms``, sigma); no
    message is published ``skip_s: [from, to]`` seconds into the run (an outage)."""
    node = rclpy.create_node("rclpy_peer_pubs", namespace=args.namespace)
    plan = json.loads(args.plan)
    pubs = [
        node.create_publisher(get_message(p["type"]), p["topic"], qos(p.get("qos", "reliable"))) for p in plan
    ]
    deadline = time.monotonic() + args.match_timeout_s
    while any(p.get_subscription_count() < args.subscribers for p in pubs) and time.monotonic() < deadline:
        rclpy.spin_once(node, timeout_sec=0.05)
    ready()
    stamps: list[list[int]] = [[] for _ in plan]
    t0 = time.monotonic()
    next_t = [t0] * len(plan)
    skipped = [0] * len(plan)
    while any(len(stamps[i]) + skipped[i] < p["count"] for i, p in enumerate(plan)):
        now = time.monotonic()
        for i, p in enumerate(plan):
            if len(stamps[i]) + skipped[i] < p["count"] and now >= next_t[i]:
                next_t[i] += 1.0 / p["rate"]
                skip = p.get("skip_s")
                if skip and skip[0] <= now - t0 < skip[1]:
                    skipped[i] += 1
                    continue
                msg = get_message(p["type"])()
                fill(msg, p["type"], p.get("size", 0))
                ns = now_ns(node) + round(random.gauss(0.0, p.get("jitter_ms", 0.0)) * 1e6)
                stamp(msg, ns, f"{p['topic'].strip('/').replace('/', '_')}_{len(stamps[i])}")
                pubs[i].publish(msg)
                stamps[i].append(ns)
        time.sleep(max(0.0, min(next_t) - time.monotonic()))
    spin_until(node, lambda: False, args.linger_s)
    return {"published": {p["topic"]: stamps[i] for i, p in enumerate(plan)}}


def cmd_clock_pub(args: argparse.Namespace) -> dict[str, Any]:
    """Publish /clock (sim time) from ``--start-ns``, ``--rate`` Hz, ``--count`` ticks, 10 ms of
    sim time apart."""
    from rosgraph_msgs.msg import Clock

    node = rclpy.create_node("rclpy_clock", namespace=args.namespace)
    pub = node.create_publisher(Clock, "/clock", 10)
    ready()
    t = args.start_ns
    for _ in range(args.count):
        msg = Clock()
        msg.clock.sec, msg.clock.nanosec = t // 1_000_000_000, t % 1_000_000_000
        pub.publish(msg)
        t += 10_000_000
        time.sleep(1.0 / args.rate)
    return {"last_ns": t}


def cmd_listen(args: argparse.Namespace) -> dict[str, Any]:
    node = rclpy.create_node("rclpy_peer_listen", namespace=args.namespace)
    got: list[dict[str, Any]] = []

    def on_msg(msg: Any) -> None:
        got.append(
            {
                "stamp": stamp_of(msg) if hasattr(msg, "header") else None,
                "frame_id": getattr(getattr(msg, "header", None), "frame_id", None),
            }
        )

    node.create_subscription(get_message(args.type), args.topic, on_msg, qos(args.qos))
    ready()
    spin_until(node, lambda: len(got) >= args.count, args.timeout_s)
    return {"received": len(got), "messages": got}


def cmd_listens(args: argparse.Namespace) -> dict[str, Any]:
    """Several topics in one node (``--plan``: [{topic, type, qos, count}]) for ``--timeout-s``,
    until each topic's count (default ``--count``) came, or (``--idle-s``) until nothing came for
    that long after a first message; the stamps received per topic."""
    node = rclpy.create_node(
        "rclpy_peer_listens",
        namespace=args.namespace,
        parameter_overrides=[Parameter("use_sim_time", value=args.use_sim_time)],
    )
    got: dict[str, list[int]] = {}
    sim: list[int] = []  # the node's clock at each message (ROS time from /clock on use_sim_time)

    def on_msg(m: Any, topic: str) -> None:
        got[topic].append(stamp_of(m))
        sim.append(now_ns(node))

    subs = []
    for p in json.loads(args.plan):
        topic = p["topic"]
        got[topic] = []
        subs.append(
            node.create_subscription(
                get_message(p["type"]),
                topic,
                lambda m, t=topic: on_msg(m, t),
                qos(p.get("qos", "reliable")),
            )
        )
    deadline = time.monotonic() + args.match_timeout_s  # --publishers: matched before "ready"
    while any(s.get_publisher_count() < args.publishers for s in subs) and time.monotonic() < deadline:
        rclpy.spin_once(node, timeout_sec=0.05)
    ready()
    want = {p["topic"]: p.get("count", args.count) for p in json.loads(args.plan)}
    last = [time.monotonic()]  # when the last message came (or the start)
    count = [0]

    def done() -> bool:
        n = len(sim)
        if n != count[0]:
            count[0], last[0] = n, time.monotonic()
        idle = args.idle_s and n and time.monotonic() - last[0] > args.idle_s
        return bool(idle) or all(len(got[t]) >= k for t, k in want.items())

    spin_until(node, done, args.timeout_s)
    return {"received": got, "node_clock_ns": sim}


def cmd_sensors(args: argparse.Namespace) -> dict[str, Any]:
    node = rclpy.create_node("rclpy_sensors", namespace=args.namespace)
    plan = [
        ("lidar/points", "sensor_msgs/msg/PointCloud2", 10.0, "sensor", 64_000),
        ("camera/image_raw/compressed", "sensor_msgs/msg/CompressedImage", 30.0, "sensor", 20_000),
        ("gps/fix", "sensor_msgs/msg/NavSatFix", 5.0, "reliable", 0),
        ("imu/data", "sensor_msgs/msg/Imu", 100.0, "reliable", 0),
    ]
    pubs = [
        (node.create_publisher(get_message(t), topic, qos(q)), t, 1.0 / hz, size)
        for topic, t, hz, q, size in plan
    ]
    deadline = time.monotonic() + args.match_timeout_s
    while any(p.get_subscription_count() < 1 for p, *_ in pubs) and time.monotonic() < deadline:
        rclpy.spin_once(node, timeout_sec=0.05)
    ready()
    counts = [0] * len(pubs)
    t0 = time.monotonic()
    next_t = [t0] * len(pubs)
    while time.monotonic() - t0 < args.duration_s:
        now = time.monotonic()
        for i, (pub, t, period, size) in enumerate(pubs):
            if now >= next_t[i]:
                msg = get_message(t)()
                fill(msg, t, size)
                stamp(msg, now_ns(node), t.rsplit("/", 1)[-1].lower())
                pub.publish(msg)
                counts[i] += 1
                next_t[i] += period
        time.sleep(max(0.0, min(next_t) - time.monotonic()))
    return {"published": {plan[i][0]: counts[i] for i in range(len(plan))}}


def cmd_fibonacci_server(args: argparse.Namespace) -> dict[str, Any]:
    from example_interfaces.action import Fibonacci

    node = rclpy.create_node("fibonacci_server", namespace=args.namespace)
    events: list[dict[str, Any]] = []
    abort = {int(x) for x in args.abort_orders.split(",") if x}

    def execute(goal_handle: Any) -> Any:
        order = goal_handle.request.order
        events.append({"goal": order})
        seq = [0, 1]
        fb = Fibonacci.Feedback()
        for _ in range(1, order):
            if goal_handle.is_cancel_requested:
                goal_handle.canceled()
                events.append({"canceled": order})
                return Fibonacci.Result(sequence=seq)
            seq.append(seq[-1] + seq[-2])
            fb.sequence = seq
            goal_handle.publish_feedback(fb)
            time.sleep(args.step_s)
        if order in abort:
            abort.discard(order)  # the next attempt succeeds
            goal_handle.abort()
            events.append({"aborted": order})
            return Fibonacci.Result(sequence=[])
        goal_handle.succeed()
        events.append({"succeeded": order, "sequence": seq})
        return Fibonacci.Result(sequence=seq)

    ActionServer(
        node,
        Fibonacci,
        args.action,
        execute_callback=execute,
        goal_callback=lambda _req: GoalResponse.ACCEPT,
        cancel_callback=lambda _gh: CancelResponse.ACCEPT,
    )
    executor = MultiThreadedExecutor()
    executor.add_node(node)
    ready()
    deadline = time.monotonic() + args.timeout_s
    while time.monotonic() < deadline and sum(1 for e in events if "goal" not in e) < args.goals:
        executor.spin_once(timeout_sec=0.05)
    linger = time.monotonic() + args.linger_s  # the last result response goes out
    while time.monotonic() < linger:
        executor.spin_once(timeout_sec=0.05)
    return {"events": events}


def cmd_fibonacci_client(args: argparse.Namespace) -> dict[str, Any]:
    from example_interfaces.action import Fibonacci

    node = rclpy.create_node("fibonacci_client", namespace=args.namespace)
    client = ActionClient(node, Fibonacci, args.action)
    if not client.wait_for_server(timeout_sec=args.timeout_s):
        return {"error": "no action server"}
    ready()
    t0 = time.monotonic()
    feedback: list[list[int]] = []
    send = client.send_goal_async(
        Fibonacci.Goal(order=args.order),
        feedback_callback=lambda f: feedback.append(list(f.feedback.sequence)),
    )
    rclpy.spin_until_future_complete(node, send, timeout_sec=args.timeout_s)
    handle = send.result()
    if handle is None or not handle.accepted:
        return {"accepted": False}
    if args.cancel_after_s:
        spin_until(node, lambda: False, args.cancel_after_s)
        cancel = handle.cancel_goal_async()
        rclpy.spin_until_future_complete(node, cancel, timeout_sec=args.timeout_s)
    result = handle.get_result_async()
    rclpy.spin_until_future_complete(node, result, timeout_sec=args.timeout_s)
    res = result.result()
    return {
        "accepted": True,
        "status": None if res is None else int(res.status),
        "sequence": None if res is None else list(res.result.sequence),
        "feedback": len(feedback),
        "elapsed_s": round(time.monotonic() - t0, 3),
    }


def cmd_clock(args: argparse.Namespace) -> dict[str, Any]:
    from rosgraph_msgs.msg import Clock

    node = rclpy.create_node("rclpy_clock_listener", namespace=args.namespace)
    got: list[int] = []
    node.create_subscription(
        Clock,
        "/clock",
        lambda m: got.append(m.clock.sec * 1_000_000_000 + m.clock.nanosec),
        QoSProfile(depth=10, reliability=ReliabilityPolicy.BEST_EFFORT),
    )
    ready()
    spin_until(node, lambda: len(got) >= args.count, args.timeout_s)
    return {"received": len(got), "clock": got}


def cmd_sync(args: argparse.Namespace) -> dict[str, Any]:
    """message_filters' ApproximateTimeSynchronizer on the topics: the sets it calls back."""
    import message_filters

    node = rclpy.create_node("rclpy_sync", namespace=args.namespace)
    subs = [
        message_filters.Subscriber(node, get_message(t), topic, qos_profile=qos(args.qos))
        for topic, t in zip(args.topics, args.types, strict=True)
    ]
    sets: list[list[int]] = []
    sync = message_filters.ApproximateTimeSynchronizer(subs, args.queue_size, args.slop_s)
    sync.registerCallback(lambda *msgs: sets.append([stamp_of(m) for m in msgs]))
    ready()
    spin_until(node, lambda: len(sets) >= args.count, args.timeout_s)
    return {"sets": sets}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("command")
    ap.add_argument("--topic")
    ap.add_argument("--type")
    ap.add_argument("--plan", default="[]")
    ap.add_argument("--zero-stamp", action="store_true")
    ap.add_argument("--start-ns", type=int, default=1_000_000_000_000)
    ap.add_argument("--topics", nargs="*", default=[])
    ap.add_argument("--types", nargs="*", default=[])
    ap.add_argument("--count", type=int, default=10)
    ap.add_argument("--rate", type=float, default=10.0)
    ap.add_argument("--qos", default="reliable")
    ap.add_argument("--size", type=int, default=0)
    ap.add_argument("--subscribers", type=int, default=1)
    ap.add_argument("--publishers", type=int, default=0)
    ap.add_argument("--match-timeout-s", type=float, default=20.0)
    ap.add_argument("--linger-s", type=float, default=1.0)
    ap.add_argument("--timeout-s", type=float, default=30.0)
    ap.add_argument("--idle-s", type=float, default=0.0)
    ap.add_argument("--duration-s", type=float, default=5.0)
    ap.add_argument("--namespace", default="")
    ap.add_argument("--use-sim-time", action="store_true")
    ap.add_argument("--action", default="fibonacci")
    ap.add_argument("--abort-orders", default="")
    ap.add_argument("--step-s", type=float, default=0.05)
    ap.add_argument("--goals", type=int, default=1)
    ap.add_argument("--order", type=int, default=5)
    ap.add_argument("--cancel-after-s", type=float, default=0.0)
    ap.add_argument("--queue-size", type=int, default=10)
    ap.add_argument("--slop-s", type=float, default=0.05)
    args = ap.parse_args()
    rclpy.init()
    try:
        out = {
            "pub": cmd_pub,
            "pubs": cmd_pubs,
            "clock-pub": cmd_clock_pub,
            "listen": cmd_listen,
            "listens": cmd_listens,
            "sensors": cmd_sensors,
            "fibonacci-server": cmd_fibonacci_server,
            "fibonacci-client": cmd_fibonacci_client,
            "clock": cmd_clock,
            "sync": cmd_sync,
        }[args.command](args)
    finally:
        try:
            rclpy.try_shutdown()
        except Exception:
            pass
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "rclpy_peer"
    sys.exit(main())
