"""ROS 2 interfaces (``.msg``, ``.srv``, ``.action``) a user adds, with the RIHS01 type hashes
rmw_zenoh keys them by, computed from the definitions the way rosidl does.

Definitions are looked up as ``<dir>/<pkg>/<msg|srv|action>/<Name>.<ext>`` in the configured
directories, then in every ``$AMENT_PREFIX_PATH`` entry's ``share/`` (where ROS 2 installs
them), then in the ones shipped with embodied_bus. Types the distribution's typestore already
holds (``sensor_msgs``, ``geometry_msgs`` …) need no file.

A service ``pkg/srv/X`` becomes ``X_Request``, ``X_Response``, ``X_Event`` and ``X``; an action
``pkg/action/A`` becomes ``A_Goal``, ``A_Result``, ``A_Feedback``, the services ``A_SendGoal``
and ``A_GetResult``, and ``A_FeedbackMessage``, with the fields rcl_action gives them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rosbags.interfaces import Nodetype
from rosbags.typesys import get_types_from_msg
from rosbags.typesys.store import Typestore

from embodied_bus.rosmsg.rmw_zenoh import RmwZenohError, typestore_for

__all__ = [
    "CANCEL_GOAL",
    "GOAL_STATUS_ARRAY",
    "ActionTypes",
    "InterfaceError",
    "Interfaces",
    "ServiceTypes",
    "shipped_definitions",
    "to_plain",
]

#: Every action's cancel service.
CANCEL_GOAL = "action_msgs/srv/CancelGoal"
#: Every action's status topic type.
GOAL_STATUS_ARRAY = "action_msgs/msg/GoalStatusArray"

_UUID = (Nodetype.NAME, "unique_identifier_msgs/msg/UUID")
_TIME = (Nodetype.NAME, "builtin_interfaces/msg/Time")
_SEPARATOR = re.compile(r"^\s*---\s*$", re.MULTILINE)
_DTYPES = {
    "bool": np.bool_,
    "byte": np.uint8,
    "char": np.uint8,
    "int8": np.int8,
    "uint8": np.uint8,
    "int16": np.int16,
    "uint16": np.uint16,
    "int32": np.int32,
    "uint32": np.uint32,
    "int64": np.int64,
    "uint64": np.uint64,
    "float32": np.float32,
    "float64": np.float64,
}


class InterfaceError(RmwZenohError, LookupError):
    """A ROS 2 interface cannot be found, parsed or filled; the message names the type."""


def shipped_definitions() -> Path:
    """The directory of definitions shipped with embodied_bus."""
    return Path(__file__).with_name("definitions")


@dataclass(frozen=True, slots=True)
class ServiceTypes:
    """A service: its request and response message types and its RIHS01 hash."""

    name: str
    request: str
    response: str
    hash: str


@dataclass(frozen=True, slots=True)
class ActionTypes:
    """An action: the message and service types rcl_action derives from it, with hashes."""

    name: str
    goal: str
    result: str
    feedback: str
    send_goal: ServiceTypes
    get_result: ServiceTypes
    feedback_message: str
    feedback_message_hash: str


def _ament_share_dirs() -> list[Path]:
    return [Path(p) / "share" for p in os.environ.get("AMENT_PREFIX_PATH", "").split(os.pathsep) if p]


def _split_type(ros_type: str) -> tuple[str, str, str]:
    parts = ros_type.split("/")
    if len(parts) != 3 or parts[1] not in ("msg", "srv", "action") or not all(parts):
        raise InterfaceError(f"ROS type {ros_type!r}: expected pkg/msg/Name, pkg/srv/Name or pkg/action/Name")
    return parts[0], parts[1], parts[2]


class Interfaces:
    """The types of one ROS 2 distribution plus the definitions found on a search path.

    Args:
        distro: Distribution whose built-in types are used (jazzy or newer).
        search_path: Directories laid out ``<pkg>/<msg|srv|action>/<Name>.<ext>``, searched
            before ``$AMENT_PREFIX_PATH`` and the shipped definitions.
    """

    def __init__(self, distro: str = "jazzy", search_path: Sequence[str | Path] = ()) -> None:
        base = typestore_for(distro)
        self.distro = distro
        self.store = Typestore()
        self.store.fielddefs.update(base.fielddefs)
        self.store.types.update(base.types)
        self._patch_char_fields()
        self.search_path = [Path(p) for p in search_path] + _ament_share_dirs() + [shipped_definitions()]
        self._services: dict[str, ServiceTypes] = {}
        self._actions: dict[str, ActionTypes] = {}

    def _patch_char_fields(self) -> None:
        """rosidl hashes ``char`` as uint8; rosbags' typestores spell it ``char``."""
        patched = {}
        for name, (consts, fields) in self.store.fielddefs.items():
            if any("'char'" in repr(d) for _, d in fields):
                patched[name] = (consts, [(n, _char_to_uint8(d)) for n, d in fields])
        self.store.fielddefs.update(patched)

    def find(self, ros_type: str) -> Path | None:
        """The definition file of ``ros_type`` on the search path, or None."""
        pkg, kind, name = _split_type(ros_type)
        for root in self.search_path:
            path = root / pkg / kind / f"{name}.{kind}"
            if path.is_file():
                return path
        return None

    def _read(self, ros_type: str) -> str:
        path = self.find(ros_type)
        if path is None:
            where = ", ".join(str(p) for p in self.search_path)
            raise InterfaceError(
                f"no definition of {ros_type} (looked for <pkg>/<kind>/<Name>.<kind> under {where}); "
                "add its directory to ros.interfaces or install its ROS 2 package"
            )
        return path.read_text()

    def _parse(self, text: str, ros_type: str) -> dict[str, Any]:
        """One message definition registered as ``ros_type``; relative names resolve to the
        package's ``msg/`` as rosidl resolves them."""
        pkg, _, name = _split_type(ros_type)
        try:
            parsed = get_types_from_msg(text, f"{pkg}/msg/{name}")
        except Exception as err:
            raise InterfaceError(f"cannot parse the definition of {ros_type}: {err}") from err
        return {ros_type: parsed[f"{pkg}/msg/{name}"]}

    def _register(self, defs: dict[str, Any]) -> None:
        self.store.register(defs)
        for _, fields in defs.values():
            for _, desc in fields:
                self._require(desc)

    def _require(self, desc: Any) -> None:
        node, args = desc
        if node in (Nodetype.ARRAY, Nodetype.SEQUENCE):
            self._require(args[0])
        elif node == Nodetype.NAME:
            self.message(args)

    def message(self, ros_type: str) -> str:
        """Make sure a message type and everything it references is known; returns its name.

        Raises:
            InterfaceError: It, or a type it references, has no definition or does not parse.
        """
        if ros_type not in self.store.fielddefs:
            if _split_type(ros_type)[1] != "msg":
                raise InterfaceError(f"{ros_type} is not a message type (pkg/msg/Name)")
            self._register(self._parse(self._read(ros_type), ros_type))
        return ros_type

    def hash(self, ros_type: str) -> str:
        """RIHS01 hash of a message, service or action type (services and actions by their
        whole description, as rmw_zenoh keys them)."""
        kind = _split_type(ros_type)[1]
        if ros_type in self._services:
            return self._services[ros_type].hash
        if ros_type in self.store.fielddefs:  # a message, or a part of a service or action
            return str(self.store.hash_rihs01(ros_type))
        if kind == "srv":
            return self.service(ros_type).hash
        if kind == "action":
            self.action(ros_type)
        else:
            self.message(ros_type)
        return str(self.store.hash_rihs01(ros_type))

    def _service_defs(self, name: str, request: list[Any], response: list[Any]) -> dict[str, Any]:
        req, resp, event = f"{name}_Request", f"{name}_Response", f"{name}_Event"
        return {
            req: ([], request),
            resp: ([], response),
            event: (
                [],
                [
                    ("info", (Nodetype.NAME, "service_msgs/msg/ServiceEventInfo")),
                    ("request", (Nodetype.SEQUENCE, ((Nodetype.NAME, req), 1))),
                    ("response", (Nodetype.SEQUENCE, ((Nodetype.NAME, resp), 1))),
                ],
            ),
            name: (
                [],
                [
                    ("request_message", (Nodetype.NAME, req)),
                    ("response_message", (Nodetype.NAME, resp)),
                    ("event_message", (Nodetype.NAME, event)),
                ],
            ),
        }

    def _service_types(self, name: str) -> ServiceTypes:
        return ServiceTypes(name, f"{name}_Request", f"{name}_Response", str(self.store.hash_rihs01(name)))

    def _sections(self, ros_type: str, kind: str, names: tuple[str, ...]) -> list[str]:
        """The ``---``-separated sections of a ``.srv`` or ``.action`` definition.

        Raises:
            InterfaceError: Not a ``kind`` type, no definition, or the wrong number of sections.
        """
        if _split_type(ros_type)[1] != kind:
            raise InterfaceError(f"{ros_type} is not a {kind} type (pkg/{kind}/Name)")
        parts = _SEPARATOR.split(self._read(ros_type))
        if len(parts) != len(names):
            listed = ", ".join(names[:-1]) + " and " + names[-1]
            raise InterfaceError(f"{ros_type}: a .{kind} has {listed} separated by ---")
        return parts

    def service(self, ros_type: str) -> ServiceTypes:
        """A service type from its ``.srv`` definition, with its hash.

        Raises:
            InterfaceError: No definition, a part that does not parse, or a missing reference.
        """
        if ros_type in self._services:
            return self._services[ros_type]
        parts = self._sections(ros_type, "srv", ("a request", "a response"))
        req = self._parse(parts[0], f"{ros_type}_Request")[f"{ros_type}_Request"][1]
        resp = self._parse(parts[1], f"{ros_type}_Response")[f"{ros_type}_Response"][1]
        self._register(self._service_defs(ros_type, req, resp))
        self._services[ros_type] = types = self._service_types(ros_type)
        return types

    def action(self, ros_type: str) -> ActionTypes:
        """An action type from its ``.action`` definition, with the hashes of its services and
        feedback message.

        Raises:
            InterfaceError: No definition, a part that does not parse, or a missing reference.
        """
        if ros_type in self._actions:
            return self._actions[ros_type]
        parts = self._sections(ros_type, "action", ("a goal", "a result", "a feedback"))
        goal, result, feedback = (f"{ros_type}_{p}" for p in ("Goal", "Result", "Feedback"))
        defs: dict[str, Any] = {}
        for text, name in zip(parts, (goal, result, feedback), strict=True):
            defs.update(self._parse(text, name))
        send_goal, get_result = f"{ros_type}_SendGoal", f"{ros_type}_GetResult"
        defs.update(
            self._service_defs(
                send_goal,
                [("goal_id", _UUID), ("goal", (Nodetype.NAME, goal))],
                [("accepted", (Nodetype.BASE, ("bool", 0))), ("stamp", _TIME)],
            )
        )
        defs.update(
            self._service_defs(
                get_result,
                [("goal_id", _UUID)],
                [("status", (Nodetype.BASE, ("int8", 0))), ("result", (Nodetype.NAME, result))],
            )
        )
        fb_msg = f"{ros_type}_FeedbackMessage"
        defs[fb_msg] = ([], [("goal_id", _UUID), ("feedback", (Nodetype.NAME, feedback))])
        defs[ros_type] = (
            [],
            [
                ("goal", (Nodetype.NAME, goal)),
                ("result", (Nodetype.NAME, result)),
                ("feedback", (Nodetype.NAME, feedback)),
                ("send_goal_service", (Nodetype.NAME, send_goal)),
                ("get_result_service", (Nodetype.NAME, get_result)),
                ("feedback_message", (Nodetype.NAME, fb_msg)),
            ],
        )
        self._register(defs)
        types = ActionTypes(
            ros_type,
            goal,
            result,
            feedback,
            self._service_types(send_goal),
            self._service_types(get_result),
            fb_msg,
            str(self.store.hash_rihs01(fb_msg)),
        )
        self._actions[ros_type] = types
        return types

    # -- values ---------------------------------------------------------------------------

    def build(self, ros_type: str, values: Mapping[str, Any] | None = None) -> Any:
        """A message of ``ros_type`` with ``values`` (nested mappings and lists, as JSON gives
        them) and every other field at its default.

        Raises:
            InterfaceError: An unknown field or a value of the wrong shape, named by its path.
        """
        if ros_type not in self.store.fielddefs:
            self.message(ros_type)
        return self._build(ros_type, values or {}, ros_type)

    def _build(self, ros_type: str, values: Mapping[str, Any], path: str) -> Any:
        if not isinstance(values, Mapping):
            raise InterfaceError(f"{path}: expected an object for {ros_type}, got {type(values).__name__}")
        _, fields = self.store.fielddefs[ros_type]
        names = {n for n, _ in fields}
        unknown = set(values) - names
        if unknown:
            raise InterfaceError(
                f"{path}: {ros_type} has no field(s) {sorted(unknown)}; it has {sorted(names)}"
            )
        kwargs = {}
        for name, desc in fields:
            where = f"{path}.{name}"
            kwargs[name] = self._value(desc, values[name], where) if name in values else self._default(desc)
        return self.store.types[ros_type](**kwargs)

    def _default(self, desc: Any) -> Any:
        node, args = desc
        if node == Nodetype.BASE:
            return "" if args[0] == "string" else (False if args[0] == "bool" else 0)
        if node == Nodetype.NAME:
            return self._build(args, {}, args)
        elem, count = args
        if elem[0] == Nodetype.BASE and elem[1][0] in _DTYPES:
            return np.zeros(count if node == Nodetype.ARRAY else 0, dtype=_DTYPES[elem[1][0]])
        return [self._default(elem) for _ in range(count if node == Nodetype.ARRAY else 0)]

    def _value(self, desc: Any, value: Any, path: str) -> Any:
        node, args = desc
        try:
            if node == Nodetype.BASE:
                return _scalar(args[0], value)
            if node == Nodetype.NAME:
                return self._build(args, value, path)
            elem, count = args
            if not isinstance(value, (list, tuple, np.ndarray)):
                raise TypeError(f"expected a list, got {type(value).__name__}")
            if node == Nodetype.ARRAY and len(value) != count:
                raise ValueError(f"expected {count} elements, got {len(value)}")
            if node == Nodetype.SEQUENCE and count and len(value) > count:
                raise ValueError(f"at most {count} elements, got {len(value)}")
            if elem[0] == Nodetype.BASE and elem[1][0] in _DTYPES:
                return np.asarray([_scalar(elem[1][0], v) for v in value], dtype=_DTYPES[elem[1][0]])
            return [self._value(elem, v, f"{path}[{i}]") for i, v in enumerate(value)]
        except (TypeError, ValueError, OverflowError) as err:
            raise InterfaceError(f"{path}: {err}") from None

    def serialize(self, ros_type: str, values: Mapping[str, Any] | None = None) -> bytes:
        """``values`` as little-endian CDR of ``ros_type`` (see :meth:`build`)."""
        return bytes(self.store.serialize_cdr(self.build(ros_type, values), ros_type))

    def deserialize(self, ros_type: str, cdr: bytes | memoryview) -> Any:
        """A message object from CDR.

        Raises:
            InterfaceError: The bytes are not a valid ``ros_type``.
        """
        try:
            return self.store.deserialize_cdr(bytes(cdr), ros_type)
        except Exception as err:
            raise InterfaceError(f"malformed {ros_type}: {err}") from None


def _char_to_uint8(desc: Any) -> Any:
    node, args = desc
    if node == Nodetype.BASE and args[0] == "char":
        return (node, ("uint8", args[1]))
    if node in (Nodetype.ARRAY, Nodetype.SEQUENCE):
        return (node, (_char_to_uint8(args[0]), args[1]))
    return desc


def _scalar(kind: str, value: Any) -> Any:
    if kind == "string":
        if not isinstance(value, str):
            raise TypeError(f"expected a string, got {type(value).__name__}")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise TypeError(f"expected true or false, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"expected a number, got {value!r}")
    if kind.startswith("float"):
        return float(value)
    if float(value) != int(value):
        raise ValueError(f"expected an integer, got {value!r}")
    info = np.iinfo(_DTYPES[kind])
    if not info.min <= int(value) <= info.max:
        raise ValueError(f"{value} is outside {kind}")
    return int(value)


def to_plain(value: Any) -> Any:
    """A message (or any part of one) as plain JSON-compatible values."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    fields: Iterable[str] | None = getattr(value, "__dataclass_fields__", None)
    if fields is not None:
        return {k: to_plain(getattr(value, k)) for k in fields if k != "__msgtype__"}
    return value
