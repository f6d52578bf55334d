"""The live view against a Foxglove WebSocket protocol client: advertise, subscribe, decode,
unsubscribe; only watched channels encoded; slow viewers never hold the bus; bad client
messages answered with a protocol error."""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("foxglove", reason="the live view needs foxglove-sdk (pip install '.[view]')")
pytest.importorskip("websockets", reason="the protocol client needs websockets")

from embodied_bus import open_bus
from embodied_bus.actions import Action, ActionContext, Executor, PermanentFailure, Planner, QueueService
from embodied_bus.actions.queue import open_queue
from embodied_bus.bus import Bus
from embodied_bus.cli.main import main
from embodied_bus.fusion import spec_from_dict
from embodied_bus.fusion.worker import FusionWorker
from embodied_bus.model.header import Modality
from embodied_bus.model.qos import Backpressure, PublisherOptions, SubscriptionOptions
from embodied_bus.rosmsg.conversions import decode_cdr, typestore
from embodied_bus.sim import DEFAULT_SENSORS, run_sensor
from embodied_bus.sim.synthetic import make_payload
from embodied_bus.testing.ports import free_port
from embodied_bus.testing.viewer import ViewerClient
from embodied_bus.viz import LiveView, ViewOptions

from conftest import BusPair, wait_until

pytestmark = pytest.mark.timeout(120)

SENSORS = {s.stream: s for s in DEFAULT_SENSORS}
SCHEMAS = {
    "/lidar/top": "sensor_msgs/msg/PointCloud2",
    "/camera/front": "sensor_msgs/msg/Image",
    "/gps": "sensor_msgs/msg/NavSatFix",
    "/imu": "sensor_msgs/msg/Imu",
    "/scan": "sensor_msgs/msg/LaserScan",
}


