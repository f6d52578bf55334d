"""The rmw_zenoh wire format, byte for byte, and the bridge end to end against a process speaking
that format (test/rmw_node.py, written from the wire facts without embodied_bus code)."""

from __future__ import annotations

import asyncio
import json
import re
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
import yaml
from zenoh.ext import Int64, z_serialize

from embodied_bus import open_bus
from embodied_bus.actions import Action, Executor, QueueService, RetryPolicy, ZenohQueueOptions
from embodied_bus.errors import BusConfigError, BusConnectionError
from embodied_bus.fusion.worker import FusionWorker
from embodied_bus.ros.bridge_core import header_of, string_cdr, string_from_cdr
from embodied_bus.ros.config import RobotConfigError, RosLink, load_robot_config, robot_config_from_dict
from embodied_bus.ros.rmw_bridge import RmwZenohBridge, open_rmw_session
from embodied_bus.ros.sealing import bridge_credentials, bridge_planner
from embodied_bus.rosmsg.conversions import array_to_pointcloud2_cdr, pointcloud2_to_array
from embodied_bus.rosmsg.rmw_zenoh import (
    DEFAULT_QOS,
    SENSOR_DATA_QOS,
    Durability,
    EntityKind,
    History,
    QosProfile,
    Reliability,
    RmwZenohError,
    dds_type_name,
    entity_token,
    gid_of,
    node_token,
    pack_attachment,
    ros_type_of_dds,
    topic_key,
    type_hash,
    unpack_attachment,
)
from embodied_bus.security import Sealer, Verifier, WatchedAllowList, load_private_key
from embodied_bus.testing.ports import free_ports

from conftest import wait_until
from rmw_node import STORE, RmwNode, key, stamped

ROOT = Path(__file__).resolve().parents[2]
# From rmw_zenoh's docs/design.md (the key expression example for std_msgs/msg/String).
STRING_HASH = "RIHS01_df668c740482bbd48fb39d76a70dfd4bd59db1288021743503259e948f6b1a18"


def test_string_type_hash_equals_the_value_in_rmw_zenohs_design_document() -> None:
    assert type_hash("std_msgs/msg/String") == STRING_HASH
    assert type_hash("std_msgs/msg/String", "kilted") == STRING_HASH


@pytest.mark.parametrize(
    "ros_type", ["sensor_msgs/msg/PointCloud2", "sensor_msgs/msg/Imu", "nav_msgs/msg/Odometry"]
)
def test_type_hashes_are_rihs01_of_the_jazzy_definitions(ros_type: str) -> None:
    h = type_hash(ros_type)
    assert h == STORE.hash_rihs01(ros_type) and h.startswith("RIHS01_") and len(h) == 7 + 64


def test_humble_and_unknown_types_are_refused_with_a_clear_error() -> None:
    with pytest.raises(RmwZenohError, match="Humble is not interoperable"):
        type_hash("std_msgs/msg/String", "humble")
    with pytest.raises(RmwZenohError, match="not defined in ROS 2 jazzy"):
        type_hash("ackermann_msgs/msg/AckermannDriveStamped")
    with pytest.raises(RmwZenohError, match="pkg/msg/Name"):
        dds_type_name("String")


def test_key_expressions_follow_the_rmw_zenoh_layout() -> None:
    assert dds_type_name("std_msgs/msg/String") == "std_msgs::msg::dds_::String_"
    assert ros_type_of_dds("sensor_msgs::msg::dds_::Imu_") == "sensor_msgs/msg/Imu"
    assert topic_key(0, "/robot1/chatter", "std_msgs/msg/String", STRING_HASH) == (
        f"0/robot1/chatter/std_msgs::msg::dds_::String_/{STRING_HASH}"
    )
    assert topic_key(7, "/chatter/", "std_msgs/msg/String", "H") == "7/chatter/std_msgs::msg::dds_::String_/H"
    with pytest.raises(RmwZenohError, match="domain id"):
        topic_key(300, "/chatter", "std_msgs/msg/String", "H")
    with pytest.raises(RmwZenohError, match="not valid"):
        topic_key(0, "/a/*/b", "std_msgs/msg/String", "H")


