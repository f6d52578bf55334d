"""Bus samples as messages a Foxglove viewer draws: ROS 2 CDR with its ``ros2msg`` schema.

* ``cdr:<type>`` payloads pass through unchanged, with the type's definition from the typestore.
* NumPy and raw payloads of the synthetic and SDK publishers become the ROS 2 message of their
  modality: a structured or Nx3 point array → ``PointCloud2``, ``raw:<encoding>:<H>x<W>`` camera
  bytes → ``Image``, ``jpeg``/``png`` → ``CompressedImage``, ``[lat, lon, alt(, status)]`` →
  ``NavSatFix``, the 10-value IMU array of :func:`~embodied_bus.rosmsg.imu_to_array` → ``Imu``.
* Anything else is shown as JSON facts about the sample (stamp, sequence, bucket, size), so a
  stream is never invisible because its payload cannot be drawn.

Converters are chosen once per stream from the first sample's header (:func:`view_for`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from embodied_bus.model.encoding import decode_npy
from embodied_bus.model.header import Header, Modality
from embodied_bus.model.sample import Sample
from embodied_bus.rosmsg.conversions import (
    ConversionError,
    array_to_image_cdr,
    array_to_pointcloud2_cdr,
    typestore,
)

__all__ = ["SAMPLE_INFO_SCHEMA", "ChannelSchema", "MessageView", "json_schema", "ros_schema", "view_for"]


@dataclass(frozen=True, slots=True)
class ChannelSchema:
    """What a viewer channel advertises.

    Attributes:
        name: Schema name (``sensor_msgs/msg/Imu``, ``embodied_bus/FrameStatus``).
        encoding: Schema encoding: ``ros2msg`` or ``jsonschema``.
        data: The schema text.
        message_encoding: ``cdr`` or ``json``.
    """

    name: str
    encoding: str
    data: bytes
    message_encoding: str


@dataclass(frozen=True, slots=True)
class MessageView:
    """How one stream's samples are shown.

    Attributes:
        schema: The channel's schema.
        encode: Sample → message bytes in ``schema.message_encoding``.
    """

    schema: ChannelSchema
    encode: Callable[[Sample], bytes]


@cache
def ros_schema(typename: str) -> ChannelSchema:
    """The ``ros2msg`` schema of a ROS 2 type (its definition and those it uses).

    Raises:
        ConversionError: The typestore does not know the type.
    """
    ts = typestore()
    if typename not in ts.fielddefs:
        raise ConversionError(f"unknown ROS 2 type {typename!r}")
    text = ts.generate_msgdef(typename, ros_version=2)[0]
    return ChannelSchema(typename, "ros2msg", text.encode(), "cdr")


def json_schema(name: str, schema: dict[str, Any]) -> ChannelSchema:
    """A JSON channel's schema."""
    return ChannelSchema(name, "jsonschema", json.dumps(schema).encode(), "json")


#: Facts shown for a sample whose payload has no ROS 2 form.
SAMPLE_INFO_SCHEMA = json_schema(
    "embodied_bus/SampleInfo",
    {
        "type": "object",
        "properties": {
            "stream": {"type": "string"},
            "encoding": {"type": "string"},
            "seq": {"type": "integer"},
            "stamp_ns": {"type": "integer"},
            "bucket": {"type": "integer"},
            "size_bytes": {"type": "integer"},
            "frame_id": {"type": "string"},
        },
    },
)


def _sample_info(sample: Sample) -> bytes:
    h = sample.header
    return json.dumps(
        {
            "stream": h.stream,
            "encoding": h.encoding,
            "seq": h.seq,
            "stamp_ns": h.stamp_ns,
            "bucket": h.bucket,
            "size_bytes": len(sample.payload),
            "frame_id": h.frame_id,
        }
    ).encode()


def _passthrough(sample: Sample) -> bytes:
    return bytes(sample.payload)


def _points(sample: Sample) -> bytes:
    h = sample.header
    return array_to_pointcloud2_cdr(decode_npy(sample.payload), frame_id=h.frame_id, stamp_ns=h.stamp_ns)


def _stamp(ts: Any, stamp_ns: int) -> Any:
    return ts.types["builtin_interfaces/msg/Time"](
        sec=stamp_ns // 1_000_000_000, nanosec=stamp_ns % 1_000_000_000
    )


def _ros_header(sample: Sample) -> Any:
    ts = typestore()
    return ts.types["std_msgs/msg/Header"](
        stamp=_stamp(ts, sample.header.stamp_ns), frame_id=sample.header.frame_id
    )


