"""Processing stages: message → compute → message (the idea of Pulsar Functions).

A stage reads one stream, computes, and publishes another. Built-ins on open3d:

* ``voxel_downsample`` — PointCloud2 → PointCloud2 (x, y, z) on a voxel grid.
* ``crop_box`` — PointCloud2 → PointCloud2 inside an axis-aligned box.
* ``merge_clouds`` — a fused frame (``ebframe``) → one PointCloud2 in the base frame, every lidar
  member transformed by its extrinsics.

Stages come from YAML (``stages:`` list) and run in their own process (``embodied-bus stage``) or
next to a fusion worker (``embodied-bus fuse --stages``).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import yaml

from embodied_bus.bus import Bus
from embodied_bus.errors import BusConfigError, EncodingError
from embodied_bus.fusion.codec import FRAME_ENCODING, decode_frame
from embodied_bus.model.documents import convert_document
from embodied_bus.model.header import Modality, validate_stream_name
from embodied_bus.model.qos import Backpressure, PublisherOptions, SubscriptionOptions
from embodied_bus.model.sample import Sample
from embodied_bus.rosmsg.conversions import ConversionError, array_to_pointcloud2_cdr, sample_to_numpy

__all__ = [
    "STAGE_DOCUMENTS",
    "STAGE_OPS",
    "CropBoxDocument",
    "MergeCloudsDocument",
    "Output",
    "StageDocument",
    "StageSpec",
    "StageStats",
    "VoxelDownsampleDocument",
    "load_stages",
    "make_stage",
    "run_stage",
]

_log = logging.getLogger("embodied_bus.stages")
PC2 = "cdr:sensor_msgs/msg/PointCloud2"


@dataclass(frozen=True, slots=True)
class Output:
    """What a stage publishes for one input: payload, encoding, frame_id and stamp (ns)."""

    payload: bytes
    encoding: str
    frame_id: str
    stamp_ns: int


StageFn = Callable[[Sample], Output | None]


@dataclass(frozen=True, slots=True)
class StageSpec:
    """One configured stage: ``op`` applied to ``input`` published on ``output``."""

    name: str
    input: str
    output: str
    op: str
    params: Mapping[str, Any] = field(default_factory=dict)


class StageDocument(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """An entry of ``stages:``, beside the keys of its op.

    Attributes:
        name: The stage's name (in logs and errors).
        op: What it computes: ``voxel_downsample``, ``crop_box`` or ``merge_clouds``.
        input: The stream it reads.
        output: The stream it publishes.
    """

    name: str
    op: str
    input: str
    output: str


class VoxelDownsampleDocument(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``op: voxel_downsample``: PointCloud2 → PointCloud2 (x, y, z) on a voxel grid.

    Attributes:
        voxel_m: The grid's cell size, in metres (> 0).
    """

    voxel_m: float