@pytest.mark.parametrize(
    ("qos", "expected"),
    [
        (DEFAULT_QOS, "::,10:,:,:,,"),
        (SENSOR_DATA_QOS, "2::,5:,:,:,,"),
        (QosProfile(depth=42), "::,:,:,:,,"),
        (QosProfile(depth=0), "::,:,:,:,,"),
        (QosProfile(Reliability.RELIABLE, Durability.TRANSIENT_LOCAL, History.KEEP_ALL, 1), ":1:2,1:,:,:,,"),
    ],
)
def test_qos_segments_leave_rmw_zenoh_defaults_empty(qos: QosProfile, expected: str) -> None:
    assert qos.keyexpr() == expected


def test_liveliness_tokens_mangle_names_and_encode_entities() -> None:
    assert node_token(0, "ab12", 0, "", "talker") == "@ros2_lv/0/ab12/0/0/NN/%/%/talker"
    assert node_token(3, "ab12", 2, "/robot1/arm", "n") == "@ros2_lv/3/ab12/2/2/NN/%/%robot1%arm/n"
    tok = entity_token(
        0,
        "ab12",
        0,
        10,
        EntityKind.PUBLISHER,
        "",
        "talker",
        "/chatter",
        "std_msgs/msg/String",
        STRING_HASH,
        DEFAULT_QOS,
    )
    assert tok == (
        f"@ros2_lv/0/ab12/0/10/MP/%/%/talker/%chatter/std_msgs::msg::dds_::String_/{STRING_HASH}/::,10:,:,:,,"
    )
    sub = entity_token(
        0,
        "ab12",
        1,
        4,
        EntityKind.SUBSCRIPTION,
        "/r1",
        "bridge",
        "/lidar/points",
        "std_msgs/msg/String",
        "H",
        SENSOR_DATA_QOS,
    )
    assert (
        sub == "@ros2_lv/0/ab12/1/4/MS/%/%r1/bridge/%lidar%points/std_msgs::msg::dds_::String_/H/2::,5:,:,:,,"
    )


def test_gid_is_xxh3_128_of_the_liveliness_key_low_word_first() -> None:
    tok = "@ros2_lv/0/ab12/0/10/MP/%/%/talker/%chatter/std_msgs::msg::dds_::String_/H/::,10:,:,:,,"
    gid = gid_of(tok)
    h = xxhash.xxh3_128_intdigest(tok.encode())
    assert gid == struct.pack("<QQ", h & (2**64 - 1), h >> 64) == xxhash.xxh3_128(tok.encode()).digest()[::-1]
    assert len(gid) == 16


def test_attachment_is_33_bytes_identical_to_the_zenoh_ext_serializer() -> None:
    gid = bytes(range(16))
    att = pack_attachment(1, 1_700_000_000_123_456_789, gid)
    assert len(att) == 33
    assert att == struct.pack("<qqB", 1, 1_700_000_000_123_456_789, 16) + gid
    assert att == z_serialize((Int64(1), Int64(1_700_000_000_123_456_789), gid)).to_bytes()
    back = unpack_attachment(att)
    assert (back.sequence_number, back.source_timestamp_ns, back.gid) == (1, 1_700_000_000_123_456_789, gid)
    for bad in (None, b"", att[:-1], att[:16] + b"\x0f" + att[17:]):
        with pytest.raises(RmwZenohError):
            unpack_attachment(bad)


def test_header_stamps_and_strings_are_read_from_cdr_without_deserializing() -> None:
    cdr = stamped(
        "sensor_msgs/msg/CompressedImage",
        1_700_000_000_250_000_000,
        "cam",
        format="jpeg",
        data=np.zeros(3, np.uint8),
    )
    assert header_of(cdr, "sensor_msgs/msg/CompressedImage") == (1_700_000_000_250_000_000, "cam")
    assert header_of(string_cdr("x"), "std_msgs/msg/String") is None
    assert header_of(cdr[:10], "sensor_msgs/msg/CompressedImage") is None
    s = string_cdr("hé")
    assert s == bytes(
        STORE.serialize_cdr(STORE.types["std_msgs/msg/String"](data="hé"), "std_msgs/msg/String")
    )
    assert string_from_cdr(s) == "hé"
    with pytest.raises(ValueError, match="length"):
        string_from_cdr(s[:-2])


