"""The single-pass ROS 1 → CDR converter against rosbags, on every ROS 1 recording we have."""

from __future__ import annotations

import struct
from collections import defaultdict

import pytest
from rosbags.highlevel import AnyReader

from embodied_bus.rosmsg import typestore
from embodied_bus.rosmsg.ros1_cdr import compile_ros1_to_cdr
from embodied_bus.rosmsg.types import normalize_msgtype

from recordings import RECORDINGS

ROS1_BAGS = sorted(RECORDINGS.glob("*/*.bag"))


def _messages(bag: object) -> dict[str, list[bytes]]:
    out: dict[str, list[bytes]] = defaultdict(list)
    with AnyReader([bag], default_typestore=typestore()) as r:  # type: ignore[list-item]
        for c, _, raw in r.messages():
            if len(out[c.msgtype]) < 300:
                out[c.msgtype].append(bytes(raw))
    return out


@pytest.mark.parametrize("bag", ROS1_BAGS, ids=lambda p: p.name)
def test_compiled_converters_give_rosbags_bytes_for_every_message_of_every_ros1_recording(
    bag: object,
) -> None:
    store = typestore()
    compiled = 0
    for msgtype, raws in _messages(bag).items():
        name = normalize_msgtype(msgtype)
        if name not in store.fielddefs:
            continue
        convert = compile_ros1_to_cdr(store, name)
        if convert is None:
            continue
        compiled += 1
        for raw in raws:
            assert convert(raw) == bytes(store.ros1_to_cdr(raw, name)), msgtype
    assert compiled, "no type of this recording was compiled"


def test_there_are_ros1_recordings_to_check() -> None:
    assert len(ROS1_BAGS) >= 3


def test_truncated_or_oversized_input_raises_instead_of_converting() -> None:
    store = typestore()
    convert = compile_ros1_to_cdr(store, "sensor_msgs/msg/Imu")
    assert convert is not None
    frame = b"imu_link"
    raw = struct.pack("<IiII", 7, 12, 34, len(frame)) + frame + bytes(37 * 8)
    assert convert(raw) == bytes(store.ros1_to_cdr(raw, "sensor_msgs/msg/Imu"))
    with pytest.raises((ValueError, struct.error)):
        convert(raw[:-8])
    with pytest.raises(ValueError, match="bytes"):
        convert(raw + b"\0")


def test_types_with_sequences_of_messages_are_left_to_rosbags() -> None:
    assert compile_ros1_to_cdr(typestore(), "sensor_msgs/msg/PointCloud2") is None
    assert compile_ros1_to_cdr(typestore(), "no_such/msg/Type") is None
