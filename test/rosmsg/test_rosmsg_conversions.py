"""Message conversions to NumPy, tested on real recordings made by other people."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from rosbags.highlevel import AnyReader

from embodied_bus.model import Header, Modality, Sample
from embodied_bus.rosmsg import (
    ConversionError,
    array_to_compressed_image_cdr,
    array_to_image_cdr,
    array_to_pointcloud2_cdr,
    compressed_image_to_array,
    decode_cdr,
    image_to_array,
    imu_to_array,
    laserscan_to_points,
    navsatfix_to_array,
    pointcloud2_to_array,
    sample_to_numpy,
    typestore,
)

from recordings import recording


def messages(path: Any, topic: str) -> list[tuple[str, Any]]:
    with AnyReader([path], default_typestore=typestore()) as r:
        conns = [c for c in r.connections if c.topic == topic]
        return [(c.msgtype, r.deserialize(raw, c.msgtype)) for c, _, raw in r.messages(connections=conns)]


SICK = ("sick_rms_lms_radar_lidar", "rms_1xxx_lms_1xx_movement_off.bag")


@pytest.mark.parametrize(
    ("topic", "fields"),
    [
        ("/cloud", ["x", "y", "z", "intensity"]),
        ("/cloud_radar_rawtarget", ["x", "y", "z", "vrad", "amplitude"]),
        ("/cloud_radar_track", ["x", "y", "z", "vx", "vy", "vz", "objLen", "objId"]),
    ],
)
def test_every_sick_point_cloud_layout_becomes_a_structured_array(topic: str, fields: list[str]) -> None:
    msgs = messages(recording(*SICK), topic)
    assert msgs
    for _, m in msgs:
        arr = pointcloud2_to_array(m)
        assert list(arr.dtype.names) == fields
        assert arr.shape == (m.width,) and arr.dtype.itemsize == m.point_step
        assert np.isfinite(arr["x"]).all()
    lidar = pointcloud2_to_array(msgs[0][1])
    assert np.shares_memory(lidar, msgs[0][1].data)  # a view of the message buffer


def test_a_cdr_round_trip_through_a_bus_sample_decodes_the_cloud() -> None:
    msgtype, m = messages(recording(*SICK), "/cloud")[0]
    cdr = bytes(typestore().serialize_cdr(m, msgtype))
    h = Header(
        stream="lidar",
        modality=Modality.LIDAR,
        seq=1,
        stamp_ns=1,
        bucket=0,
        bucket_width_ns=100,
        bucket_offset_ns=0,
        encoding=f"cdr:{msgtype}",
        frame_id="cloud",
        publisher_id=1,
        publish_ns=1,
    )
    arr = sample_to_numpy(Sample(h, cdr, 2))
    assert np.array_equal(arr, pointcloud2_to_array(m))


def test_laser_scans_become_xy_points() -> None:
    _, scan = messages(recording("plotjuggler_tilt_laser", "tilt_laser.bag"), "/scan")[0]
    pts = laserscan_to_points(scan)
    assert pts.ndim == 2 and pts.shape[1] == 2 and 0 < len(pts) <= len(scan.ranges)
    assert (np.hypot(pts[:, 0], pts[:, 1]) <= scan.range_max + 1e-3).all()


def test_navsatfix_and_imu_become_arrays() -> None:
    bag = recording("plotjuggler_tilt_laser", "tilt_laser.bag")
    _, fix = messages(bag, "/position_gps")[0]
    lat, lon, alt, status = navsatfix_to_array(fix)
    assert 400 < alt < 600
    assert 47.3 < lat < 47.4 and 8.5 < lon < 8.6 and status == 0
    _, imu = messages(bag, "/imu_data")[0]
    v = imu_to_array(imu)
    assert v.shape == (10,) and 9.0 < v[9] < 10.5


def test_a_real_jpeg_frame_decodes_to_an_rgb_array() -> None:
    msgs = messages(
        recording("fiducials_raspicam_aruco", "aruco_images.bag"), "/raspicam_node/image/compressed"
    )
    if not msgs:
        with AnyReader(
            [recording("fiducials_raspicam_aruco", "aruco_images.bag")], default_typestore=typestore()
        ) as r:
            topic = next(c.topic for c in r.connections if c.msgtype.endswith("CompressedImage"))
        msgs = messages(recording("fiducials_raspicam_aruco", "aruco_images.bag"), topic)
    img = compressed_image_to_array(msgs[0][1])
    assert img.ndim == 3 and img.shape[2] in (1, 3) and img.shape[0] > 100


def test_raw_images_with_padded_rows_are_cropped() -> None:
    ts = typestore()
    Image = ts.types["sensor_msgs/msg/Image"]
    Hdr = ts.types["std_msgs/msg/Header"]
    Time = ts.types["builtin_interfaces/msg/Time"]
    data = np.arange(2 * 8, dtype=np.uint8)  # 2 rows of 6 bytes (2 rgb pixels) + 2 padding
    msg = Image(
        header=Hdr(stamp=Time(sec=1, nanosec=0), frame_id="cam"),
        height=2,
        width=2,
        encoding="rgb8",
        is_bigendian=0,
        step=8,
        data=data,
    )
    arr = image_to_array(msg)
    assert arr.shape == (2, 2, 3) and arr[1, 0, 0] == 8


def test_bad_input_raises_conversion_errors() -> None:
    with pytest.raises(ConversionError, match="unknown ROS message type"):
        decode_cdr(b"\x00\x01\x00\x00", "foo_msgs/msg/Bar")
    with pytest.raises(ConversionError, match="malformed CDR"):
        decode_cdr(b"\x00\x01\x00\x00\x01", "sensor_msgs/msg/PointCloud2")
    with pytest.raises(ConversionError, match="cannot decode compressed image"):
        compressed_image_to_array(b"not a jpeg")
    h = Header(
        stream="x",
        modality=Modality.OTHER,
        seq=1,
        stamp_ns=1,
        bucket=0,
        bucket_width_ns=100,
        bucket_offset_ns=0,
        encoding="cdr:std_msgs/msg/String",
        frame_id="",
        publisher_id=1,
        publish_ns=1,
    )
    with pytest.raises(ConversionError, match="no NumPy conversion"):
        sample_to_numpy(Sample(h, b"", 1))


def test_real_sick_clouds_round_trip_through_pointcloud2_with_every_field() -> None:
    for topic in ("/cloud", "/cloud_radar_rawtarget", "/cloud_radar_track"):
        _, m = messages(recording(*SICK), topic)[0]
        arr = pointcloud2_to_array(m)
        back = decode_cdr(
            array_to_pointcloud2_cdr(arr, frame_id="radar", stamp_ns=7), "sensor_msgs/msg/PointCloud2"
        )
        again = pointcloud2_to_array(back)
        assert again.dtype == arr.dtype and np.array_equal(again.view(np.uint8), arr.view(np.uint8))
        assert back.header.frame_id == "radar" and back.header.stamp.nanosec == 7


@pytest.mark.parametrize("fmt", ["png", "jpeg"])
def test_a_real_camera_frame_round_trips_through_image_and_compressed_image(fmt: str) -> None:
    bag = recording("fiducials_raspicam_aruco", "aruco_images.bag")
    with AnyReader([bag], default_typestore=typestore()) as r:
        topic = next(c.topic for c in r.connections if c.msgtype.endswith("CompressedImage"))
    rgb = compressed_image_to_array(messages(bag, topic)[0][1])
    raw = decode_cdr(array_to_image_cdr(rgb, frame_id="cam", stamp_ns=1_500_000_000), "sensor_msgs/msg/Image")
    assert raw.encoding == ("rgb8" if rgb.shape[2] == 3 else "mono8") and raw.header.stamp.sec == 1
    assert np.array_equal(image_to_array(raw), rgb)
    comp = decode_cdr(
        array_to_compressed_image_cdr(rgb, frame_id="cam", stamp_ns=0, fmt=fmt),
        "sensor_msgs/msg/CompressedImage",
    )
    back = compressed_image_to_array(comp)
    assert back.shape == rgb.shape and comp.format == fmt
    if fmt == "png":
        assert np.array_equal(back, rgb)  # lossless
    else:
        assert np.abs(back.astype(int) - rgb.astype(int)).mean() < 6


def test_images_that_fit_no_encoding_are_refused() -> None:
    with pytest.raises(ConversionError, match="not 'rgb8'"):
        array_to_image_cdr(np.zeros((2, 2, 1), np.uint8), frame_id="", stamp_ns=0, encoding="rgb8")
    with pytest.raises(ConversionError, match="no ROS image encoding"):
        array_to_image_cdr(np.zeros((2, 2, 2), np.uint8), frame_id="", stamp_ns=0)
    with pytest.raises(ConversionError, match="uint8"):
        array_to_compressed_image_cdr(np.zeros((2, 2), np.float32), frame_id="", stamp_ns=0)
    u16 = np.arange(12, dtype=np.uint16).reshape(3, 4)
    back = image_to_array(
        decode_cdr(array_to_image_cdr(u16, frame_id="", stamp_ns=0), "sensor_msgs/msg/Image")
    )
    assert np.array_equal(back[:, :, 0], u16)
