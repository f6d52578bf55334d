"""The queue service: a durable action queue (:class:`~embodied_bus.actions.core.QueueCore` over
an :class:`~embodied_bus.actions.store.ActionStore`) served on a Zenoh bus.

Any process can host it (``embodied-bus queue``, or inside a planner). It answers the typed
requests of :mod:`embodied_bus.actions.protocol` on the ``actions`` service, watches the
executor group (an executor that leaves gives its leases back at once; each counts as a lost
attempt), announces itself in :data:`~embodied_bus.actions.remote.QUEUE_GROUP` (executors that
cannot see it know they cannot confirm their leases) and publishes results on
``actions/result/<id>``; results are also stored, so a planner that was away fetches them.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from pathlib import Path

from embodied_bus.actions.core import QueueCore
from embodied_bus.actions.policy import RetryPolicies, RetryPolicy
from embodied_bus.actions.queue import EXECUTOR_GROUP, Backlog
from embodied_bus.actions.remote import QUEUE_GROUP, SERVICE, warn_if_unsealed
from embodied_bus.actions.store import DEFAULT_KEEP_ENDED, ActionStore
from embodied_bus.bus import Bus
from embodied_bus.engines.capabilities import membership, notifications, request_reply
from embodied_bus.errors import EmbodiedBusError
from embodied_bus.security.seal import Sealer, Trust

__all__ = ["PRUNE_S", "SWEEP_S", "QueueService"]

_log = logging.getLogger("embodied_bus.actions.service")

#: How often expired leases and deadlines are swept, seconds.
SWEEP_S = 0.2
#: How often ended actions beyond the store's ``keep_ended`` are deleted, seconds (and once at
#: start).
PRUNE_S = 60.0
#: An executor that leaves the group gives its leases back this long after, seconds: one cut off
#: from the network learns in that time that it cannot see the queue (its handlers'
#: ``still_owner()`` turns false) before another executor starts its actions.
LOSS_GRACE_S = 0.25


class _Sender:
    """Sends notifications from a thread of its own, in the order given."""

    def __init__(self, bus: Bus, name: str, *, block: bool) -> None:
        self.bus = bus
        self.name = name
        self.block = block
        self._items: queue.SimpleQueue[tuple[str, bytes] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def send(self, topic: str, payload: bytes) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        self._items.put((topic, payload))

    def _run(self) -> None:
        while (item := self._items.get()) is not None:
            topic, payload = item
            try:
                notifications(self.bus.engine, "the action queue service").notify(
                    topic, payload, block=self.block
                )
            except EmbodiedBusError as err:  # closing: results are stored, leases expire
                _log.debug("%s not sent: %s", topic, err)

    def close(self) -> None:
        """Stop the thread once it has sent what is queued (it is a daemon: a send stuck on a
        dead link does not hold the process)."""
        if self._thread is not None:
            self._items.put(None)


class _BusEvents:
    """The core's events as Zenoh notifications, never sent from the caller's thread.

    The core calls these while it holds its lock, on Zenoh's threads; a Zenoh put from there
    can wait for a Zenoh thread that is itself waiting for that lock (a membership callback),
    so every notification goes out from a sender thread. Pushes are sent with congestion
    control ``BLOCK`` (a push dropped under congestion would wait for its lease to expire) from
    a thread of their own, in order: a push to an executor whose link is cut may wait until the
    link comes back or is closed, and must not hold results and wake-ups meanwhile.
    """

    def __init__(self, bus: Bus) -> None:
        self._notes = _Sender(bus, "eb-queue-notify", block=False)
        self._pushes = _Sender(bus, "eb-queue-push", block=True)

    def result(self, action_id: str, payload: bytes) -> None:
        self._notes.send(f"actions/result/{action_id}", payload)

    def wake(self, kind: str) -> None:
        self._notes.send(f"actions/wake/{kind}", b"")

    def push(self, executor: str, payload: bytes) -> None:
        self._pushes.send(f"actions/assign/{executor}", payload)

    def close(self) -> None:
        """Stop the sender threads once they have sent what is queued."""
        self._notes.close()
        self._pushes.close()


class QueueService:
    """Serves a durable action queue on a bus.

    Args:
        bus: The bus to serve on (Zenoh).
        db_path: SQLite file (WAL, fsync on commit).
        policy: Retry policy of every executor of this queue (one for every kind, or per
            kind).
        keep_ended: Ended actions (succeeded or canceled) kept for planners that look them up
            later: the newest this many by submit order; older ones are deleted every
            :data:`PRUNE_S` seconds (dead letters stay until requeued or purged).
        sealer: Seal replies, results and pushes with the queue's key.
        trust: Answer only requests sealed by known parties (planners for planner requests, an
            executor's own key for its requests); others are refused and counted
            (:attr:`refused`). An executor counts as live only once it proved who it is.
    """

    def __init__(
        self,
        bus: Bus,
        db_path: str | Path,
        policy: RetryPolicy | RetryPolicies | None = None,
        *,
        keep_ended: int = DEFAULT_KEEP_ENDED,
        sealer: Sealer | None = None,
        trust: Trust | None = None,
    ) -> None:
        self.bus = bus
        self._events = _BusEvents(bus)
        self.core = QueueCore(
            ActionStore(db_path, policy, keep_ended=keep_ended),
            self._events,
            loss_grace_s=LOSS_GRACE_S,
            sealer=sealer,
            trust=trust,
        )

    @property
    def store(self) -> ActionStore:
        """The durable queue."""
        return self.core.store

    @property
    def bad_requests(self) -> int:
        """Requests answered with an error (malformed, invalid or oversized)."""
        return self.core.bad_requests

    @property
    def refused(self) -> int:
        """Requests and executor-group changes refused: not sealed by a party allowed to make them."""
        return self.core.refused

    @property
    def pushed(self) -> int:
        """Actions handed to idle executors on submit."""
        return self.core.pushed

    def live_executors(self) -> dict[str, str]:
        """Executors in the group now: name -> session."""
        with self.core.lock:
            return dict(self.core.live)

    def idle_executors(self) -> dict[str, int]:
        """Executors waiting for work that new actions are pushed to: name -> free slots."""
        return self.core.idle_executors()

    def backlog(self) -> Backlog:
        """The backlog, from any thread (empty once the service stopped)."""
        return self.core.backlog()

    async def run(self, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        """Serve until ``stop``; sweeps expired leases every :data:`SWEEP_S`."""
        core = self.core
        warn_if_unsealed(self.bus, core.sealer is not None and core.trust is not None, "the queue service")
        core.start()
        handle = request_reply(self.bus.engine, "the action queue service").serve(SERVICE, core.handle_bytes)
        executors = await membership(self.bus.engine, "the action queue service").watch_group(
            EXECUTOR_GROUP, core.executor_changed
        )
        me = await membership(self.bus.engine, "the action queue service").watch_group(
            QUEUE_GROUP, lambda *_: None
        )
        await me.announce(f"q{uuid.uuid4().hex[:12]}", "serving")
        if ready is not None:
            ready.set()
        next_prune = time.monotonic()
        try:
            while not stop.is_set():
                if time.monotonic() >= next_prune:
                    next_prune = time.monotonic() + PRUNE_S
                    pruned = core.prune()
                    if pruned:
                        keep = core.store.keep_ended
                        _log.info("deleted %d ended action(s) beyond the newest %d", pruned, keep)
                try:
                    await asyncio.wait_for(stop.wait(), SWEEP_S)
                except TimeoutError:
                    pass
                core.sweep()
        finally:
            handle.undeclare()
            await me.leave()
            await executors.leave()
            core.close()
            self._events.close()
