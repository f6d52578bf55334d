"""A stand-in for a ROS 2 node on rmw_zenoh, written from the wire facts with raw zenoh-python,
xxhash and rosbags only (no embodied_bus code), so the bridge is checked against an independent
implementation of the format."""

from __future__ import annotations

import json
import struct
import threading
import time
from typing import Any

import xxhash
import zenoh
from rosbags.typesys import Stores, get_typestore

STORE = get_typestore(Stores.ROS2_JAZZY)


def dds(ros_type: str) -> str:
    pkg, sub, name = ros_type.split("/")
    return f"{pkg}::{sub}::dds_::{name}_"


def key(topic: str, ros_type: str, domain: int = 0) -> str:
    return f"{domain}/{topic.strip('/')}/{dds(ros_type)}/{STORE.hash_rihs01(ros_type)}"


class RmwNode:
    """Publishes and subscribes in rmw_zenoh's format over its own peer session."""

    def __init__(self, router: str, name: str = "fake_sensors") -> None:
        conf = zenoh.Config()
        conf.insert_json5("mode", '"peer"')
        conf.insert_json5("scouting/multicast/enabled", "false")
        conf.insert_json5("connect/endpoints", json.dumps([router]))
        self.session = zenoh.open(conf)
        self.zid = str(self.session.zid())
        self.name = name
        self.pubs: dict[str, Any] = {}
        self._seq: dict[str, int] = {}
        self._tokens: list[Any] = [
            self.session.liveliness().declare_token(f"@ros2_lv/0/{self.zid}/0/0/NN/%/%/{name}")
        ]
        self.received: dict[str, list[tuple[bytes, bytes | None]]] = {}
        self.lock = threading.Lock()

    def publish(self, topic: str, ros_type: str, cdr: bytes, *, attachment: bool = True) -> None:
        k = key(topic, ros_type)
        if k not in self.pubs:
            self.pubs[k] = self.session.declare_publisher(k)
            token = (
                f"@ros2_lv/0/{self.zid}/0/{len(self.pubs)}/MP/%/%/{self.name}/"
                f"{topic.replace('/', '%')}/{dds(ros_type)}/{STORE.hash_rihs01(ros_type)}/2::,5:,:,:,,"
            )
            self._tokens.append(self.session.liveliness().declare_token(token))
            self._seq[k] = 0
        self._seq[k] += 1
        gid = xxhash.xxh3_128(k.encode()).digest()[::-1]
        att = struct.pack("<qqB", self._seq[k], time.time_ns(), 16) + gid if attachment else None
        self.pubs[k].put(cdr, attachment=att)

    def subscribe(self, key_expr: str) -> None:
        def on_sample(sample: zenoh.Sample) -> None:
            att = sample.attachment.to_bytes() if sample.attachment is not None else None
            with self.lock:
                self.received.setdefault(str(sample.key_expr), []).append((sample.payload.to_bytes(), att))

        self.pubs["sub:" + key_expr] = self.session.declare_subscriber(key_expr, on_sample)

    def graph(self) -> list[str]:
        """Every liveliness token of domain 0 (what rmw_zenoh's graph cache sees)."""
        return [
            str(r.ok.key_expr) for r in self.session.liveliness().get("@ros2_lv/0/**", timeout=2.0) if r.ok
        ]

    def close(self) -> None:
        for t in self._tokens:
            t.undeclare()
        self.session.close()


def stamped(ros_type: str, stamp_ns: int, frame_id: str, **fields: Any) -> bytes:
    """A serialized message of a type whose first field is a header."""
    t = STORE.types
    header = t["std_msgs/msg/Header"](
        stamp=t["builtin_interfaces/msg/Time"](sec=stamp_ns // 10**9, nanosec=stamp_ns % 10**9),
        frame_id=frame_id,
    )
    return bytes(STORE.serialize_cdr(t[ros_type](header=header, **fields), ros_type))