def test_the_ros_session_reads_rmw_zenohs_environment_and_the_robot_yaml_comes_last(tmp_path: Path) -> None:
    from embodied_bus.ros.rmw_session import rmw_session_config, router_check_attempts

    default = rmw_session_config(RosLink(), {})
    assert json.loads(default.get_json("connect/endpoints")) == ["tcp/localhost:7447"]
    assert json.loads(default.get_json("timestamping/enabled")) is True
    conf_file = tmp_path / "session.json5"
    conf_file.write_text('{mode: "peer", connect: {endpoints: ["tcp/10.0.0.9:7447"]}}')
    env = {
        "ZENOH_SESSION_CONFIG_URI": str(conf_file),
        "ZENOH_CONFIG_OVERRIDE": 'listen/endpoints=["tcp/127.0.0.1:0"]',
    }
    from_file = rmw_session_config(RosLink(), env)
    assert json.loads(from_file.get_json("connect/endpoints")) == ["tcp/10.0.0.9:7447"]
    assert json.loads(from_file.get_json("listen/endpoints")) == ["tcp/127.0.0.1:0"]
    mine = rmw_session_config(RosLink(connect=("tcp/10.0.0.5:7447",)), env)  # the robot YAML wins
    assert json.loads(mine.get_json("connect/endpoints")) == ["tcp/10.0.0.5:7447"]
    with pytest.raises(BusConfigError, match="ZENOH_CONFIG_OVERRIDE: 'connect' is not key=value"):
        rmw_session_config(RosLink(), {"ZENOH_CONFIG_OVERRIDE": "connect"})
    with pytest.raises(BusConfigError, match="ZENOH_SESSION_CONFIG_URI: cannot read"):
        rmw_session_config(RosLink(), {"ZENOH_SESSION_CONFIG_URI": str(tmp_path / "none.json5")})
    assert [router_check_attempts({"ZENOH_ROUTER_CHECK_ATTEMPTS": v}) for v in ("", "0", "3", "-1")] == [
        None, None, 3, 0
    ]  # fmt: skip


async def test_without_a_router_the_session_gives_up_after_the_attempts_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (port,) = free_ports(1)
    monkeypatch.setenv("ZENOH_ROUTER_CHECK_ATTEMPTS", "2")
    t0 = time.monotonic()
    with pytest.raises(BusConnectionError, match=r"no Zenoh router at .* after 2 attempt\(s\)"):
        await open_rmw_session(RosLink(connect=(f"tcp/127.0.0.1:{port}",)))
    assert time.monotonic() - t0 < 10


def test_the_ros_domain_comes_from_the_config_else_ros_domain_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROS_DOMAIN_ID", "42")
    assert load_robot_config(ROOT / "config" / "robot.yaml").ros.domain_id == 42
    assert robot_config_from_dict({"ros": {"domain_id": 7}}).ros.domain_id == 7
    monkeypatch.setenv("ROS_DOMAIN_ID", "")
    assert robot_config_from_dict({}).ros.domain_id == 0
    monkeypatch.setenv("ROS_DOMAIN_ID", "robot")
    with pytest.raises(
        RobotConfigError, match=r"ROS_DOMAIN_ID: expected an integer in 0\.\.232, got 'robot'"
    ):
        robot_config_from_dict({})