def _scan_cdr(stamp_ns: int) -> bytes:
    ts = typestore()
    msg = ts.types["sensor_msgs/msg/LaserScan"](
        header=ts.types["std_msgs/msg/Header"](
            stamp=ts.types["builtin_interfaces/msg/Time"](sec=stamp_ns // 10**9, nanosec=stamp_ns % 10**9),
            frame_id="laser",
        ),
        angle_min=-1.0,
        angle_max=1.0,
        angle_increment=0.01,
        time_increment=0.0,
        scan_time=0.1,
        range_min=0.1,
        range_max=30.0,
        ranges=np.full(201, 5.0, dtype=np.float32),
        intensities=np.zeros(0, dtype=np.float32),
    )
    return bytes(ts.serialize_cdr(msg, "sensor_msgs/msg/LaserScan"))


async def _publish_all(bus: Bus, stop: asyncio.Event, stamps: dict[str, list[int]]) -> None:
    """Every sensor kind, over and over until ``stop``; records the stamps published."""
    pubs = {
        name: await bus.publisher(name, modality=s.modality, encoding=s.encoding, frame_id=s.frame_id)
        for name, s in SENSORS.items()
    }
    scan = await bus.publisher("scan", modality=Modality.LIDAR, encoding="cdr:sensor_msgs/msg/LaserScan")
    rng = np.random.default_rng(1)
    i = 0
    while not stop.is_set():
        stamp_ns = time.time_ns()
        for name, pub in pubs.items():
            await pub.publish(make_payload(SENSORS[name], i, rng), stamp_ns=stamp_ns + i)
            stamps.setdefault("/" + name, []).append(stamp_ns + i)
        await scan.publish(_scan_cdr(stamp_ns), stamp_ns=stamp_ns)
        stamps.setdefault("/scan", []).append(stamp_ns)
        i += 1
        try:
            await asyncio.wait_for(stop.wait(), 0.05)
        except TimeoutError:
            pass


async def _until_viewed(view: LiveView, topic: str, publish: Callable[[], Awaitable[None]]) -> None:
    """Publish until the view has the channel (a Pulsar pattern subscription finds a new topic
    within about a second; what was published before is not in it)."""
    deadline = time.monotonic() + 30
    while topic not in view.counts():
        assert time.monotonic() < deadline, f"{topic} never reached the view"
        await publish()
        await asyncio.sleep(0.05)


@pytest.fixture
async def view(bus_pair: BusPair) -> AsyncIterator[LiveView]:
    async with LiveView(bus_pair.subscriber_bus, ViewOptions(port=0, stats_interval_s=0.2)) as v:
        yield v


async def test_streams_advertised_with_schemas_and_decoded(bus_pair: BusPair, view: LiveView) -> None:
    stop = asyncio.Event()
    stamps: dict[str, list[int]] = {}
    publishing = asyncio.create_task(_publish_all(bus_pair.publisher_bus, stop, stamps))
    try:
        async with ViewerClient(view.url) as client:
            await client.wait_advertised(list(SCHEMAS), timeout_s=20)
            assert client.server_info is not None and client.server_info["name"].startswith("embodied_bus")
            for topic, schema in SCHEMAS.items():
                ch = client.channels[topic]
                assert (ch["schemaName"], ch["encoding"], ch["schemaEncoding"]) == (schema, "cdr", "ros2msg")
                assert "Header header" in ch["schema"]
            await client.subscribe(*SCHEMAS)
            for topic, schema in SCHEMAS.items():
                m = await client.next_message(topic, timeout_s=10)
                msg = decode_cdr(m.payload, schema)
                stamp_ns = msg.header.stamp.sec * 10**9 + msg.header.stamp.nanosec
                assert m.log_time_ns == stamp_ns, topic  # the sensor stamp is the message time
                assert stamp_ns in stamps[topic], topic
                if topic == "/imu":
                    assert abs(msg.linear_acceleration.z - 9.81) < 1.0 and msg.orientation.w == 1.0
                elif topic == "/gps":
                    assert 47 < msg.latitude < 48 and msg.longitude == pytest.approx(8.5503)
                elif topic == "/camera/front":
                    assert (msg.height, msg.width, msg.encoding) == (480, 640, "rgb8")
                elif topic == "/lidar/top":
                    assert msg.width == 30_000 and [f.name for f in msg.fields] == [
                        "x",
                        "y",
                        "z",
                        "intensity",
                    ]
            await client.unsubscribe("/imu")
            await asyncio.sleep(0)  # the unsubscribe is on its way; later IMU data is unwatched
            before = view.counts()["/imu"]["unwatched"]
            await wait_until(
                lambda: view.counts()["/imu"]["unwatched"] > before + 5, what="IMU unwatched again"
            )
    finally:
        stop.set()
        await publishing


async def test_only_watched_channels_are_encoded(bus_pair: BusPair, view: LiveView) -> None:
    pub = await bus_pair.publisher_bus.publisher("imu", modality=Modality.IMU, encoding="npy")
    rng = np.random.default_rng(0)

    async def publish(n: int) -> None:
        for i in range(n):
            await pub.publish(make_payload(SENSORS["imu"], i, rng), stamp_ns=time.time_ns())
            await asyncio.sleep(0.002)

    await _until_viewed(view, "/imu", lambda: publish(10))
    async with ViewerClient(view.url) as client:
        await client.wait_advertised(["/imu"])
        before = view.counts()["/imu"]["unwatched"]
        await publish(20)
        await wait_until(
            lambda: view.counts()["/imu"]["unwatched"] >= before + 20, what="unwatched IMU samples"
        )
        assert view.counts()["/imu"]["forwarded"] == 0  # nothing encoded before a subscription
        await client.subscribe("/imu")
        await publish(50)
        await wait_until(lambda: view.counts()["/imu"]["forwarded"] > 0, what="a first forwarded sample")
        await client.wait_for(lambda: client.received("/imu") >= 40, what="IMU messages")


async def test_fused_frames_and_status(bus_pair: BusPair, view: LiveView) -> None:
    spec = spec_from_dict(
        {
            "name": "fused",
            "bucket_width_ms": 100,
            "streams": {
                "lidar/top": {"role": "reference", "expected_period_ms": 100},
                "imu": {"role": "required", "pick": "all", "expected_period_ms": 5},
                "gps": {
                    "role": "optional",
                    "pick": "hold_last",
                    "max_age_ms": 500,
                    "expected_period_ms": 200,
                },
            },
        }
    )
    worker = FusionWorker(bus_pair.publisher_bus, spec)
    stop, publish_stop = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await worker.ready.wait()
    sensors = [SENSORS[n] for n in ("lidar/top", "imu", "gps")]
    pubs = [
        await bus_pair.publisher_bus.publisher(
            s.stream, modality=s.modality, encoding=s.encoding, frame_id=s.frame_id, clock=spec.clock
        )
        for s in sensors
    ]
    runs = [asyncio.create_task(run_sensor(p, s, publish_stop)) for p, s in zip(pubs, sensors, strict=True)]
    try:
        async with ViewerClient(view.url) as client:
            await client.wait_advertised(["/fused/status", "/fused/lidar/top", "/fused/imu"], timeout_s=20)
            status_ch = client.channels["/fused/status"]
            assert (status_ch["encoding"], status_ch["schemaEncoding"]) == ("json", "jsonschema")
            assert client.channels["/fused/imu"]["schemaName"] == "sensor_msgs/msg/Imu"
            await client.subscribe("/fused/status", "/fused/lidar/top")
            for _ in range(3):
                m = await client.next_message("/fused/status", timeout_s=10)
                status = json.loads(m.payload)
                assert status["pipeline"] == "fused" and isinstance(status["bucket"], int)
                assert {"complete", "missing", "late_count", "skew_ms", "members"} <= status.keys()
                assert m.log_time_ns == status["reference_stamp_ns"]
            cloud = await client.next_message("/fused/lidar/top", timeout_s=10)
            msg = decode_cdr(cloud.payload, "sensor_msgs/msg/PointCloud2")
            assert msg.width == 30_000
    finally:
        publish_stop.set()
        await asyncio.gather(*runs)
        stop.set()
        await task


async def test_action_queue_channel() -> None:
    async with open_bus("zenoh:", namespace="view-actions") as bus:
        service_stop, ready, stop = asyncio.Event(), asyncio.Event(), asyncio.Event()
        db = Path(tempfile.mkdtemp()) / "actions.db"
        service = asyncio.create_task(QueueService(bus, db).run(service_stop, ready))
        await ready.wait()
        ex = Executor(bus, "arm")

        @ex.handler("pick")
        async def pick(action: Action, ctx: ActionContext) -> dict[str, Any]:
            if action.payload == "ghost":
                raise PermanentFailure("no such object")
            return {"picked": action.payload}

        queue = open_queue(bus)
        opts = ViewOptions(port=0, stats_interval_s=0.2)
        async with (
            LiveView(bus, opts, queue=queue) as view,
            ViewerClient(view.url) as client,
            Planner(bus) as planner,
        ):
            await client.wait_advertised(["/actions/queue"])
            await client.subscribe("/actions/queue")
            handles = [await planner.submit("pick", obj, priority=3) for obj in ("cup", "ghost")]
            doc: dict[str, Any] = {}

            async def queued() -> bool:
                nonlocal doc
                doc = json.loads((await client.next_message("/actions/queue")).payload)
                return bool(doc.get("available")) and doc["backlog"].get("pick/p3", {}).get("queued") == 2

            deadline = time.monotonic() + 15
            while not await queued():
                assert time.monotonic() < deadline, doc
            running = asyncio.create_task(ex.run(stop))
            for h in handles:
                await h.result(timeout_s=20)
            while {r["status"] for r in doc.get("recent", [])} != {"succeeded", "dead"}:
                doc = json.loads((await client.next_message("/actions/queue")).payload)
            dead = next(r for r in doc["recent"] if r["status"] == "dead")
            assert dead["attempts"][0]["reason"].endswith("no such object")
            assert doc["dead_letters"] == 1 and doc["in_flight"] == 0
            stop.set()
            await running
        await queue.close()
        service_stop.set()
        await service


async def test_view_without_queue_service_says_so() -> None:
    async with open_bus("zenoh:", namespace="view-noqueue") as bus:
        opts = ViewOptions(port=0, stats_interval_s=0.1, actions_timeout_s=0.3)
        queue = open_queue(bus)
        async with LiveView(bus, opts, queue=queue) as view, ViewerClient(view.url) as client:
            await client.wait_advertised(["/actions/queue", "/bus/streams"])
            await client.subscribe("/actions/queue", "/bus/streams")
            doc = json.loads((await client.next_message("/actions/queue")).payload)
            assert doc["available"] is False and doc["error"]
            stats = json.loads((await client.next_message("/bus/streams")).payload)
            assert {"streams", "view"} <= stats.keys()
        await queue.close()


async def test_slow_viewer_never_holds_the_bus(bus_pair: BusPair, view: LiveView) -> None:
    """A viewer that stops reading a 1 MiB stream: the bus keeps its rate to another subscriber,
    the view counts drops, and a second viewer is still served."""
    lossless = Backpressure.BLOCK
    pub = await bus_pair.publisher_bus.publisher(
        "big", modality=Modality.LIDAR, encoding="raw", options=PublisherOptions(backpressure=lossless)
    )
    sub = await bus_pair.subscriber_bus.subscribe(
        "big", options=SubscriptionOptions(capacity=512, backpressure=lossless)
    )
    payload = bytes(1024 * 1024)

    async def one() -> None:
        await pub.publish(payload, stamp_ns=time.time_ns())
        await sub.recv(timeout_s=10)

    await _until_viewed(view, "/big", one)
    stuck = ViewerClient(view.url, max_queue=1)
    await stuck.connect(read=True)
    await stuck.wait_advertised(["/big"])
    await stuck.subscribe("/big")
    stuck._reader.cancel()  # type: ignore[union-attr]  # from now on it reads nothing
    n = 300
    received = 0
    t0 = time.monotonic()
    for i in range(n):
        await pub.publish(payload, stamp_ns=time.time_ns())
        if i % 10 == 9:
            await asyncio.sleep(0.02)
    while received < n:
        try:
            received += len(await sub.recv_many(timeout_s=5))
        except TimeoutError:
            break
    elapsed_s = time.monotonic() - t0
    assert received == n, f"a lossless subscriber got {received} of {n} while a viewer was stuck"
    assert elapsed_s < 30
    counts = view.counts()["/big"]
    assert counts["forwarded"] + counts["dropped"] > 0
    async with ViewerClient(view.url) as fresh:
        await fresh.wait_advertised(["/big"])
        await fresh.subscribe("/big")
        await pub.publish(payload, stamp_ns=time.time_ns())
        m = await fresh.next_message("/big", timeout_s=10)
        assert json.loads(m.payload)["size_bytes"] == len(payload)
    await stuck.close()
    await sub.close()


async def test_bad_client_messages_get_a_protocol_error(bus_pair: BusPair, view: LiveView) -> None:
    pub = await bus_pair.publisher_bus.publisher("gps", modality=Modality.GPS, encoding="npy")
    rng = np.random.default_rng(0)

    async def one() -> None:
        await pub.publish(make_payload(SENSORS["gps"], 0, rng), stamp_ns=time.time_ns())

    await _until_viewed(view, "/gps", one)
    async with ViewerClient(view.url) as client:
        await client.wait_advertised(["/gps"])
        bad: list[Any] = [
            "not json{",
            json.dumps({"op": "noSuchOp"}),
            json.dumps({"op": "subscribe", "subscriptions": [{"id": 1, "channelId": 987654}]}),
            json.dumps({"op": "subscribe"}),
            b"\x07garbage",
        ]
        for i, message in enumerate(bad, start=1):
            await client.send(message)
            await client.wait_for(lambda i=i: len(client.statuses) >= i, what=f"a status for bad message {i}")
        assert all(s["level"] == 2 for s in client.statuses), client.statuses
        await client.subscribe("/gps")  # the connection still works
        await one()
        m = await client.next_message("/gps")
        assert 47 < decode_cdr(m.payload, "sensor_msgs/msg/NavSatFix").latitude < 48


async def test_payload_that_cannot_be_shown_is_reported(bus_pair: BusPair, view: LiveView) -> None:
    bad = await bus_pair.publisher_bus.publisher("imu/bad", modality=Modality.IMU, encoding="npy")
    good = await bus_pair.publisher_bus.publisher("gps", modality=Modality.GPS, encoding="npy")
    rng = np.random.default_rng(0)

    async def both() -> None:
        await bad.publish(np.arange(3.0), stamp_ns=time.time_ns())
        await good.publish(make_payload(SENSORS["gps"], 0, rng), stamp_ns=time.time_ns())

    await _until_viewed(view, "/imu/bad", both)
    await _until_viewed(view, "/gps", both)
    async with ViewerClient(view.url) as client:
        await client.wait_advertised(["/imu/bad", "/gps"])
        await client.subscribe("/imu/bad", "/gps")
        await asyncio.sleep(0)
        await wait_until(lambda: view.counts()["/imu/bad"]["unwatched"] >= 1)
        for _ in range(3):
            await both()
        await client.next_message("/gps")
        await client.wait_for(
            lambda: any("/imu/bad" in s["message"] for s in client.statuses), what="a status"
        )
        status = next(s for s in client.statuses if "/imu/bad" in s["message"])
        assert status["level"] == 1 and "got 3 values" in status["message"]  # a warning naming what is wrong
        await wait_until(lambda: view.counts()["/imu/bad"]["failed"] >= 1)


async def _connect(url: str, timeout_s: float = 30.0) -> ViewerClient:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await ViewerClient(url).connect()
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_demo_serves_the_view(tmp_path: Path) -> None:
    """``embodied-bus demo --synthetic --view PORT``: a viewer sees the sensors with their ROS 2
    types while the demo runs, and the demo still ends by itself."""
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "embodied_bus.cli.main", "demo", "--synthetic", "--duration", "8",
        "--json", "--view", str(port),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=tmp_path,
    )  # fmt: skip
    try:
        client = await _connect(f"ws://127.0.0.1:{port}")
        try:
            await client.wait_advertised(["/imu", "/camera/front", "/lidar/top", "/gps"], timeout_s=20)
            assert client.channels["/camera/front"]["schemaName"] == "sensor_msgs/msg/Image"
            await client.subscribe("/imu")
            m = await client.next_message("/imu")
            assert abs(decode_cdr(m.payload, "sensor_msgs/msg/Imu").linear_acceleration.z - 9.81) < 1
        finally:
            await client.close()
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    assert f"ws://localhost:{port}" in err.decode()
    assert {r["stream"] for r in json.loads(out)["streams"]} == set(SENSORS)


def test_shipped_layout_is_the_generated_one(tmp_path: Path) -> None:
    """``config/foxglove/embodied_bus.json`` is what ``view --write-layout`` writes, and names
    the channels the view serves."""
    shipped = Path(__file__).resolve().parents[2] / "config" / "foxglove" / "embodied_bus.json"
    written = tmp_path / "layout.json"
    assert main(["view", "--write-layout", str(written)]) == 0
    assert written.read_text() == shipped.read_text(), "regenerate: embodied-bus view --write-layout ..."
    doc = json.loads(shipped.read_text())
    text = json.dumps(doc["configById"])
    for topic in ("/lidar/top", "/fused/scan", "/camera/front", "/gps", "/imu.linear_acceleration.x"):
        assert topic in text
    for topic in ("/fused/status", "/actions/queue", "/bus/streams.streams"):
        assert topic in text
