"""ROS 2 messages to NumPy without rclpy: CDR decoded with rosbags' typestores.

Every function takes a deserialized rosbags message (or, for :func:`sample_to_numpy`, a bus
sample with a ``cdr:<type>`` encoding) and returns arrays that view the message buffers where
the layout allows it.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable
from typing import Any

import numpy as np

from embodied_bus.errors import EncodingError
from embodied_bus.model.limits import DEFAULT_LIMITS, DecodeLimits
from embodied_bus.model.sample import Sample

__all__ = [
    "ConversionError",
    "array_to_pointcloud2_cdr",
    "compressed_image_to_array",
    "decode_cdr",
    "image_to_array",
    "imu_to_array",
    "laserscan_to_points",
    "navsatfix_to_array",
    "pointcloud2_dtype",
    "pointcloud2_to_array",
    "sample_to_numpy",
    "typestore",
]


class ConversionError(EncodingError):
    """A message cannot be converted (unknown type, inconsistent sizes, bad encoding)."""


#: sensor_msgs/PointField datatype -> numpy base type
_POINTFIELD = {1: "i1", 2: "u1", 3: "i2", 4: "u2", 5: "i4", 6: "u4", 7: "f4", 8: "f8"}

#: sensor_msgs/Image encoding -> (numpy dtype, channels)
_IMAGE = {
    "rgb8": ("u1", 3),
    "bgr8": ("u1", 3),
    "rgba8": ("u1", 4),
    "bgra8": ("u1", 4),
    "mono8": ("u1", 1),
    "mono16": ("u2", 1),
    "8UC1": ("u1", 1),
    "8UC3": ("u1", 3),
    "8UC4": ("u1", 4),
    "16UC1": ("u2", 1),
    "16SC1": ("i2", 1),
    "32FC1": ("f4", 1),
    "32SC1": ("i4", 1),
    "64FC1": ("f8", 1),
    "bayer_rggb8": ("u1", 1),
    "bayer_bggr8": ("u1", 1),
    "bayer_gbrg8": ("u1", 1),
    "bayer_grbg8": ("u1", 1),
    "yuv422": ("u1", 2),
}


@functools.cache
def typestore(distro: str = "ROS2_JAZZY") -> Any:
    """The rosbags typestore of a ROS distribution (cached)."""
    from rosbags.typesys import Stores, get_typestore

    return get_typestore(getattr(Stores, distro))


def decode_cdr(payload: bytes | memoryview, typename: str, store: Any = None) -> Any:
    """Deserialize CDR bytes into a rosbags message; ``uint8[]`` fields view the buffer.

    Raises:
        ConversionError: Unknown type or malformed CDR.
    """
    ts = store or typestore()
    if typename not in ts.fielddefs:
        raise ConversionError(f"unknown ROS message type {typename!r} (not in the typestore)")
    try:
        return ts.deserialize_cdr(payload, typename)
    except Exception as err:  # rosbags raises several internal types on bad input
        raise ConversionError(f"malformed CDR for {typename}: {type(err).__name__}: {err}") from err


def pointcloud2_dtype(msg: Any, *, limits: DecodeLimits | None = None) -> np.dtype[Any]:
    """The structured dtype of a PointCloud2's points, for any field layout (padding kept)."""
    lim = limits or DEFAULT_LIMITS
    if len(msg.fields) > lim.max_point_fields:
        raise ConversionError(
            f"PointCloud2 has {len(msg.fields)} fields, limit max_point_fields {lim.max_point_fields}"
        )
    step = int(msg.point_step)
    if step <= 0:
        raise ConversionError(f"PointCloud2 point_step must be positive, got {step}")
    names: list[str] = []
    formats: list[Any] = []
    offsets: list[int] = []
    endian = ">" if msg.is_bigendian else "<"
    for f in msg.fields:
        base = _POINTFIELD.get(int(f.datatype))
        if base is None:
            raise ConversionError(f"PointField {f.name!r} has unknown datatype {f.datatype}")
        if f.name in names:
            continue  # duplicated names appear in some drivers; keep the first
        fmt = endian + base if base not in ("i1", "u1") else base
        count, offset = int(f.count), int(f.offset)
        if offset < 0 or count < 0 or offset + np.dtype(base).itemsize * max(count, 1) > step:
            raise ConversionError(
                f"PointField {f.name!r} (offset {offset}, count {count}) does not fit point_step {step}"
            )
        names.append(f.name or f"_{len(names)}")
        formats.append(fmt if int(f.count) <= 1 else (fmt, (int(f.count),)))
        offsets.append(int(f.offset))
    try:
        return np.dtype(
            {"names": names, "formats": formats, "offsets": offsets, "itemsize": int(msg.point_step)}
        )
    except (ValueError, TypeError) as err:
        raise ConversionError(f"PointCloud2 fields do not fit point_step {msg.point_step}: {err}") from err


