"""ROS-free logic shared by the rclpy nodes and the rmw_zenoh bridge.

Header stamps from serialized CDR (no deserialization on the hot path), fused frames as ROS
messages and diagnostics, and the JSON action interface for ROS-side planners. Everything here
works on serialized messages and plain values, so it is tested without ROS.
"""

from __future__ import annotations

import enum
import json
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, TypeVar

from embodied_bus.actions.model import Action, ActionError
from embodied_bus.fusion.frame import MultiModalFrame
from embodied_bus.model.qos import Backpressure
from embodied_bus.ros.config import ActionRoute, FrameRoute, RobotConfig
from embodied_bus.rosmsg.rmw_zenoh import QosProfile, typestore_for

__all__ = [
    "DIAGNOSTICS_TYPE",
    "GoalOutcome",
    "RosMessage",
    "RosTopic",
    "SubmitRequest",
    "bus_backpressure",
    "frame_diagnostics_cdr",
    "frame_messages",
    "frame_topics",
    "goal_outcome",
    "has_header",
    "header_of",
    "outcome_json",
    "parse_submission",
    "resolve_routes",
    "string_cdr",
    "string_from_cdr",
]


@dataclass(frozen=True, slots=True)
class RosMessage:
    """A serialized ROS 2 message bound for a topic."""

    topic: str
    ros_type: str
    cdr: bytes | memoryview
    stamp_ns: int


def bus_backpressure(qos: QosProfile) -> Backpressure:
    """How the bus stream of a ROS topic is published: lossless (``BLOCK``) where the topic is
    reliable, so the bridge adds no loss a reliable ROS publisher did not allow; latest-wins
    (``DROP_OLDEST``) for best-effort sensor data."""
    return Backpressure.BLOCK if qos.reliable else Backpressure.DROP_OLDEST


@lru_cache(maxsize=512)
def has_header(ros_type: str, distro: str = "jazzy") -> bool:
    """True if the type's first field is a ``std_msgs/msg/Header`` (stamp readable from CDR)."""
    store = typestore_for(distro)
    defs = store.fielddefs.get(ros_type)
    if not defs:
        return False
    fields = defs[1]
    return bool(fields) and fields[0][0] == "header" and fields[0][1][1] == "std_msgs/msg/Header"


def header_of(cdr: bytes | memoryview, ros_type: str, distro: str = "jazzy") -> tuple[int, str] | None:
    """``header.stamp`` (ns) and ``header.frame_id`` read straight from CDR, or None if the type
    has no leading header or the buffer cannot hold the header it claims."""
    if len(cdr) < 16 or not has_header(ros_type, distro):
        return None
    fmt = ">iII" if cdr[1] == 0 else "<iII"
    sec, nsec, n = struct.unpack_from(fmt, cdr, 4)
    if nsec >= 1_000_000_000 or 16 + n > len(cdr):
        return None
    frame_id = bytes(cdr[16 : 16 + max(0, n - 1)]).decode(errors="replace")
    return int(sec) * 1_000_000_000 + int(nsec), frame_id


def string_cdr(text: str) -> bytes:
    """A ``std_msgs/msg/String`` as little-endian CDR."""
    raw = text.encode()
    return b"\x00\x01\x00\x00" + struct.pack("<I", len(raw) + 1) + raw + b"\x00"


def string_from_cdr(cdr: bytes | memoryview) -> str:
    """Text of a serialized ``std_msgs/msg/String``.

    Raises:
        ValueError: Not a valid serialized String.
    """
    if len(cdr) < 8:
        raise ValueError("std_msgs/String CDR is shorter than 8 bytes")
    fmt = ">I" if cdr[1] == 0 else "<I"
    (n,) = struct.unpack_from(fmt, cdr, 4)
    if n < 1 or 8 + n > len(cdr):
        raise ValueError(f"std_msgs/String length {n} does not fit the {len(cdr)}-byte message")
    return bytes(cdr[8 : 8 + n - 1]).decode()