class CropBoxDocument(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``op: crop_box``: PointCloud2 → PointCloud2 of the points inside an axis-aligned box.

    Attributes:
        min_m: The box's lower corner ``[x, y, z]``, in metres.
        max_m: The box's upper corner ``[x, y, z]``, in metres (above ``min_m`` on every axis).
    """

    min_m: list[float]
    max_m: list[float]


class MergeCloudsDocument(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``op: merge_clouds``: a fused frame → one PointCloud2 of its lidar members.

    Attributes:
        extrinsics: Each lidar stream's pose in the base frame, ``[x, y, z, roll, pitch, yaw]``
            (metres, radians).
        base_frame: The ``frame_id`` of the merged cloud.
    """

    extrinsics: dict[str, list[float]]
    base_frame: str = "base_link"


#: The keys each op takes besides those of :class:`StageDocument`.
STAGE_DOCUMENTS: Mapping[str, type[msgspec.Struct]] = {
    "voxel_downsample": VoxelDownsampleDocument,
    "crop_box": CropBoxDocument,
    "merge_clouds": MergeCloudsDocument,
}


@dataclass(slots=True)
class StageStats:
    """Counters of a running stage."""

    processed: int = 0
    published: int = 0
    failed: int = 0
    last_error: str = ""


def _xyz(sample: Sample) -> np.ndarray[Any, Any]:
    arr = sample_to_numpy(sample)
    if arr.dtype.names is not None:
        if not {"x", "y", "z"} <= set(arr.dtype.names):
            raise ConversionError(f"point cloud of {sample.stream!r} has no x, y, z fields")
        xyz = np.stack([arr["x"].reshape(-1), arr["y"].reshape(-1), arr["z"].reshape(-1)], axis=1)
    else:
        xyz = arr.reshape(-1, 3)
    xyz = xyz.astype(np.float64)
    finite: np.ndarray[Any, Any] = xyz[np.isfinite(xyz).all(axis=1)]
    return finite


def _o3d_cloud(xyz: np.ndarray[Any, Any]) -> Any:
    import open3d as o3d

    return o3d.geometry.PointCloud(o3d.utility.Vector3dVector(xyz))


def _cloud_output(points: np.ndarray[Any, Any], frame_id: str, stamp_ns: int) -> Output:
    """Nx3 points → a PointCloud2 output."""
    return Output(
        array_to_pointcloud2_cdr(points, frame_id=frame_id, stamp_ns=stamp_ns), PC2, frame_id, stamp_ns
    )


def _vec3(where: str, value: Any) -> np.ndarray[Any, Any]:
    try:
        v = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        v = np.zeros(0)
    if v.shape != (3,):
        raise BusConfigError(f"{where}: expected [x, y, z], got {value!r}")
    return v


def extrinsic_matrix(where: str, value: Any) -> np.ndarray[Any, Any]:
    """``[x, y, z, roll, pitch, yaw]`` (m, rad) or a 4x4 list → homogeneous transform."""
    v = np.asarray(value, dtype=np.float64)
    if v.shape == (4, 4):
        return v
    if v.shape != (6,):
        raise BusConfigError(f"{where}: expected [x, y, z, roll, pitch, yaw] or a 4x4 matrix")
    x, y, z, r, p, yw = v
    cr, sr, cp, sp, cy, sy = math.cos(r), math.sin(r), math.cos(p), math.sin(p), math.cos(yw), math.sin(yw)
    m = np.eye(4)
    m[:3, :3] = [
        [cy * cp, cy * sp * sr - sy * cr, cy * sp * cr + sy * sr],
        [sy * cp, sy * sp * sr + cy * cr, sy * sp * cr - cy * sr],
        [-sp, cp * sr, cp * cr],
    ]
    m[:3, 3] = [x, y, z]
    return m


def voxel_downsample(params: Mapping[str, Any]) -> StageFn:
    """PointCloud2 → PointCloud2 on a voxel grid of ``voxel_m`` metres."""
    voxel = float(params.get("voxel_m", 0))
    if voxel <= 0:
        raise BusConfigError("voxel_downsample.voxel_m: must be a positive size in metres")

    def fn(sample: Sample) -> Output:
        pcd = _o3d_cloud(_xyz(sample)).voxel_down_sample(voxel)
        return _cloud_output(
            np.asarray(pcd.points, dtype=np.float32), sample.header.frame_id, sample.header.stamp_ns
        )

    return fn


def crop_box(params: Mapping[str, Any]) -> StageFn:
    """PointCloud2 → PointCloud2 of the points inside ``[min_m, max_m]`` (x, y, z)."""
    lo, hi = _vec3("crop_box.min_m", params.get("min_m")), _vec3("crop_box.max_m", params.get("max_m"))
    if (lo >= hi).any():
        raise BusConfigError("crop_box: min_m must be below max_m on every axis")

    def fn(sample: Sample) -> Output:
        import open3d as o3d

        box = o3d.geometry.AxisAlignedBoundingBox(lo, hi)
        pts = np.asarray(_o3d_cloud(_xyz(sample)).crop(box).points, dtype=np.float32)
        return _cloud_output(pts, sample.header.frame_id, sample.header.stamp_ns)

    return fn


def merge_clouds(params: Mapping[str, Any]) -> StageFn:
    """A fused frame → one PointCloud2 in ``base_frame`` from the members named in
    ``extrinsics`` (stream → [x, y, z, roll, pitch, yaw] of the sensor in the base frame)."""
    base = str(params.get("base_frame", "base_link"))
    ext = params.get("extrinsics")
    if not isinstance(ext, Mapping) or not ext:
        raise BusConfigError("merge_clouds.extrinsics: expected a mapping of stream to pose")
    transforms = {str(k): extrinsic_matrix(f"merge_clouds.extrinsics.{k}", v) for k, v in ext.items()}

    def fn(sample: Sample) -> Output | None:
        if sample.header.encoding != FRAME_ENCODING:
            raise EncodingError(f"merge_clouds reads fused frames, got {sample.header.encoding!r}")
        frame = decode_frame(sample.payload)
        clouds = []
        for stream, t in transforms.items():
            m = frame.member(stream)
            if m is None:
                continue
            pcd = _o3d_cloud(_xyz(m.sample))
            pcd.transform(t)
            clouds.append(np.asarray(pcd.points, dtype=np.float32))
        if not clouds:
            return None
        return _cloud_output(np.concatenate(clouds), base, frame.reference_stamp_ns)

    return fn


#: Built-in stage operations by name.
STAGE_OPS: Mapping[str, Callable[[Mapping[str, Any]], StageFn]] = {
    "voxel_downsample": voxel_downsample,
    "crop_box": crop_box,
    "merge_clouds": merge_clouds,
}


def make_stage(spec: StageSpec) -> StageFn:
    """Build the function of a stage spec (validates its parameters)."""
    op = STAGE_OPS.get(spec.op)
    if op is None:
        raise BusConfigError(f"stage {spec.name!r}: unknown op {spec.op!r}; known: {sorted(STAGE_OPS)}")
    convert_document(dict(spec.params), STAGE_DOCUMENTS[spec.op], f"stage {spec.name!r}", BusConfigError)
    return op(spec.params)


_COMMON_KEYS = frozenset(f.name for f in msgspec.structs.fields(StageDocument))


def load_stages(path: str | Path) -> list[StageSpec]:
    """Read the ``stages:`` list of a YAML file.

    Raises:
        BusConfigError: Missing keys or invalid stream names; the message names the stage.
    """
    try:
        doc = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise BusConfigError(f"cannot read stages from {str(path)!r}: {err}") from err
    items = doc.get("stages", []) if isinstance(doc, Mapping) else []
    if not isinstance(items, Sequence):
        raise BusConfigError(f"{path}: stages must be a list")
    out = []
    for i, item in enumerate(items):
        where = f"{path}: stages[{i}]"
        if not isinstance(item, Mapping):
            raise BusConfigError(f"{where}: expected a mapping")
        common = {k: v for k, v in item.items() if k in _COMMON_KEYS}
        d = convert_document(common, StageDocument, where, BusConfigError)
        for key, stream in (("input", d.input), ("output", d.output)):
            try:
                validate_stream_name(stream)
            except ValueError as err:
                raise BusConfigError(f"{where}.{key}: {err}") from None
        params = {k: v for k, v in item.items() if k not in _COMMON_KEYS}
        spec = StageSpec(d.name, d.input, d.output, d.op, params)
        make_stage(spec)  # validate now, not at the first message
        out.append(spec)
    return out


async def run_stage(
    bus: Bus, spec: StageSpec, stop: asyncio.Event, *, ready: asyncio.Event | None = None
) -> StageStats:
    """Run one stage until ``stop``: every input sample in, at most one output sample out.

    A sample the stage cannot process is counted and logged; the stage keeps serving.
    """
    fn = make_stage(spec)
    stats = StageStats()
    sub = await bus.subscribe(spec.input, options=SubscriptionOptions(capacity=16))
    pub = await bus.publisher(
        spec.output,
        modality=Modality.LIDAR,
        encoding=PC2,
        options=PublisherOptions(backpressure=Backpressure.DROP_OLDEST),
    )
    if ready is not None:
        ready.set()
    try:
        while not stop.is_set():
            try:
                sample = await sub.recv(timeout_s=0.2)
            except TimeoutError:
                continue
            stats.processed += 1
            try:
                out = await asyncio.to_thread(fn, sample)  # open3d releases the GIL
            except (ConversionError, EncodingError, ValueError) as err:
                stats.failed += 1
                stats.last_error = str(err)
                _log.warning("stage %s: %s", spec.name, err)
                continue
            if out is not None:
                await pub.publish(
                    out.payload, stamp_ns=out.stamp_ns, encoding=out.encoding, frame_id=out.frame_id
                )
                stats.published += 1
    finally:
        await sub.close()
        await pub.close()
    return stats
