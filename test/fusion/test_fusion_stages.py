"""Processing stages on open3d: voxel downsample, crop box, merging lidars; over real Zenoh."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from rosbags.highlevel import AnyReader

from embodied_bus import BusConfigError, open_bus
from embodied_bus.fusion import MultiModalFrame, encode_frame
from embodied_bus.fusion.frame import Member
from embodied_bus.fusion.stages import StageSpec, load_stages, make_stage, run_stage
from embodied_bus.model import Header, Modality, Sample
from embodied_bus.rosmsg import array_to_pointcloud2_cdr, pointcloud2_to_array, sample_to_numpy, typestore

from conftest import zenoh_urls
from recordings import recording

ROOT = Path(__file__).resolve().parents[2]
PC2 = "cdr:sensor_msgs/msg/PointCloud2"


def cloud_sample(points: np.ndarray, stream: str = "lidar", frame_id: str = "lidar") -> Sample:  # type: ignore[type-arg]
    cdr = array_to_pointcloud2_cdr(points, frame_id=frame_id, stamp_ns=1_000)
    return Sample(
        Header(
            stream=stream,
            modality=Modality.LIDAR,
            seq=1,
            stamp_ns=1_000,
            bucket=0,
            bucket_width_ns=100,
            bucket_offset_ns=0,
            encoding=PC2,
            frame_id=frame_id,
            publisher_id=1,
            publish_ns=1,
        ),
        cdr,
        2,
    )


def sick_cloud() -> Sample:
    path = recording("sick_rms_lms_radar_lidar", "rms_1xxx_lms_1xx_movement_off.bag")
    with AnyReader([path], default_typestore=typestore()) as r:
        conns = [c for c in r.connections if c.topic == "/cloud"]
        conn, _, raw = next(iter(r.messages(connections=conns)))
        msg = r.deserialize(raw, conn.msgtype)
    cdr = bytes(typestore().serialize_cdr(msg, "sensor_msgs/msg/PointCloud2"))
    return Sample(
        Header(
            stream="cloud",
            modality=Modality.LIDAR,
            seq=1,
            stamp_ns=1,
            bucket=0,
            bucket_width_ns=100,
            bucket_offset_ns=0,
            encoding=PC2,
            frame_id="cloud",
            publisher_id=1,
            publish_ns=1,
        ),
        cdr,
        2,
    )


def test_numpy_points_round_trip_through_pointcloud2_cdr_with_any_fields() -> None:
    pts = np.zeros(5, dtype=[("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("ring", "<u2"), ("t", "<f8")])
    pts["x"] = np.arange(5)
    pts["ring"] = 7
    back = sample_to_numpy(cloud_sample(pts))
    assert back.dtype.names == pts.dtype.names and np.array_equal(back, pts)


def test_voxel_downsample_thins_a_real_sick_cloud() -> None:
    s = sick_cloud()
    before = pointcloud2_to_array(typestore().deserialize_cdr(s.payload, "sensor_msgs/msg/PointCloud2"))
    out = make_stage(StageSpec("v", "cloud", "cloud/v", "voxel_downsample", {"voxel_m": 0.5}))(s)
    assert out is not None and out.encoding == PC2 and out.frame_id == "cloud"
    after = sample_to_numpy(Sample(s.header._replace(encoding=PC2), out.payload, 3))
    assert 0 < len(after) < np.isfinite(before["x"]).sum()


def test_crop_box_keeps_only_points_inside() -> None:
    rng = np.random.default_rng(1)
    pts = rng.uniform(-10, 10, size=(1000, 3)).astype(np.float32)
    out = make_stage(StageSpec("c", "l", "l/c", "crop_box", {"min_m": [-1, -1, -1], "max_m": [1, 2, 3]}))(
        cloud_sample(pts)
    )
    assert out is not None
    kept = sample_to_numpy(Sample(cloud_sample(pts).header, out.payload, 3))
    xyz = np.stack([kept["x"], kept["y"], kept["z"]], 1)
    assert len(xyz) > 0 and (xyz >= [-1, -1, -1]).all() and (xyz <= [1, 2, 3]).all()


def test_merge_clouds_puts_two_lidars_in_the_base_frame() -> None:
    left = cloud_sample(np.array([[1.0, 0, 0]], np.float32), "lidar/left", "left")
    right = cloud_sample(np.array([[1.0, 0, 0]], np.float32), "lidar/right", "right")
    frame = MultiModalFrame(
        bucket=0,
        start_ns=0,
        end_ns=100,
        reference_stamp_ns=50,
        members={"lidar/left": (Member(left, 1, 0),), "lidar/right": (Member(right, 1, 0),)},
        missing=(),
        complete=True,
    )
    fs = Sample(
        Header(
            stream="frames/f",
            modality=Modality.FRAME,
            seq=1,
            stamp_ns=50,
            bucket=0,
            bucket_width_ns=100,
            bucket_offset_ns=0,
            encoding="ebframe",
            frame_id="",
            publisher_id=1,
            publish_ns=1,
        ),
        bytes(encode_frame(frame)),
        2,
    )
    fn = make_stage(
        StageSpec(
            "m",
            "frames/f",
            "lidar/merged",
            "merge_clouds",
            {
                "base_frame": "base_link",
                "extrinsics": {"lidar/left": [0, 0.5, 1, 0, 0, 0], "lidar/right": [0, -0.5, 1, 0, 0, np.pi]},
            },
        )
    )
    out = fn(fs)
    assert out is not None and out.frame_id == "base_link"
    merged = sample_to_numpy(Sample(fs.header._replace(encoding=PC2), out.payload, 3))
    xyz = sorted(map(tuple, np.round(np.stack([merged["x"], merged["y"], merged["z"]], 1), 4)))
    assert xyz == [(-1.0, -0.5, 1.0), (1.0, 0.5, 1.0)]


@pytest.mark.parametrize(
    ("op", "params", "message"),
    [
        ("voxel_downsample", {}, "voxel_m"),
        ("crop_box", {"min_m": [0, 0], "max_m": [1, 1, 1]}, "min_m"),
        ("crop_box", {"min_m": [2, 0, 0], "max_m": [1, 1, 1]}, "below"),
        ("merge_clouds", {}, "extrinsics"),
        ("sharpen", {}, "unknown op"),
        ("crop_box", {"min_m": [0, 0, 0], "max_m": [1, 1, 1], "voxel_m": 1}, "unknown key .voxel_m."),
    ],
)
def test_bad_stage_parameters_are_rejected_by_name(op: str, params: dict[str, object], message: str) -> None:
    with pytest.raises(BusConfigError, match=message):
        make_stage(StageSpec("s", "a", "b", op, params))


def test_the_shipped_stage_config_loads_and_reads_streams_the_robot_publishes() -> None:
    from embodied_bus.ros.config import load_robot_config

    stages = load_stages(ROOT / "config" / "stages.yaml")
    assert [s.name for s in stages] == ["lidar_voxel", "lidar_crop", "lidars_merged"]
    robot = load_robot_config(ROOT / "config" / "robot.yaml")
    published = {r.stream for r in robot.inbound} | {f.stream for f in robot.frames}
    published |= {s.output for s in stages}
    assert all(s.input in published for s in stages), [s.input for s in stages]


async def test_a_stage_turns_one_stream_into_another_over_zenoh() -> None:
    url_a, url_b = zenoh_urls()
    async with open_bus(url_a, namespace="stg") as a, open_bus(url_b, namespace="stg") as b:
        stop, ready = asyncio.Event(), asyncio.Event()
        spec = StageSpec("v", "lidar/top/points", "lidar/top/voxel", "voxel_downsample", {"voxel_m": 1.0})
        task = asyncio.create_task(run_stage(b, spec, stop, ready=ready))
        await ready.wait()
        out_sub = await a.subscribe("lidar/top/voxel")
        pub = await a.publisher("lidar/top/points", encoding=PC2, frame_id="lidar")
        assert await pub.wait_for_subscribers(10)
        pts = np.random.default_rng(0).uniform(-5, 5, size=(20_000, 3)).astype(np.float32)
        await pub.publish(array_to_pointcloud2_cdr(pts, frame_id="lidar", stamp_ns=5), stamp_ns=5)
        await pub.publish(b"not a point cloud", stamp_ns=6)  # counted, the stage keeps serving
        await pub.publish(array_to_pointcloud2_cdr(pts[:100], frame_id="lidar", stamp_ns=7), stamp_ns=7)
        first = await out_sub.recv(timeout_s=20)
        second = await out_sub.recv(timeout_s=20)
        stop.set()
        stats = await task
    assert first.header.encoding == PC2 and 0 < len(sample_to_numpy(first)) <= 11**3  # 1 m voxels in 10 m
    assert second.stamp_ns == 7
    assert stats.failed == 1 and stats.published == 2
