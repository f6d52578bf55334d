"""Topics chosen by regular expression, with types from the ROS graph.

Instead of listing every topic with its type (``streams:`` of the robot YAML), a robot can say
which topics to bridge with ``discover:``; the bridge watches the graph and bridges each topic
some node publishes whose name matches ``allow`` and not ``deny``, with the type (and type hash)
its publisher announces. Types with a modality (clouds, images, IMU, GNSS, scans) become sensor
streams of that modality; every other type, custom ones included, crosses as its CDR bytes.

.. code-block:: yaml

    discover:
      allow: ["^/sensors/", "^/tf$"]   # searched in the absolute topic name; default: any
      deny: ["/debug/"]                # besides ROS's own (/rosout, /parameter_events, actions)
      stream_prefix: ros/              # stream = prefix + topic without its leading "/"
      qos: null                        # null: the publisher's reliability and durability
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

from embodied_bus.errors import BusConfigError
from embodied_bus.model.header import STREAM_NAME_RE
from embodied_bus.rosmsg.rmw_zenoh import QosProfile, Reliability, RmwZenohError

__all__ = ["BUILTIN_DENY", "DiscoverDocument", "TopicSelection"]

#: Topics never bridged by discovery: ROS's own logging, parameters and action internals, and
#: the bridge's action topics.
BUILTIN_DENY = (r"^/rosout$", r"/parameter_events$", r"/_action/", r"^/embodied_bus/")


@dataclass(frozen=True, slots=True)
class TopicSelection:
    """Which discovered topics the bridge takes from ROS, and as which streams.

    Attributes:
        allow: A topic is taken if one of these matches (``re.search``); empty: every topic.
        deny: ...unless one of these matches (the built-in ones included).
        stream_prefix: Bus stream name = prefix + the topic without its leading ``/``.
        qos: QoS of the bridge's subscriptions; None: follow each publisher (reliable ones are
            taken reliably and never dropped by the bus, best-effort ones as sensor data).
    """

    allow: tuple[re.Pattern[str], ...] = ()
    deny: tuple[re.Pattern[str], ...] = tuple(re.compile(p) for p in BUILTIN_DENY)
    stream_prefix: str = ""
    qos: QosProfile | None = None

    def admits(self, topic: str) -> bool:
        """Whether ``topic`` (absolute) is to be bridged."""
        if self.allow and not any(p.search(topic) for p in self.allow):
            return False
        return not any(p.search(topic) for p in self.deny)

    def stream_of(self, topic: str) -> str | None:
        """The bus stream for ``topic``, or None if its name makes no stream name."""
        stream = self.stream_prefix + topic.strip("/")
        return stream if STREAM_NAME_RE.match(stream) else None

    def qos_for(self, publisher: QosProfile) -> QosProfile:
        """The QoS to subscribe with to a publisher of QoS ``publisher``."""
        if self.qos is not None:
            return self.qos
        if publisher.reliability is Reliability.BEST_EFFORT:
            return QosProfile(Reliability.BEST_EFFORT, publisher.durability, depth=5)
        return QosProfile(durability=publisher.durability, depth=max(publisher.depth, 10))


def _patterns(where: str, values: list[str]) -> tuple[re.Pattern[str], ...]:
    out = []
    for i, value in enumerate(values):
        try:
            out.append(re.compile(value))
        except re.error as err:
            raise BusConfigError(f"{where}[{i}]: {value!r} is not a regular expression: {err}") from None
    return tuple(out)


class DiscoverDocument(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``discover:`` of the robot YAML: bridge ROS topics chosen by pattern, types from the graph
    (besides those of ``streams:``).

    Attributes:
        allow: Regular expressions searched in each absolute topic name; a topic is taken if one
            matches (none given: every topic).
        deny: ...unless one of these matches (besides ``/rosout``, ``/parameter_events``, action
            internals and the bridge's own topics).
        stream_prefix: Bus stream = this prefix + the topic without its leading ``/``.
        qos: QoS of the bridge's subscriptions, as in ``streams:`` (none: follow each publisher:
            reliable ones reliably and never dropped by the bus, best-effort ones as sensor data).
    """

    allow: list[str] = msgspec.field(default_factory=list)
    deny: list[str] = msgspec.field(default_factory=list)
    stream_prefix: str = ""
    qos: str | dict[str, Any] | None = None

    def selection(self, where: str) -> TopicSelection:
        """Checked: every pattern compiles, the prefix makes stream names, the QoS is known.

        Raises:
            BusConfigError: Naming the key.
        """
        if self.stream_prefix and not STREAM_NAME_RE.match(self.stream_prefix + "x"):
            raise BusConfigError(
                f"{where}.stream_prefix: {self.stream_prefix!r} does not start a stream name "
                "(letters, digits, _ and -, in /-separated parts)"
            )
        try:
            qos = None if self.qos is None else QosProfile.parse(self.qos)
        except RmwZenohError as err:
            raise BusConfigError(f"{where}.qos: {err}") from None
        return TopicSelection(
            allow=_patterns(f"{where}.allow", self.allow),
            deny=_patterns("built-in deny", list(BUILTIN_DENY)) + _patterns(f"{where}.deny", self.deny),
            stream_prefix=self.stream_prefix,
            qos=qos,
        )