def pointcloud2_to_array(msg: Any, *, limits: DecodeLimits | None = None) -> np.ndarray[Any, Any]:
    """PointCloud2 → structured array of shape (height, width) (or (width,) if height is 1).

    Zero-copy when rows are not padded.

    Raises:
        ConversionError: Fields that do not fit the point, data shorter than the header claims,
            or more points or fields than ``limits`` allow.
    """
    lim = limits or DEFAULT_LIMITS
    dtype = pointcloud2_dtype(msg, limits=lim)
    h, w = int(msg.height), int(msg.width)
    if h * w > lim.max_points:
        raise ConversionError(f"PointCloud2 of {h}x{w} points exceeds max_points {lim.max_points}")
    step, row = int(msg.point_step), int(msg.row_step)
    data = np.asarray(msg.data, dtype=np.uint8)
    if row < w * step or data.size < h * row:
        raise ConversionError(
            f"PointCloud2 data ({data.size} B) too small for {h}x{w} points of {step} B (row_step {row})"
        )
    if row == w * step:
        arr = np.frombuffer(data, dtype=dtype, count=h * w)
    else:
        rows = data[: h * row].reshape(h, row)[:, : w * step]
        arr = np.ascontiguousarray(rows).view(dtype).reshape(-1)
    return arr if h == 1 else arr.reshape(h, w)


def image_to_array(msg: Any, *, limits: DecodeLimits | None = None) -> np.ndarray[Any, Any]:
    """sensor_msgs/Image → HxWxC array (C = 1 kept), viewing the data when rows are unpadded.

    Raises:
        ConversionError: Unknown encoding, data shorter than the header claims, or more pixels
            than ``limits`` allow.
    """
    lim = limits or DEFAULT_LIMITS
    if int(msg.height) * int(msg.width) > lim.max_image_pixels:
        raise ConversionError(
            f"image of {msg.height}x{msg.width} exceeds max_image_pixels {lim.max_image_pixels}"
        )
    enc = str(msg.encoding)
    if enc not in _IMAGE:
        raise ConversionError(f"unsupported image encoding {enc!r}")
    base, ch = _IMAGE[enc]
    dt = np.dtype(base).newbyteorder(">" if msg.is_bigendian else "<")
    h, w, step = int(msg.height), int(msg.width), int(msg.step)
    data = np.asarray(msg.data, dtype=np.uint8)
    row = w * ch * dt.itemsize
    if step < row or data.size < h * step:
        raise ConversionError(f"image data ({data.size} B) too small for {h}x{w} {enc} (step {step})")
    rows = data[: h * step].reshape(h, step)[:, :row]
    if step != row:
        rows = np.ascontiguousarray(rows)
    return rows.view(dt).reshape(h, w, ch)


def compressed_image_to_array(
    msg_or_bytes: Any, *, limits: DecodeLimits | None = None
) -> np.ndarray[Any, Any]:
    """sensor_msgs/CompressedImage (JPEG, PNG) or raw compressed bytes → HxWxC uint8 array.

    The image size is checked against ``limits`` before anything is decompressed (no
    decompression bombs).
    """
    from PIL import Image, UnidentifiedImageError

    lim = limits or DEFAULT_LIMITS
    data = msg_or_bytes if isinstance(msg_or_bytes, (bytes, bytearray, memoryview)) else msg_or_bytes.data
    try:
        with Image.open(io.BytesIO(bytes(data))) as img:
            w, h = img.size
            if w * h > lim.max_image_pixels:
                raise ConversionError(
                    f"compressed image of {w}x{h} exceeds max_image_pixels {lim.max_image_pixels}"
                )
            arr = np.asarray(img)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError, SyntaxError) as err:
        raise ConversionError(f"cannot decode compressed image: {err}") from err
    return arr if arr.ndim == 3 else arr[:, :, None]


def navsatfix_to_array(msg: Any) -> np.ndarray[Any, Any]:
    """sensor_msgs/NavSatFix → [latitude_deg, longitude_deg, altitude_m, status]."""
    return np.array([msg.latitude, msg.longitude, msg.altitude, msg.status.status], dtype=np.float64)


