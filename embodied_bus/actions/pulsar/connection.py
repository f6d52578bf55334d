"""What the planner's queue and the executors' links on Pulsar share: one engine, the topic
names, the state log (with the queue's retry policies), the reply topics and the producers."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pulsar

from embodied_bus.actions.model import Action, encode_action
from embodied_bus.actions.policy import Retried, RetryPolicy
from embodied_bus.actions.pulsar.records import Event, encode_policy
from embodied_bus.actions.pulsar.sending import Producers, Replies, deliver_after, send, unavailable
from embodied_bus.actions.pulsar.statelog import StateLog
from embodied_bus.actions.pulsar.topics import (
    DLQ_SUBSCRIPTION,
    EXECUTOR_SUBSCRIPTION,
    PRIORITY_LEVELS,
    STATE_KEEPER,
    ActionTopics,
)
from embodied_bus.engines.pulsar import PulsarEngine

__all__ = ["QueueConnection"]


class QueueConnection:
    """One queue's connection to Pulsar, shared by its planner side and its executors' links.

    Args:
        engine: An open Pulsar engine.
    """

    def __init__(self, engine: PulsarEngine) -> None:
        self.engine = engine
        self.topics = ActionTopics.of(engine.settings)
        self.state = StateLog.acquire(engine, self.topics)
        self.replies = Replies.acquire(engine)
        self.producers = Producers(engine, block_if_queue_full=True)
        self._started = False
        self._start_lock = asyncio.Lock()
        self._kind_lock = asyncio.Lock()
        self._kinds_ready: set[str] = set()

    async def start(self) -> None:
        """Create the durable subscriptions and open the state log (idempotent)."""
        if self._started:
            return
        async with self._start_lock:
            if not self._started:
                await self._subscribe_all(
                    [(self.topics.state, STATE_KEEPER), (self.topics.dlq, DLQ_SUBSCRIPTION)]
                )
                await self.state.open()
                self._started = True

    async def ensure_kind(self, kind: str) -> None:
        """The executors' subscriptions on a kind's priority topics, before its first message
        (Pulsar keeps messages only for existing subscriptions)."""
        if kind in self._kinds_ready:
            return
        async with self._kind_lock:
            if kind not in self._kinds_ready:
                await self._subscribe_all(
                    [(self.topics.queue(p, kind), EXECUTOR_SUBSCRIPTION) for p in PRIORITY_LEVELS]
                )
                self._kinds_ready.add(kind)

    async def _subscribe_all(self, wanted: list[tuple[str, str]]) -> None:
        def create() -> None:
            for topic, sub in wanted:
                # a zero queue: the broker dispatches nothing to this consumer (one that took a
                # message and closed would send it back to be redelivered out of turn)
                c = self.engine.client.subscribe(
                    topic,
                    sub,
                    consumer_type=pulsar.ConsumerType.Shared,
                    initial_position=pulsar.InitialPosition.Earliest,
                    receiver_queue_size=0,
                )
                c.close()

        try:
            await asyncio.to_thread(create)
        except pulsar.PulsarException as err:
            raise unavailable("creating the queue subscriptions", err) from err

    def policy_for(self, action: Retried) -> RetryPolicy:
        """The retry policy of ``action``: its own, else its kind's policy record in the state
        log, else the default's, else :data:`~embodied_bus.actions.policy.DEFAULT_RETRY`."""
        return self.state.policies.for_action(action)

    async def set_policy(self, policy: RetryPolicy, kind: str | None) -> None:
        """Write a policy record and wait until this process's view of the log has it."""
        await self.start()
        logged = await self.state.enqueue([(kind or "", Event.POLICY, encode_policy(policy))])
        await self.state.read_back(logged)

    async def enqueue(self, a: Action, reply_to: str, deliver_after_s: float = 0.0) -> None:
        """Put ``a`` on its priority topic (a retry after ``deliver_after_s``, a requeue)."""
        await self.ensure_kind(a.kind)
        producer = await self.producers.get(self.topics.queue(a.priority, a.kind))
        props = {"eb-attempts": str(a.attempt_count), "eb-reply-to": reply_to, "eb-kind": a.kind}
        kwargs: dict[str, Any] = {"partition_key": a.id, "properties": props}
        if deliver_after_s > 0:
            # the broker delays by whole ticks (delayedDeliveryTickTimeMillis, 1 s by default) and
            # delivers shorter delays at once; the executor waits out the rest (eb-not-before-ns)
            kwargs["deliver_after"] = deliver_after(deliver_after_s)
            props["eb-not-before-ns"] = str(time.time_ns() + int(deliver_after_s * 1e9))
        await send(producer, encode_action(a), **kwargs)

    async def close(self) -> None:
        """Release the producers, the reply topics and the state log."""
        await self.producers.close()
        await self.replies.release()
        await self.state.release()
