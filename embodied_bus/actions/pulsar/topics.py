"""Topic and subscription names of the action queue on Pulsar.

``<t>/<ns>`` is the bus's Pulsar tenant and namespace, ``<bus>`` its namespace::

    persistent://<t>/<ns>/eb.<bus>.actions.q<P>.<kind>   one per priority level P = 0..9 and
                                                          kind; Shared subscription "eb-executors"
    persistent://<t>/<ns>/eb.<bus>.actions.state         the state log: every change of an
                                                          action, as records
    persistent://<t>/<ns>/eb.<bus>.actions.dlq           dead letters (with every attempt)
    non-persistent://<t>/<ns>/eb.<bus>.actions.reply.<planner>   feedback and results for one
                                                          planner (on demand)
"""

from __future__ import annotations

from dataclasses import dataclass

from embodied_bus.engines.urls import PulsarSettings

__all__ = [
    "DLQ_SUBSCRIPTION",
    "EXECUTOR_SUBSCRIPTION",
    "PRIORITY_LEVELS",
    "STATE_KEEPER",
    "ActionTopics",
]

#: Priority levels, one topic each; consumed highest first.
PRIORITY_LEVELS = tuple(range(10))
#: The Shared subscription every executor consumes the priority topics with.
EXECUTOR_SUBSCRIPTION = "eb-executors"
#: Durable subscription that keeps the state log (never acknowledged).
STATE_KEEPER = "eb-state-keeper"
#: Subscription of the dead-letter topic (acknowledged by ``requeue`` and ``purge``).
DLQ_SUBSCRIPTION = "eb-dlq"


@dataclass(frozen=True, slots=True)
class ActionTopics:
    """Topic names of one bus namespace."""

    prefix: str
    np_prefix: str

    @classmethod
    def of(cls, settings: PulsarSettings) -> ActionTopics:
        base = f"{settings.tenant}/{settings.pulsar_namespace}/eb.{settings.namespace}.actions"
        return cls(f"persistent://{base}", f"non-persistent://{base}")

    def queue(self, priority: int, kind: str) -> str:
        """The topic of one kind at one priority level (``/`` in a kind becomes ``:``)."""
        return f"{self.prefix}.q{priority}.{kind.replace('/', ':')}"

    @property
    def state(self) -> str:
        return f"{self.prefix}.state"

    @property
    def dlq(self) -> str:
        return f"{self.prefix}.dlq"

    def reply(self, planner: str) -> str:
        return f"{self.np_prefix}.reply.{planner}"