def frame_messages(frame: MultiModalFrame, route: FrameRoute) -> list[RosMessage]:
    """The CDR members of a frame as ROS messages on ``<namespace>/<stream>``, original types and
    stamps; members that are not ROS messages (``npy``, ``raw``) are left out."""
    out = []
    for stream, members in frame.members.items():
        for m in members:
            enc = m.sample.header.encoding
            if not enc.startswith("cdr:"):
                continue
            out.append(
                RosMessage(f"{route.namespace}/{stream}", enc[4:], m.sample.payload, m.sample.header.stamp_ns)
            )
    return out


#: The type of every frame route's ``diagnostics`` topic.
DIAGNOSTICS_TYPE = "diagnostic_msgs/msg/DiagnosticArray"


@dataclass(frozen=True, slots=True)
class RosTopic:
    """A ROS topic and its message type."""

    topic: str
    ros_type: str


def frame_topics(config: RobotConfig, route: FrameRoute) -> list[RosTopic]:
    """The ROS topics a frame route publishes that are known before the first frame: the members
    that come from ROS (the fusion spec's streams among ``streams:``, every one without a spec)
    and the diagnostics. A bridge declares them at start, so a subscriber matches before the first
    frame instead of missing what flows during discovery."""
    fused = {s.name for s in config.fusion.streams} if config.fusion is not None else None
    topics = [
        RosTopic(f"{route.namespace}/{r.stream}", r.ros_type)
        for r in config.inbound
        if fused is None or r.stream in fused
    ]
    return [*topics, RosTopic(route.diagnostics, DIAGNOSTICS_TYPE)]