def test_the_shipped_robot_config_loads_and_bad_keys_are_named() -> None:
    cfg = load_robot_config(ROOT / "config" / "robot.yaml")
    topics = {r.topic for r in cfg.inbound}
    assert {"/lidar/points", "/camera/image_raw/compressed", "/gps/fix", "/imu/data"} <= topics
    assert cfg.fusion is not None and cfg.frames and cfg.actions
    for doc, match in [
        ({"ros": {"distro": "humble"}}, "humble is not interoperable"),
        ({"streams": {"a": {"topic": "two//slashes", "type": "std_msgs/msg/String"}}}, "streams.a.topic"),
        ({"streams": {"a": {"topic": "/a", "type": "std_msgs/msg/String", "qos": "fast"}}}, "streams.a.qos"),
        ({"actions": {"routes": {"go": {"action": "/go", "type": "nav2_msgs/msg/Goal"}}}}, "not an action"),
        ({"bogus": 1}, "unknown key"),
    ]:
        with pytest.raises(RobotConfigError, match=match):
            robot_config_from_dict(doc)


def _config(router: str) -> dict:  # type: ignore[type-arg]
    return {
        "ros": {"domain_id": 0, "node_name": "eb_bridge", "host_router": router},
        "streams": {
            "lidar/top": {"topic": "/lidar/points", "type": "sensor_msgs/msg/PointCloud2"},
            "camera/front": {
                "topic": "/camera/image_raw/compressed",
                "type": "sensor_msgs/msg/CompressedImage",
            },
            "chatter": {"topic": "/chatter", "type": "std_msgs/msg/String", "qos": "default"},
        },
        "fusion": {
            "name": "fused",
            "bucket_width_ms": 100,
            "bucket_offset_ms": 50,
            "lateness_ms": 100,
            "streams": {
                "lidar/top": {"role": "reference", "expected_period_ms": 100},
                "camera/front": {"role": "required", "max_skew_ms": 25, "expected_period_ms": 100},
            },
        },
        "publish": {
            "frames": [{"stream": "frames/fused", "namespace": "/fused"}],
            "streams": [{"stream": "status", "topic": "/robot/status", "type": "std_msgs/msg/String"}],
        },
    }


class Rig:
    def __init__(self, bridge: RmwZenohBridge, node: RmwNode, bus_url: str) -> None:
        self.bridge, self.node, self.bus_url = bridge, node, bus_url


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    router_port, bus_port = free_ports(2)
    router = f"tcp/127.0.0.1:{router_port}"
    cfg = robot_config_from_dict(_config(router))
    stop = asyncio.Event()
    async with open_bus(f"zenoh:?listen=tcp/127.0.0.1:{bus_port}", namespace="rmw") as bus:
        assert cfg.fusion is not None
        worker = FusionWorker(bus, cfg.fusion)
        wtask = asyncio.create_task(worker.run(stop))
        await worker.ready.wait()
        async with RmwZenohBridge(bus, cfg) as bridge:
            node = await asyncio.to_thread(RmwNode, f"tcp/127.0.0.1:{router_port}")
            try:
                yield Rig(bridge, node, f"zenoh://127.0.0.1:{bus_port}")
            finally:
                await asyncio.to_thread(node.close)
        stop.set()
        await wtask


async def _wait_matched(node: RmwNode, topic: str, ros_type: str) -> None:
    node.publish(topic, ros_type, b"", attachment=False)  # declares the publisher; dropped (no attachment)
    pub = node.pubs[key(topic, ros_type)]
    await wait_until(lambda: pub.matching_status.matching, 10, f"bridge subscribed to {topic}")


