"""Bus samples as the ROS 2 messages a viewer draws (transport-free)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from embodied_bus.model.encoding import encode_npy
from embodied_bus.model.header import Header, Modality
from embodied_bus.model.sample import Sample
from embodied_bus.rosmsg.conversions import ConversionError, decode_cdr, image_to_array
from embodied_bus.sim.synthetic import DEFAULT_SENSORS, make_payload
from embodied_bus.viz.messages import SAMPLE_INFO_SCHEMA, view_for

STAMP_NS = 1_700_000_000_123_456_789


def sample(encoding: str, modality: Modality, payload: bytes, frame_id: str = "f") -> Sample:
    h = Header(
        stream="s",
        modality=modality,
        seq=7,
        stamp_ns=STAMP_NS,
        bucket=3,
        bucket_width_ns=100,
        bucket_offset_ns=0,
        encoding=encoding,
        frame_id=frame_id,
        publisher_id=1,
        publish_ns=STAMP_NS,
    )
    return Sample(h, payload, STAMP_NS)


def show(s: Sample) -> tuple[str, bytes]:
    view = view_for(s.header)
    return view.schema.name, view.encode(s)


def stamp_of(msg: object) -> int:
    st = msg.header.stamp  # type: ignore[attr-defined]
    return int(st.sec) * 1_000_000_000 + int(st.nanosec)


def test_synthetic_sensors_become_their_ros2_messages() -> None:
    rng = np.random.default_rng(0)
    by_stream = {s.stream: s for s in DEFAULT_SENSORS}

    def payload(name: str) -> bytes:
        p = make_payload(by_stream[name], 4, rng)
        return p if isinstance(p, bytes) else bytes(encode_npy(p))

    spec = by_stream["lidar/top"]
    name, data = show(sample(spec.encoding, spec.modality, payload("lidar/top"), "lidar_top"))
    cloud = decode_cdr(data, name)
    assert name == "sensor_msgs/msg/PointCloud2" and cloud.width == 30_000 and stamp_of(cloud) == STAMP_NS
    assert cloud.header.frame_id == "lidar_top"

    spec = by_stream["camera/front"]
    name, data = show(sample(spec.encoding, spec.modality, payload("camera/front")))
    image = decode_cdr(data, name)
    assert name == "sensor_msgs/msg/Image" and image_to_array(image).shape == (480, 640, 3)
    assert int(image_to_array(image)[0, 0, 0]) == 4

    name, data = show(sample("npy", Modality.GPS, payload("gps")))
    fix = decode_cdr(data, name)
    assert name == "sensor_msgs/msg/NavSatFix" and fix.latitude == pytest.approx(47.376304)

    name, data = show(sample("npy", Modality.IMU, payload("imu")))
    imu = decode_cdr(data, name)
    assert name == "sensor_msgs/msg/Imu" and imu.orientation.w == 1.0
    assert imu.linear_acceleration.z == pytest.approx(9.81, abs=0.5)


def test_cdr_passes_through_and_unknown_payloads_show_as_facts() -> None:
    laser = sample("cdr:sensor_msgs/msg/LaserScan", Modality.LIDAR, b"\x00\x01\x00\x00abc")
    view = view_for(laser.header)
    assert view.schema.name == "sensor_msgs/msg/LaserScan" and view.schema.encoding == "ros2msg"
    assert view.encode(laser) == bytes(laser.payload)
    assert "MSG: std_msgs/Header" in view.schema.data.decode()

    for enc in ("cdr:no_pkg/msg/Nothing", "raw", "raw:rgb8:bad", "msgpack"):
        s = sample(enc, Modality.OTHER, b"12345")
        view = view_for(s.header)
        assert view.schema == SAMPLE_INFO_SCHEMA, enc
        facts = json.loads(view.encode(s))
        assert facts == {
            "stream": "s",
            "encoding": enc,
            "seq": 7,
            "stamp_ns": STAMP_NS,
            "bucket": 3,
            "size_bytes": 5,
            "frame_id": "f",
        }


def test_payloads_that_do_not_fit_their_type_raise_a_named_error() -> None:
    with pytest.raises(ConversionError, match="got 3 values"):
        show(sample("npy", Modality.IMU, bytes(encode_npy(np.arange(3.0)))))
    with pytest.raises(ConversionError, match="latitude, longitude and altitude"):
        show(sample("npy", Modality.GPS, bytes(encode_npy(np.arange(2.0)))))
    with pytest.raises(ConversionError, match="not a 4x4 rgb8 image"):
        show(sample("raw:rgb8:4x4", Modality.CAMERA, bytes(47)))
