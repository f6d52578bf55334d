"""ROS 2 sensor data from ros-z through ``ros-bridge`` into three fusion workers of a 50 ms /
offset 20 ms spec, one of them ``kill -9``ed mid-stream, on the Zenoh ring and on Pulsar
Key_Shared: the bridge stamps buckets with the spec's clock, and the workers together give
the frames one worker alone gives the samples the bridge published. Skips with the reason
where ros-z is not beside the repository."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from fusion_workers import (
    CLI,
    assert_one_workers_frames,
    frames_killing_one,
    key_shared_consumers,
    last_json,
    one_worker_frames,
    ready_line,
    stop_all,
    worker,
)

from embodied_bus import Backpressure, SubscriptionOptions, open_bus
from embodied_bus.fusion import spec_from_dict
from embodied_bus.model import Sample
from embodied_bus.testing.ports import free_port

from conftest import wait_until
from ros_z import peer_command, peer_env

pytestmark = pytest.mark.flaky(reruns=1)  # three workers, a bridge, ros-z and a broker on two cores

#: Each pick is decided by its own stream's samples, so the frames do not depend on the order
#: in which the streams' samples interleave.
FUSION: dict[str, Any] = {
    "name": "fused",
    "bucket_width_ms": 50,
    "bucket_offset_ms": 20,
    "lateness_ms": 1000,
    "streams": {
        "lidar/top": {"role": "reference", "expected_period_ms": 100},
        "camera/front": {"role": "required", "max_skew_ms": 25},
        "gps": {"role": "optional", "pick": "hold_last", "max_age_ms": 500},
        "imu": {"role": "optional", "pick": "all", "window": "around"},
    },
}
TOPICS = {
    "lidar/top": ("/lidar/points", "sensor_msgs/msg/PointCloud2"),
    "camera/front": ("/camera/image_raw/compressed", "sensor_msgs/msg/CompressedImage"),
    "gps": ("/gps/fix", "sensor_msgs/msg/NavSatFix"),
    "imu": ("/imu/data", "sensor_msgs/msg/Imu"),
}
SENSORS_S = 6.0


def _robot_yaml(path: Path, ns: str, ros_endpoint: str) -> Path:
    doc = {
        "namespace": ns,
        "ros": {"host_router": ros_endpoint},
        "streams": {s: {"topic": t, "type": ty} for s, (t, ty) in TOPICS.items()},
        "fusion": FUSION,
        "publish": {"frames": []},
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def _first_line_with(proc: subprocess.Popen[str], marker: str, timeout_s: float) -> bool:
    """Read ``proc``'s stdout until a line holds ``marker`` (False: not within ``timeout_s``)."""
    found = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if marker in line:
                found.set()
                return

    threading.Thread(target=read, daemon=True).start()
    return found.wait(timeout_s)


@pytest.mark.parametrize("engine_name", ["zenoh", "pulsar"])
async def test_ros_z_sensors_through_the_bridge_into_three_workers_one_killed_give_one_workers_frames(
    engine_name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    env = peer_env()  # skips where ros-z is absent
    ns = f"rosfuse{engine_name}{uuid.uuid4().hex[:8]}"
    ros_endpoint = f"tcp/127.0.0.1:{free_port()}"
    config = _robot_yaml(tmp_path / "robot.yaml", ns, ros_endpoint)
    spec = spec_from_dict(FUSION)
    if engine_name == "zenoh":
        port = free_port()
        hub_url, url, mode = f"zenoh:?listen=tcp/127.0.0.1:{port}", f"zenoh://127.0.0.1:{port}", "ring"
    else:
        hub_url = url = request.getfixturevalue("pulsar_url")
        mode = "key-shared"
    workers = [worker(url, ns, f"w{i}", mode, config, json_summary=False) for i in (1, 2, 3)]
    bridge: subprocess.Popen[str] | None = None
    inputs: list[Sample] = []
    try:
        async with open_bus(hub_url, namespace=ns) as hub:
            lossless = SubscriptionOptions(capacity=100_000, backpressure=Backpressure.BLOCK)
            frames_sub = await hub.subscribe("frames/fused", options=lossless)
            inputs_sub = await hub.subscribe(tuple(TOPICS), options=lossless)
            for w in workers:
                line = await asyncio.to_thread(ready_line, w, 60)
                assert line.startswith("fusing"), f"a worker did not start: {line!r}"
            if engine_name == "pulsar":
                broker = request.getfixturevalue("pulsar_broker")
                web = broker.web_url if broker is not None else "http://127.0.0.1:8080"
                await wait_until(
                    lambda: key_shared_consumers(web, ns, "lidar/top", "eb-fusion-fused") == 3,
                    30,
                    "three Key_Shared consumers of the reference stream",
                )
            bridge = subprocess.Popen(
                [*CLI, "ros-bridge", "--config", str(config), "--bus", url, "--ns", ns],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            assert await asyncio.to_thread(_first_line_with, bridge, "ros-bridge: node", 60), (
                "bridge did not start"
            )
            sensors = await asyncio.create_subprocess_exec(
                *peer_command("sensors", "--connect", ros_endpoint, "--duration-s", str(SENSORS_S)),
                env=env,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            kill_at = time.monotonic() + 1.0 + SENSORS_S * 0.4  # after the peer's 1 s of discovery
            frames, killed_at = await frames_killing_one(frames_sub, None, workers[1], kill_at)
            _, err = await asyncio.wait_for(sensors.communicate(), 60)
            assert sensors.returncode == 0, err.decode()[-2000:]
            while (sample := inputs_sub.recv_nowait()) is not None:
                inputs.append(sample)
    finally:
        outs = stop_all(workers)
        stop_all([bridge])
    assert {s.stream for s in inputs} == set(TOPICS), "the bridge did not carry every sensor"
    # the bridge stamped every bucket with the spec's clock
    assert all(
        (s.header.bucket_width_ns, s.header.bucket_offset_ns) == (spec.clock.width_ns, spec.clock.offset_ns)
        for s in inputs
    )
    expected = one_worker_frames(spec, sorted(inputs, key=lambda s: s.header.publish_ns))
    assert len(expected) >= 50  # one per sweep: 10 Hz for 6 s
    lost = assert_one_workers_frames(frames, expected, [last_json(outs[0]), last_json(outs[2])])
    print(f"{engine_name}: {len(frames)} of {len(expected)} frames, lost {lost}, w2 killed after {killed_at}")