def _navsatfix(sample: Sample) -> bytes:
    fix = np.asarray(decode_npy(sample.payload), dtype=np.float64).reshape(-1)
    if fix.size < 3:
        raise ConversionError(f"a GPS array needs latitude, longitude and altitude; got {fix.size} values")
    ts = typestore()
    status = ts.types["sensor_msgs/msg/NavSatStatus"](status=int(fix[3]) if fix.size > 3 else 0, service=1)
    msg = ts.types["sensor_msgs/msg/NavSatFix"](
        header=_ros_header(sample),
        status=status,
        latitude=float(fix[0]),
        longitude=float(fix[1]),
        altitude=float(fix[2]),
        position_covariance=np.zeros(9, dtype=np.float64),
        position_covariance_type=0,
    )
    return bytes(ts.serialize_cdr(msg, "sensor_msgs/msg/NavSatFix"))


def _imu(sample: Sample) -> bytes:
    v = np.asarray(decode_npy(sample.payload), dtype=np.float64).reshape(-1)
    if v.size != 10:
        raise ConversionError(
            f"an IMU array holds qx, qy, qz, qw, wx, wy, wz, ax, ay, az; got {v.size} values"
        )
    ts = typestore()
    vec = ts.types["geometry_msgs/msg/Vector3"]
    msg = ts.types["sensor_msgs/msg/Imu"](
        header=_ros_header(sample),
        orientation=ts.types["geometry_msgs/msg/Quaternion"](x=v[0], y=v[1], z=v[2], w=v[3]),
        orientation_covariance=np.zeros(9, dtype=np.float64),
        angular_velocity=vec(x=v[4], y=v[5], z=v[6]),
        angular_velocity_covariance=np.zeros(9, dtype=np.float64),
        linear_acceleration=vec(x=v[7], y=v[8], z=v[9]),
        linear_acceleration_covariance=np.zeros(9, dtype=np.float64),
    )
    return bytes(ts.serialize_cdr(msg, "sensor_msgs/msg/Imu"))


def _raw_image(encoding: str) -> Callable[[Sample], bytes] | None:
    """``raw:<ros image encoding>:<H>x<W>`` → Image, or None if the encoding says otherwise."""
    parts = encoding.split(":")
    if len(parts) != 3 or "x" not in parts[2]:
        return None
    image_enc, (rows, _, cols) = parts[1], parts[2].partition("x")
    if not (rows.isdigit() and cols.isdigit()):
        return None
    shape = (int(rows), int(cols))

    def encode(sample: Sample) -> bytes:
        flat = np.frombuffer(sample.payload, dtype=np.uint8)
        if flat.size % (shape[0] * shape[1]):
            raise ConversionError(f"{flat.size} bytes are not a {shape[0]}x{shape[1]} {image_enc} image")
        image = flat.reshape(shape[0], shape[1], -1)
        h = sample.header
        return array_to_image_cdr(image, frame_id=h.frame_id, stamp_ns=h.stamp_ns, encoding=image_enc)

    return encode


def _compressed(fmt: str) -> Callable[[Sample], bytes]:
    def encode(sample: Sample) -> bytes:
        ts = typestore()
        msg = ts.types["sensor_msgs/msg/CompressedImage"](
            header=_ros_header(sample), format=fmt, data=np.frombuffer(sample.payload, dtype=np.uint8)
        )
        return bytes(ts.serialize_cdr(msg, "sensor_msgs/msg/CompressedImage"))

    return encode


#: NumPy payloads by modality: (ROS 2 type, converter).
_NPY: dict[Modality, tuple[str, Callable[[Sample], bytes]]] = {
    Modality.LIDAR: ("sensor_msgs/msg/PointCloud2", _points),
    Modality.GPS: ("sensor_msgs/msg/NavSatFix", _navsatfix),
    Modality.IMU: ("sensor_msgs/msg/Imu", _imu),
}


def view_for(header: Header) -> MessageView:
    """How samples with this header's encoding and modality are shown (never fails: what has no
    ROS 2 form is shown as :data:`SAMPLE_INFO_SCHEMA` facts)."""
    enc = header.encoding
    if enc.startswith("cdr:"):
        try:
            return MessageView(ros_schema(enc[4:]), _passthrough)
        except ConversionError:
            return MessageView(SAMPLE_INFO_SCHEMA, _sample_info)
    if enc == "npy" and header.modality in _NPY:
        typename, encode = _NPY[header.modality]
        return MessageView(ros_schema(typename), encode)
    if enc in ("jpeg", "png"):
        return MessageView(ros_schema("sensor_msgs/msg/CompressedImage"), _compressed(enc))
    if enc.startswith("raw:"):
        image = _raw_image(enc)
        if image is not None:
            return MessageView(ros_schema("sensor_msgs/msg/Image"), image)
    return MessageView(SAMPLE_INFO_SCHEMA, _sample_info)