def imu_to_array(msg: Any) -> np.ndarray[Any, Any]:
    """sensor_msgs/Imu → [qx, qy, qz, qw, wx, wy, wz, ax, ay, az] (rad/s, m/s^2)."""
    o, w, a = msg.orientation, msg.angular_velocity, msg.linear_acceleration
    return np.array([o.x, o.y, o.z, o.w, w.x, w.y, w.z, a.x, a.y, a.z], dtype=np.float64)


def laserscan_to_points(msg: Any) -> np.ndarray[Any, Any]:
    """sensor_msgs/LaserScan → Nx2 float32 points (x, y in m) of the finite in-range beams."""
    ranges = np.asarray(msg.ranges, dtype=np.float32)
    angles = float(msg.angle_min) + np.arange(ranges.size, dtype=np.float32) * float(msg.angle_increment)
    ok = np.isfinite(ranges) & (ranges >= float(msg.range_min)) & (ranges <= float(msg.range_max))
    r, a = ranges[ok], angles[ok]
    return np.stack([r * np.cos(a), r * np.sin(a)], axis=1).astype(np.float32)


_CONVERTERS: dict[str, Callable[[Any], np.ndarray[Any, Any]]] = {
    "sensor_msgs/msg/PointCloud2": pointcloud2_to_array,
    "sensor_msgs/msg/Image": image_to_array,
    "sensor_msgs/msg/CompressedImage": compressed_image_to_array,
    "sensor_msgs/msg/NavSatFix": navsatfix_to_array,
    "sensor_msgs/msg/Imu": imu_to_array,
    "sensor_msgs/msg/LaserScan": laserscan_to_points,
}


def sample_to_numpy(sample: Sample) -> np.ndarray[Any, Any]:
    """Convert a sample by its encoding: ``cdr:<type>`` of a known sensor type, ``npy``,
    ``jpeg``/``png``.

    Raises:
        ConversionError: The encoding or type has no converter, or the payload is malformed.
    """
    enc = sample.header.encoding
    if enc == "npy":
        return sample.as_array()
    if enc in ("jpeg", "png"):
        return compressed_image_to_array(sample.payload)
    if enc.startswith("cdr:"):
        typename = enc[4:]
        conv = _CONVERTERS.get(typename)
        if conv is None:
            raise ConversionError(f"no NumPy conversion for {typename!r}")
        return conv(decode_cdr(sample.payload, typename))
    raise ConversionError(f"no NumPy conversion for encoding {enc!r}")


def array_to_pointcloud2_cdr(points: np.ndarray[Any, Any], *, frame_id: str, stamp_ns: int) -> bytes:
    """A structured (or Nx3 float) point array → ``sensor_msgs/msg/PointCloud2`` as CDR bytes.

    Structured arrays keep every numeric field and their layout; an Nx3 array becomes x, y, z
    float32.
    """
    ts = typestore()
    if points.dtype.names is None:
        if points.ndim != 2 or points.shape[1] != 3:
            raise ConversionError(f"expected an Nx3 array or a structured array, got shape {points.shape}")
        xyz = np.ascontiguousarray(points, dtype=np.float32)
        points = xyz.view(np.dtype([("x", "<f4"), ("y", "<f4"), ("z", "<f4")])).reshape(-1)
    kinds = {np.dtype(v): k for k, v in _POINTFIELD.items()}
    PointField = ts.types["sensor_msgs/msg/PointField"]
    fields = []
    for name in points.dtype.names or ():
        sub, offset = points.dtype.fields[name][:2]  # type: ignore[index]
        base, count = (sub.base, int(np.prod(sub.shape))) if sub.shape else (sub, 1)
        code = kinds.get(base.newbyteorder("<") if base.byteorder == ">" else base)
        if code is None:
            raise ConversionError(f"field {name!r} of type {base} has no PointField datatype")
        fields.append(PointField(name=name, offset=int(offset), datatype=code, count=count))
    flat = np.ascontiguousarray(points.reshape(-1))
    msg = ts.types["sensor_msgs/msg/PointCloud2"](
        header=ts.types["std_msgs/msg/Header"](
            stamp=ts.types["builtin_interfaces/msg/Time"](
                sec=stamp_ns // 1_000_000_000, nanosec=stamp_ns % 1_000_000_000
            ),
            frame_id=frame_id,
        ),
        height=1,
        width=flat.size,
        fields=fields,
        is_bigendian=False,
        point_step=flat.dtype.itemsize,
        row_step=flat.dtype.itemsize * flat.size,
        data=flat.view(np.uint8).reshape(-1),
        is_dense=False,
    )
    return bytes(ts.serialize_cdr(msg, "sensor_msgs/msg/PointCloud2"))


