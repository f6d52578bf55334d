"""Group membership on Pulsar: heartbeats on a non-persistent topic."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import pulsar

from embodied_bus.engines.base import (
    GroupMembership,
    MembershipCallback,
)
from embodied_bus.engines.pulsar.handles import PulsarConnection, close_handle
from embodied_bus.engines.pulsar.topics import group_topic
from embodied_bus.engines.pulsar.tuning import GROUP_EXPIRY_S, GROUP_HEARTBEAT_S

_logger = logging.getLogger("embodied_bus.pulsar")


class PulsarGroup(GroupMembership):
    """Group membership over a non-persistent heartbeat topic (Pulsar has no liveliness).

    A member that announced itself also hears its own heartbeats: while they do not come back
    (the broker restarts, the network drops) this view is not healthy, and no other member is
    taken to have left; when they come back, every member gets a fresh
    :data:`GROUP_EXPIRY_S` to be heard again.
    """

    def __init__(
        self, engine: PulsarConnection, group: str, on_change: MembershipCallback, consumer: Any
    ) -> None:
        self._engine = engine
        self._topic = group_topic(engine.settings, group)
        self._on_change = on_change
        self._consumer = consumer
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._producer: Any = None
        self._me: tuple[str, str] | None = None
        self._self_seen = float("-inf")  # when our own heartbeat last came back
        self._healthy_since: float | None = time.monotonic()  # watchers that never announce
        self._threads = [threading.Thread(target=self._listen, name=f"eb-group-{group}", daemon=True)]
        self._threads[0].start()

    def _listen(self) -> None:
        next_check = time.monotonic() + GROUP_HEARTBEAT_S
        while not self._stop.is_set():
            try:
                msg = self._consumer.receive(timeout_millis=int(GROUP_HEARTBEAT_S * 1000))
                props = msg.properties()
                member, value, state = props.get("member"), props.get("value"), props.get("state")
                if member and value is not None:
                    self._saw(member, value, state != "left")
            except pulsar.Timeout:
                pass
            except pulsar.AlreadyClosed:
                return  # the consumer or the whole client was closed: nothing more will come
            except pulsar.PulsarException as err:
                if self._stop.is_set():
                    return
                _logger.warning("group heartbeat receive failed: %s", err)
                self._stop.wait(0.2)
            now = time.monotonic()
            if now >= next_check:
                next_check = now + GROUP_HEARTBEAT_S
                self._expire(now)

    def _expire(self, now: float) -> None:
        with self._lock:
            if self._me is not None and now - self._self_seen > GROUP_EXPIRY_S / 2:
                self._healthy_since = None  # our own heartbeats stopped coming back
            if self._healthy_since is None:
                return
            expired = [(m, v) for m, (v, t) in self._seen.items() if now - t > GROUP_EXPIRY_S]
            for m, _ in expired:
                del self._seen[m]
        for m, v in expired:
            self._on_change(m, v, False)

    def _saw(self, member: str, value: str, alive: bool) -> None:
        now = time.monotonic()
        with self._lock:
            if self._me == (member, value) and alive:
                self._self_seen = now
                if self._healthy_since is None:  # back: everyone gets a fresh expiry
                    self._healthy_since = now
                    self._seen = {m: (v, now) for m, (v, _) in self._seen.items()}
            known = self._seen.get(member)
            if alive:
                self._seen[member] = (value, now)
            elif known is not None:
                del self._seen[member]
        if alive and (known is None or known[0] != value):
            self._on_change(member, value, True)
        elif not alive and known is not None:
            self._on_change(member, known[0], False)

    def healthy(self) -> bool:
        with self._lock:
            if self._me is None:
                return True
            return time.monotonic() - self._self_seen <= GROUP_EXPIRY_S / 2

    def settled(self) -> bool:
        now = time.monotonic()
        with self._lock:
            since = self._healthy_since
            if since is None or now - since < GROUP_EXPIRY_S + GROUP_HEARTBEAT_S:
                return False  # not up to date long enough to tell
            return self._me is None or now - self._self_seen <= GROUP_EXPIRY_S / 2

    def _beat(self) -> None:
        assert self._me is not None
        member, value = self._me
        # a closed client takes sends without complaint (and without sending): stop beating
        while not self._stop.wait(GROUP_HEARTBEAT_S) and not self._engine.closed:
            try:
                self._producer.send_async(
                    b"", None, properties={"member": member, "value": value, "state": "alive"}
                )
            except pulsar.AlreadyClosed:
                return  # the client was closed: this member is gone
            except pulsar.PulsarException as err:
                _logger.warning("group heartbeat send failed: %s", err)

    def members(self) -> dict[str, str]:
        with self._lock:
            return {m: v for m, (v, _) in self._seen.items()}

    async def announce(self, member: str, value: str) -> None:
        self._producer = await asyncio.to_thread(self._engine.client.create_producer, self._topic)
        with self._lock:
            self._me = (member, value)
            self._self_seen = time.monotonic()  # counted healthy until its beats are due back
        await asyncio.to_thread(
            self._producer.send, b"", properties={"member": member, "value": value, "state": "alive"}
        )
        t = threading.Thread(target=self._beat, name=f"eb-heartbeat-{member}", daemon=True)
        self._threads.append(t)
        t.start()

    async def leave(self) -> None:
        self._stop.set()
        if self._producer is not None and self._me is not None:
            # Asynchronous send with a bounded wait: a blocking send on a client that is being
            # closed can hang forever (the others then see this member expire instead).
            sent = threading.Event()
            try:
                self._producer.send_async(
                    b"",
                    lambda *_: sent.set(),
                    properties={"member": self._me[0], "value": self._me[1], "state": "left"},
                )
            except pulsar.PulsarException:
                pass  # the client is closed already, and with it this producer
            else:
                await asyncio.to_thread(sent.wait, 2.0)
                await close_handle(self._producer, self._engine)
        for t in self._threads:
            await asyncio.to_thread(t.join, 2.0)
        await close_handle(self._consumer, self._engine)