async def test_ros_topics_become_bus_streams_and_fused_frames_come_back_as_ros_topics(rig: Rig) -> None:
    node = rig.node
    node.subscribe("0/fused/**")
    for topic, t in [
        ("/lidar/points", "sensor_msgs/msg/PointCloud2"),
        ("/camera/image_raw/compressed", "sensor_msgs/msg/CompressedImage"),
    ]:
        await _wait_matched(node, topic, t)
    base = (time.time_ns() // 100_000_000) * 100_000_000
    clouds = {}
    async with open_bus(rig.bus_url, namespace="rmw") as probe:
        sub = await probe.subscribe("lidar/top")
        for i in range(8):
            t = base + i * 100_000_000
            pts = np.zeros(4, dtype=[("x", "<f4"), ("y", "<f4"), ("z", "<f4")])
            pts["x"] = i
            cloud = array_to_pointcloud2_cdr(pts, frame_id="lidar", stamp_ns=t)
            clouds[t] = cloud
            node.publish("/lidar/points", "sensor_msgs/msg/PointCloud2", cloud)
            image = stamped(
                "sensor_msgs/msg/CompressedImage",
                t + 3_000_000,
                "cam",
                format="jpeg",
                data=np.frombuffer(b"\xff\xd8fake\xff\xd9", dtype=np.uint8),
            )
            node.publish("/camera/image_raw/compressed", "sensor_msgs/msg/CompressedImage", image)
            await asyncio.sleep(0.01)
        lidar_key = "0/fused/lidar/top/sensor_msgs::msg::dds_::PointCloud2_/" + STORE.hash_rihs01(
            "sensor_msgs/msg/PointCloud2"
        )
        await wait_until(lambda: len(node.received.get(lidar_key, [])) >= 5, 15, "fused lidar members on ROS")
        got = await sub.recv(timeout_s=5)
        await sub.close()
    # the bus sample carries the ROS header stamp and the untouched CDR
    assert got.header.encoding == "cdr:sensor_msgs/msg/PointCloud2" and got.header.stamp_ns in clouds
    assert bytes(got.payload) == clouds[got.header.stamp_ns]
    assert got.header.frame_id == "lidar"
    # frames come back as ROS topics with rmw_zenoh attachments, in order, from one GID
    with node.lock:
        lidar = list(node.received[lidar_key])
        diag_keys = [k for k in node.received if k.startswith("0/fused/diagnostics/")]
        cam_keys = [k for k in node.received if k.startswith("0/fused/camera/front/")]
    seqs = [struct.unpack_from("<q", att)[0] for _, att in lidar if att is not None]
    assert all(att is not None and len(att) == 33 for _, att in lidar)
    assert seqs == list(range(1, len(lidar) + 1))
    gids = {att[17:] for _, att in lidar if att is not None}
    assert len(gids) == 1
    for payload, _ in lidar:
        assert payload in clouds.values()
        arr = pointcloud2_to_array(STORE.deserialize_cdr(payload, "sensor_msgs/msg/PointCloud2"))
        assert arr.shape == (4,)
    assert cam_keys and diag_keys
    diag = STORE.deserialize_cdr(node.received[diag_keys[0]][0][0], "diagnostic_msgs/msg/DiagnosticArray")
    status = diag.status[0]
    assert status.level == 0 and status.message == "complete"
    assert {kv.key for kv in status.values} >= {"bucket", "missing", "max_skew_ms", "late_count"}
    # the graph a ROS node sees: the bridge node, its subscriptions and its publishers, GID = XXH3
    graph = node.graph()
    zid = rig.bridge.zid
    assert f"@ros2_lv/0/{zid}/0/0/NN/%/%/eb_bridge" in graph
    assert any(
        f"/{zid}/" in k and "/MS/" in k and "%lidar%points/sensor_msgs::msg::dds_::PointCloud2_" in k
        for k in graph
    )
    mp = [k for k in graph if f"/{zid}/" in k and "/MP/" in k and "%fused%lidar%top/" in k]
    assert len(mp) == 1 and xxhash.xxh3_128(mp[0].encode()).digest()[::-1] in gids
    # the empty probe samples without an attachment were dropped and counted, like rmw_zenoh does
    assert rig.bridge.counters.rejected["no_attachment"] >= 2


async def test_bus_streams_are_published_as_ros_topics_and_wrong_types_are_counted(rig: Rig) -> None:
    node = rig.node
    status_key = key("/robot/status", "std_msgs/msg/String")
    node.subscribe(status_key)
    async with open_bus(rig.bus_url, namespace="rmw") as probe:
        good = await probe.publisher("status", encoding="cdr:std_msgs/msg/String")
        wrong = await probe.publisher("status", encoding="npy")
        await good.wait_for_subscribers(10)
        for i in range(100):
            await wrong.publish(b"not a ROS message", stamp_ns=time.time_ns())
            await good.publish(string_cdr(f"ok {i}"), stamp_ns=time.time_ns())
            if node.received.get(status_key):
                break
            await asyncio.sleep(0.05)
    await wait_until(lambda: bool(node.received.get(status_key)), 5, "status on ROS")
    payload, att = node.received[status_key][0]
    assert string_from_cdr(payload).startswith("ok ") and att is not None and len(att) == 33
    assert struct.unpack_from("<q", att)[0] == 1
    await wait_until(lambda: rig.bridge.counters.rejected["type_mismatch"] >= 1, 5, "mismatch counted")
    assert all(string_from_cdr(p).startswith("ok ") for p, _ in node.received[status_key])


async def test_a_garbage_frame_is_counted_and_the_bridge_keeps_serving(rig: Rig) -> None:
    node = rig.node
    status_key = key("/robot/status", "std_msgs/msg/String")
    node.subscribe(status_key)
    async with open_bus(rig.bus_url, namespace="rmw") as probe:
        junk = await probe.publisher("frames/fused", encoding="ebframe")
        good = await probe.publisher("status", encoding="cdr:std_msgs/msg/String")
        await junk.wait_for_subscribers(10)
        await junk.publish(b"EBF1\xff\xff\xff\xffgarbage", stamp_ns=1)
        await wait_until(lambda: rig.bridge.counters.rejected["bad_frame"] == 1, 10, "bad frame counted")
        await good.wait_for_subscribers(10)
        for i in range(100):
            await good.publish(string_cdr("still serving"), stamp_ns=i + 1)
            if node.received.get(status_key):
                break
            await asyncio.sleep(0.05)
    assert string_from_cdr(node.received[status_key][0][0]) == "still serving"


async def test_types_without_a_header_are_stamped_with_the_source_timestamp(rig: Rig) -> None:
    node = rig.node
    await _wait_matched(node, "/chatter", "std_msgs/msg/String")
    async with open_bus(rig.bus_url, namespace="rmw") as probe:
        sub = await probe.subscribe("chatter")
        before = time.time_ns()
        got = None
        for _ in range(50):  # until the probe's subscription is discovered
            node.publish("/chatter", "std_msgs/msg/String", string_cdr("hello"))
            try:
                got = await sub.recv(timeout_s=0.2)
                break
            except TimeoutError:
                continue
        assert got is not None
        assert string_from_cdr(got.payload) == "hello"
        assert before <= got.header.stamp_ns <= time.time_ns()
        await sub.close()


@pytest.mark.parametrize("sealed", [False, True], ids=["unsealed", "sealed"])
async def test_ros_planners_submit_actions_as_json_and_read_the_outcome(tmp_path: Path, sealed: bool) -> None:
    """JSON submissions from a ROS planner, with the robot YAML's ``security:`` section (from
    ``keys init``): the bridge's planner signs and seals, the queue and the executor only believe
    sealed messages, and the executor runs only signed actions."""
    router_port, bus_port = free_ports(2)
    doc: dict[str, Any] = {"ros": {"host_router": f"tcp/127.0.0.1:{router_port}"}}
    if sealed:
        printed = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "embodied_bus.cli.main", "keys", "init", str(tmp_path / "keys"),
             "--executors", "ex-ros"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        doc |= yaml.safe_load(printed.stdout[printed.stdout.index("security:") :].split("\n\n")[0])
    cfg = robot_config_from_dict(doc)
    creds = bridge_credentials(cfg.security)
    stop = asyncio.Event()
    async with open_bus(f"zenoh:?listen=tcp/127.0.0.1:{bus_port}", namespace="rmwact") as bus:
        ready = asyncio.Event()
        keys = tmp_path / "keys"
        service = QueueService(
            bus,
            tmp_path / "q.db",
            RetryPolicy(max_attempts=2, initial_backoff_s=0.05),
            sealer=Sealer(load_private_key(keys / "queue.pem")) if sealed else None,
            trust=creds.trust,
        )
        tasks = [asyncio.create_task(service.run(stop, ready))]
        await ready.wait()

        async def navigate(action: Action, ctx):  # type: ignore[no-untyped-def]
            return {"reached": action.payload["goal"]}

        ex_sealer = Sealer(load_private_key(keys / "ex-ros.pem")) if sealed else None
        ex = Executor(
            bus,
            "ex-ros",
            backend=ZenohQueueOptions(ex_sealer, creds.trust) if sealed else None,
            verifier=Verifier(WatchedAllowList(keys / "allow.yaml"), audience="rmwact") if sealed else None,
        )
        ex.handler("navigate_to")(navigate)
        tasks.append(asyncio.create_task(ex.run(stop)))
        async with RmwZenohBridge(bus, cfg, planner=bridge_planner(bus, creds)) as bridge:
            node = await asyncio.to_thread(RmwNode, f"tcp/127.0.0.1:{router_port}", "ros_planner")
            try:
                results_key = key("/embodied_bus/actions/results", "std_msgs/msg/String")
                node.subscribe(results_key)
                await _wait_matched(node, "/embodied_bus/actions/submit", "std_msgs/msg/String")
                node.publish(
                    "/embodied_bus/actions/submit",
                    "std_msgs/msg/String",
                    string_cdr(
                        json.dumps({"kind": "navigate_to", "payload": {"goal": [1, 2]}, "request_id": "r1"})
                    ),
                )
                node.publish("/embodied_bus/actions/submit", "std_msgs/msg/String", string_cdr("{not json"))

                def outcomes() -> list[dict]:  # type: ignore[type-arg]
                    with node.lock:
                        return [json.loads(string_from_cdr(p)) for p, _ in node.received.get(results_key, [])]

                await wait_until(
                    lambda: any(o.get("status") == "succeeded" for o in outcomes()), 15, "result"
                )
                await wait_until(
                    lambda: any(o.get("status") == "rejected" for o in outcomes()), 5, "rejection"
                )
                done = next(o for o in outcomes() if o.get("status") == "succeeded")
                assert done["request_id"] == "r1" and done["kind"] == "navigate_to"
                assert done["result"] == {"reached": [1, 2]}
                assert any(o.get("status") == "queued" and o.get("id") == done["id"] for o in outcomes())
                bad = next(o for o in outcomes() if o.get("status") == "rejected")
                assert "not valid JSON" in bad["error"]
                assert bridge.counters.rejected["bad_submission"] == 1
                assert creds.trust is None or not creds.trust.refused, creds.trust.refused  # all sealed
                assert ex.verifier is None or ex.verifier.accepted >= 1
            finally:
                await asyncio.to_thread(node.close)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)


