"""What an uplink forwards: routes per stream (class, rates), the spool, what comes down.

The ``uplink:`` section of the robot YAML::

    uplink:
      to: pulsar://fleet.example.com:6650?listener=robots&token_file=/etc/robot.jwt
      robot: r17                     # the robot's namespace on the fleet bus
      spool: /var/lib/embodied_bus/uplink.db
      spool_limit_mb: 512
      streams:
        events:       {class: 0}                       # every sample, first
        frames/fused: {class: 1}
        gps:          {class: 1}
        imu:          {class: 2, rate_hz: 50, down_rate_hz: 5}
        lidar/top:    {class: 3, rate_hz: 2, down_rate_hz: 0, lossless: false}
      state_down: [mission]
      actions_down: [navigate_to, dock]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from embodied_bus.errors import BusConfigError, HeaderError
from embodied_bus.model.documents import convert_document
from embodied_bus.model.header import validate_stream_name

__all__ = ["Route", "RouteDocument", "UplinkConfig", "UplinkDocument", "uplink_config_from_dict"]

#: Spool size unless told, MiB.
DEFAULT_SPOOL_LIMIT_MB = 256.0
#: The link counts as degraded while the oldest waiting sample is older than this, seconds.
DEFAULT_DEGRADED_AFTER_S = 2.0


@dataclass(frozen=True, slots=True)
class Route:
    """How one stream crosses the link.

    Attributes:
        stream: Stream name (the same on both sides).
        cls: Class: 0 goes first; when the spool is full the highest class loses samples first.
        rate_hz: Forward at most this rate (None: every sample), by sensor stamp.
        down_rate_hz: The rate while the link is degraded (None: ``rate_hz``; 0: none then).
        lossless: Read the robot's stream without dropping (else the newest samples win when
            the uplink falls behind).
    """

    stream: str
    cls: int = 1
    rate_hz: float | None = None
    down_rate_hz: float | None = None
    lossless: bool = True


@dataclass(frozen=True, slots=True)
class UplinkConfig:
    """One robot's uplink.

    Attributes:
        robot: The robot's namespace on the fleet bus.
        routes: The streams forwarded up.
        spool: Path of the store-and-forward file.
        spool_limit_bytes: Its size limit.
        state_down: State tables mirrored from the fleet to the robot.
        actions_down: Action kinds taken from the fleet queue and run by the robot's queue.
        degraded_after_s: The link counts as degraded while the oldest waiting sample is this old.
    """

    robot: str
    routes: tuple[Route, ...]
    spool: Path
    spool_limit_bytes: int = int(DEFAULT_SPOOL_LIMIT_MB * 2**20)
    state_down: tuple[str, ...] = ()
    actions_down: tuple[str, ...] = ()
    degraded_after_s: float = DEFAULT_DEGRADED_AFTER_S
    to: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def route(self, stream: str) -> Route | None:
        return next((r for r in self.routes if r.stream == stream), None)


class RouteDocument(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, rename={"cls": "class"}):
    """``uplink.streams.<stream>``.

    Attributes:
        cls: Class, 0 first; the highest class loses samples first when the spool is full.
        rate_hz: Forward at most this rate, by sensor stamp (default: every sample).
        down_rate_hz: The rate while the link is degraded (default: ``rate_hz``; 0: none).
        lossless: Read the robot's stream without dropping samples.
    """

    cls: int = 1
    rate_hz: float | None = None
    down_rate_hz: float | None = None
    lossless: bool = True


class UplinkDocument(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``uplink``: this robot's link to the fleet.

    Attributes:
        to: The fleet bus URL (``--to`` wins).
        robot: The robot's namespace on the fleet bus (``--robot`` wins; default: its own).
        spool: The store-and-forward file (default: ``uplink-<robot>.db`` in the working directory).
        spool_limit_mb: The spool's size limit, MiB.
        degraded_after_s: The link counts as degraded while the oldest waiting sample is this old, s.
        streams: Stream name → how it crosses (``class``, ``rate_hz``, ``down_rate_hz``, ``lossless``).
        state_down: State tables mirrored from the fleet down to the robot.
        actions_down: Action kinds the robot runs from the fleet's queue.
    """

    to: str = ""
    robot: str = ""
    spool: str = ""
    spool_limit_mb: float = DEFAULT_SPOOL_LIMIT_MB
    degraded_after_s: float = DEFAULT_DEGRADED_AFTER_S
    streams: dict[str, Any] = msgspec.field(default_factory=dict)
    state_down: list[str] = msgspec.field(default_factory=list)
    actions_down: list[str] = msgspec.field(default_factory=list)


def _rate(where: str, value: float | None) -> None:
    if value is not None and (not math.isfinite(value) or value < 0):
        raise BusConfigError(f"{where}: must be a rate in Hz >= 0, got {value}")


def _route(stream: str, doc: Any, where: str) -> Route:
    try:
        validate_stream_name(stream)
    except HeaderError as err:
        raise BusConfigError(f"{where}: {err}") from None
    d = convert_document(doc if doc is not None else {}, RouteDocument, where, BusConfigError)
    if d.cls < 0:
        raise BusConfigError(f"{where}.class: must be 0 or more, got {d.cls}")
    _rate(f"{where}.rate_hz", d.rate_hz)
    if d.rate_hz == 0:
        raise BusConfigError(f"{where}.rate_hz: 0 would forward nothing; leave the stream out instead")
    _rate(f"{where}.down_rate_hz", d.down_rate_hz)
    return Route(stream, d.cls, d.rate_hz, d.down_rate_hz, d.lossless)


def uplink_config_from_dict(
    doc: Any, *, where: str = "uplink", robot: str = "", to: str = "", spool: str = ""
) -> UplinkConfig:
    """Check an ``uplink`` section; ``robot``, ``to`` and ``spool`` (command-line values) win.

    Raises:
        BusConfigError: A key is unknown, missing or wrong (named).
    """
    d = convert_document(doc if doc is not None else {}, UplinkDocument, where, BusConfigError)
    if not isinstance(d.streams, dict):
        raise BusConfigError(f"{where}.streams: expected a mapping of stream names")
    routes = tuple(_route(s, v, f"{where}.streams.{s}") for s, v in d.streams.items())
    robot = robot or d.robot
    if not robot:
        raise BusConfigError(f"{where}.robot: missing (or pass --robot)")
    if d.spool_limit_mb <= 0:
        raise BusConfigError(f"{where}.spool_limit_mb: must be positive, got {d.spool_limit_mb}")
    if d.degraded_after_s <= 0:
        raise BusConfigError(f"{where}.degraded_after_s: must be positive, got {d.degraded_after_s}")
    return UplinkConfig(
        robot=robot,
        routes=routes,
        spool=Path(spool or d.spool or f"uplink-{robot}.db"),
        spool_limit_bytes=int(d.spool_limit_mb * 2**20),
        state_down=tuple(d.state_down),
        actions_down=tuple(d.actions_down),
        degraded_after_s=d.degraded_after_s,
        to=to or d.to,
    )