def _header(ts: Any, frame_id: str, stamp_ns: int) -> Any:
    return ts.types["std_msgs/msg/Header"](
        stamp=ts.types["builtin_interfaces/msg/Time"](
            sec=int(stamp_ns // 1_000_000_000), nanosec=int(stamp_ns % 1_000_000_000)
        ),
        frame_id=frame_id,
    )


_DEFAULT_IMAGE_ENCODING = {
    ("u1", 1): "mono8",
    ("u1", 3): "rgb8",
    ("u1", 4): "rgba8",
    ("u2", 1): "mono16",
    ("i2", 1): "16SC1",
    ("f4", 1): "32FC1",
    ("i4", 1): "32SC1",
    ("f8", 1): "64FC1",
}


def array_to_image_cdr(
    image: np.ndarray[Any, Any], *, frame_id: str, stamp_ns: int, encoding: str | None = None
) -> bytes:
    """An HxW or HxWxC array → ``sensor_msgs/msg/Image`` as CDR bytes (rows unpadded, little endian).

    Args:
        encoding: ROS image encoding; default from dtype and channels (uint8 x1/3/4 →
            mono8/rgb8/rgba8, uint16 → mono16, float32 → 32FC1, ...).

    Raises:
        ConversionError: The array does not fit the encoding, or no encoding fits the array.
    """
    arr = image if image.ndim == 3 else image.reshape(*image.shape, 1)
    if arr.ndim != 3:
        raise ConversionError(f"expected an HxW or HxWxC image array, got shape {image.shape}")
    key = (arr.dtype.newbyteorder("=").str[1:], arr.shape[2])
    enc = encoding or _DEFAULT_IMAGE_ENCODING.get(key)
    if enc is None:
        raise ConversionError(f"no ROS image encoding for dtype {arr.dtype} with {arr.shape[2]} channels")
    if enc not in _IMAGE or (np.dtype(_IMAGE[enc][0]).kind, _IMAGE[enc][1]) != (arr.dtype.kind, arr.shape[2]):
        raise ConversionError(f"a {arr.dtype} array with {arr.shape[2]} channels is not {enc!r}")
    data = np.ascontiguousarray(arr, dtype=np.dtype(_IMAGE[enc][0]).newbyteorder("<"))
    h, w, c = data.shape
    ts = typestore()
    msg = ts.types["sensor_msgs/msg/Image"](
        header=_header(ts, frame_id, stamp_ns),
        height=h,
        width=w,
        encoding=enc,
        is_bigendian=0,
        step=w * c * data.dtype.itemsize,
        data=data.reshape(-1).view(np.uint8),
    )
    return bytes(ts.serialize_cdr(msg, "sensor_msgs/msg/Image"))


def array_to_compressed_image_cdr(
    image: np.ndarray[Any, Any], *, frame_id: str, stamp_ns: int, fmt: str = "jpeg", quality: int = 90
) -> bytes:
    """An HxW(x1|3|4) uint8 array → ``sensor_msgs/msg/CompressedImage`` (``jpeg`` or lossless
    ``png``) as CDR bytes.

    Raises:
        ConversionError: Not a uint8 image, or an unknown format.
    """
    from PIL import Image

    if fmt not in ("jpeg", "png"):
        raise ConversionError(f"compressed image format {fmt!r}: expected jpeg or png")
    if (
        image.dtype != np.uint8
        or image.ndim not in (2, 3)
        or (image.ndim == 3 and image.shape[2] not in (1, 3, 4))
    ):
        raise ConversionError(f"expected an HxW(xC) uint8 image, got {image.dtype} {image.shape}")
    arr = image[:, :, 0] if image.ndim == 3 and image.shape[2] == 1 else image
    if fmt == "jpeg" and arr.ndim == 3 and arr.shape[2] == 4:
        arr = arr[:, :, :3]
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(arr)).save(buf, format=fmt.upper(), quality=quality)
    ts = typestore()
    msg = ts.types["sensor_msgs/msg/CompressedImage"](
        header=_header(ts, frame_id, stamp_ns), format=fmt, data=np.frombuffer(buf.getvalue(), dtype=np.uint8)
    )
    return bytes(ts.serialize_cdr(msg, "sensor_msgs/msg/CompressedImage"))