def test_the_ros_bridge_command_hosts_the_router_and_bridges_until_interrupted(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    router_port, bus_port = free_ports(2)
    cfg = tmp_path / "robot.yaml"
    cfg.write_text(
        "ros: {node_name: cli_bridge}\n"
        "streams:\n  chatter: {topic: /chatter, type: std_msgs/msg/String, qos: default}\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "embodied_bus.cli.main", "ros-bridge", "--config", str(cfg),
         "--host-router", f"tcp/127.0.0.1:{router_port}", "--bus", f"zenoh:?listen=tcp/127.0.0.1:{bus_port}",
         "--ns", "cli", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip

    async def exercise() -> None:
        node = None
        deadline = time.monotonic() + 30
        while node is None:
            try:
                node = await asyncio.to_thread(RmwNode, f"tcp/127.0.0.1:{router_port}", "cli_talker")
                await wait_until(
                    lambda n=node: any(k.endswith("/NN/%/%/cli_bridge") for k in n.graph()), 2, "graph"
                )
            except Exception:
                if node is not None:
                    await asyncio.to_thread(node.close)
                    node = None
                assert proc.poll() is None and time.monotonic() < deadline, "ros-bridge did not come up"
                await asyncio.sleep(0.3)
        try:
            async with open_bus(f"zenoh://127.0.0.1:{bus_port}", namespace="cli") as bus:
                sub = await bus.subscribe("chatter")
                for _ in range(100):
                    node.publish("/chatter", "std_msgs/msg/String", string_cdr("from ros"))
                    try:
                        got = await sub.recv(timeout_s=0.2)
                        break
                    except TimeoutError:
                        continue
                else:
                    raise AssertionError("nothing bridged from ROS to the bus")
                assert string_from_cdr(got.payload) == "from ros"
                assert got.header.encoding == "cdr:std_msgs/msg/String"
        finally:
            await asyncio.to_thread(node.close)

    try:
        asyncio.run(exercise())
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    summary = json.loads(out)
    assert summary["from_ros"]["/chatter"] >= 1


def test_graph_tokens_read_back_into_the_entities_they_announce() -> None:
    from embodied_bus.rosmsg.rmw_graph import parse_token, qos_of_keyexpr
    from embodied_bus.rosmsg.rmw_zenoh import (
        SENSOR_DATA_QOS,
        EntityKind,
        QosProfile,
        entity_token,
        node_token,
    )

    latched = QosProfile.parse({"durability": "transient_local", "depth": 1})
    for qos in (SENSOR_DATA_QOS, latched, QosProfile(depth=42)):
        tok = entity_token(7, "ab12", 3, 9, EntityKind.PUBLISHER, "/robot1", "cam", "/robot1/image/raw",
                           "sensor_msgs/msg/Image", "RIHS01_" + "0f" * 32, qos)  # fmt: skip
        e = parse_token(tok)
        assert (e.domain_id, e.zid, e.node_id, e.entity_id, e.kind) == (7, "ab12", 3, 9, EntityKind.PUBLISHER)
        assert (e.namespace, e.node_name, e.topic) == ("/robot1", "cam", "/robot1/image/raw")
        assert (e.ros_type, e.type_hash, e.qos) == ("sensor_msgs/msg/Image", "RIHS01_" + "0f" * 32, qos)
    node = parse_token(node_token(0, "ab12", 1, "", "driver"))
    assert (node.kind, node.namespace, node.node_name, node.topic) == (EntityKind.NODE, "", "driver", "")
    expected = {"reliability": "best_effort", "durability": "transient_local", "depth": 5}
    assert qos_of_keyexpr("2:1:,5:,:,:,,") == QosProfile.parse(expected)
    for bad in ("0/chatter/x/y", "@ros2_lv/0/z/0/0/XX/%/%/n", "@ros2_lv/x/z/0/0/NN/%/%/n",
                "@ros2_lv/0/z/0/1/MP/%/%/n/%t/std_msgs::msg::dds_::String_/h/fast"):  # fmt: skip
        with pytest.raises(RmwZenohError):
            parse_token(bad)


def test_discover_selects_topics_by_pattern_and_refuses_bad_patterns_naming_the_key() -> None:
    cfg = robot_config_from_dict(
        {
            "discover": {"allow": ["^/sensors/", "^/tf$"], "deny": ["debug"], "stream_prefix": "ros/"},
            "publish": {"frames": [{"namespace": "/sensors/fused"}]},
        }
    )
    sel = cfg.discover
    assert sel is not None
    admitted = [
        t for t in ("/sensors/imu", "/tf", "/tf_static", "/sensors/debug/x", "/rosout") if sel.admits(t)
    ]
    assert admitted == ["/sensors/imu", "/tf"]
    assert sel.stream_of("/sensors/imu") == "ros/sensors/imu" and sel.stream_of("/a/~b") is None
    assert cfg.publishes("/sensors/fused/lidar") and not cfg.publishes("/sensors/imu")
    assert robot_config_from_dict({}).discover is None
    assert not robot_config_from_dict({"discover": {}}).discover.admits("/parameter_events")  # type: ignore[union-attr]
    bad = {
        "robot.discover.allow[1]: '(x' is not a regular expression": {"allow": ["a", "(x"]},
        "robot.discover.deny: expected a list, got str": {"deny": "debug"},
        "robot.discover.stream_prefix: 'a b/'": {"stream_prefix": "a b/"},
        "robot.discover.qos: QoS 'fast'": {"qos": "fast"},
        "robot.discover: unknown key 'topics'": {"topics": []},
    }
    for message, doc in bad.items():
        with pytest.raises(RobotConfigError, match=re.escape(message)):
            robot_config_from_dict({"discover": doc})