def frame_diagnostics_cdr(
    frame: MultiModalFrame, route: FrameRoute, *, distro: str = "jazzy", hardware_id: str = "embodied_bus"
) -> bytes:
    """Frame statistics as a serialized ``diagnostic_msgs/msg/DiagnosticArray``: level OK for a
    complete frame, WARN for a partial one, with bucket, members, missing streams, skew, late
    count and whether the lateness bound forced it out."""
    store = typestore_for(distro)
    t = store.types
    stamp = frame.reference_stamp_ns
    header = t["std_msgs/msg/Header"](
        stamp=t["builtin_interfaces/msg/Time"](sec=stamp // 1_000_000_000, nanosec=stamp % 1_000_000_000),
        frame_id="",
    )
    kv = t["diagnostic_msgs/msg/KeyValue"]
    values = [
        kv(key="bucket", value=str(frame.bucket)),
        kv(key="members", value=",".join(sorted(frame.members))),
        kv(key="missing", value=",".join(frame.missing)),
        kv(key="max_skew_ms", value="" if frame.max_skew_ns is None else f"{frame.max_skew_ns / 1e6:.3f}"),
        kv(key="waited_on", value=frame.waited_on or ""),
        kv(key="late_count", value=str(frame.late_count)),
        kv(key="forced", value=str(frame.forced).lower()),
        kv(key="pane", value=str(frame.pane)),
    ]
    status = t["diagnostic_msgs/msg/DiagnosticStatus"](
        level=0 if frame.complete else 1,
        name=f"embodied_bus: {route.stream}",
        message="complete" if frame.complete else f"partial, missing {', '.join(frame.missing)}",
        hardware_id=hardware_id,
        values=values,
    )
    msg = t["diagnostic_msgs/msg/DiagnosticArray"](header=header, status=[status])
    return bytes(store.serialize_cdr(msg, "diagnostic_msgs/msg/DiagnosticArray"))


@dataclass(frozen=True, slots=True)
class SubmitRequest:
    """An action submission from a ROS-side planner."""

    kind: str
    payload: Any
    priority: int = 0
    deadline_s: float | None = None
    idempotency_key: str | None = None
    request_id: str | None = None


_SUBMIT_KEYS = {"kind", "payload", "priority", "deadline_s", "idempotency_key", "request_id"}


def parse_submission(text: str) -> SubmitRequest:
    """Parse the JSON a ROS-side planner publishes on the submit topic::

        {"kind": "navigate_to", "payload": {...}, "priority": 5, "deadline_s": 30,
         "idempotency_key": "goal-17", "request_id": "my-correlation-id"}

    Raises:
        ActionError: Not JSON, not an object, unknown keys, or invalid fields (the message says which).
    """
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise ActionError(f"action submission is not valid JSON: {err}") from None
    if not isinstance(doc, dict):
        raise ActionError("action submission must be a JSON object")
    unknown = set(doc) - _SUBMIT_KEYS
    if unknown:
        raise ActionError(f"action submission: unknown key(s) {sorted(unknown)}")
    kind = doc.get("kind")
    if not isinstance(kind, str) or not kind:
        raise ActionError("action submission: 'kind' must be a non-empty string")
    priority = doc.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ActionError(f"action submission: 'priority' must be an integer 0-9, got {priority!r}")
    deadline = doc.get("deadline_s")
    if deadline is not None and (
        isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or deadline <= 0
    ):
        raise ActionError(f"action submission: 'deadline_s' must be seconds > 0, got {deadline!r}")
    for key in ("idempotency_key", "request_id"):
        if doc.get(key) is not None and not isinstance(doc[key], str):
            raise ActionError(f"action submission: {key!r} must be a string")
    req = SubmitRequest(
        kind, doc.get("payload"), priority, deadline, doc.get("idempotency_key"), doc.get("request_id")
    )
    Action(kind, req.payload, priority=priority, idempotency_key=req.idempotency_key).validate()
    return req


def outcome_json(
    *,
    request_id: str | None,
    action: Action | None = None,
    error: str | None = None,
    status: str | None = None,
) -> str:
    """The JSON line published on the results topic: the action's id, kind, status and result
    (or the error that rejected the submission)."""
    doc: dict[str, Any] = {"request_id": request_id, "stamp_ns": time.time_ns()}
    if action is not None:
        doc.update(id=action.id, kind=action.kind, status=status or action.status.value)
        if action.result is not None:
            doc["result"] = action.result
        if action.attempts and action.attempts[-1].reason:
            doc["reason"] = action.attempts[-1].reason
    if error is not None:
        doc.update(status=status or "rejected", error=error)
    return json.dumps(doc)


class GoalOutcome(str, enum.Enum):
    """What the end of a ROS 2 action goal means for the queue."""

    OK = "ok"  # succeeded: ack with the result
    RETRY = "retry"  # aborted or unknown: nack, the queue retries (on another executor if one exists)
    CANCELED = "canceled"  # canceled: the queue's cancel went through


#: ``action_msgs/msg/GoalStatus`` values.
GOAL_STATUS = {
    0: "unknown",
    1: "accepted",
    2: "executing",
    3: "canceling",
    4: "succeeded",
    5: "canceled",
    6: "aborted",
}


def goal_outcome(status: int) -> GoalOutcome:
    """Map a terminal ``GoalStatus`` onto the queue: SUCCEEDED acks, CANCELED ends a cancel,
    ABORTED (and anything unexpected) nacks so the action is retried."""
    if status == 4:
        return GoalOutcome.OK
    if status == 5:
        return GoalOutcome.CANCELED
    return GoalOutcome.RETRY


_H = TypeVar("_H")


def resolve_routes(
    routes: tuple[ActionRoute, ...] | list[ActionRoute], make: Callable[[ActionRoute], _H]
) -> tuple[list[tuple[ActionRoute, _H]], list[str]]:
    """Build a handler per action route; a route whose action type cannot be loaded (package not
    installed, misspelt type) is left out and reported by kind and type, the others serve.

    Returns:
        The routes with their handlers, and one message per route left out.
    """
    ok: list[tuple[ActionRoute, _H]] = []
    problems: list[str] = []
    for route in routes:
        try:
            ok.append((route, make(route)))
        except (ImportError, AttributeError, ValueError, LookupError) as err:
            problems.append(
                f"action route '{route.kind}' left out: {route.action_type} cannot be loaded "
                f"({type(err).__name__}: {err}); install its package or fix the type"
            )
    return ok, problems
