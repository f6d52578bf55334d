"""Failover subscriptions on Zenoh: of the members of a group, the oldest live one receives the
stream; the others stand by and take over when it goes.

Members announce themselves with liveliness tokens (``@group/failover.<group>/<member>``), a
member id starting with its start time, so the oldest is the smallest and a restarted member
queues behind the ones already there (no flapping back). A standby does not deliver: it holds
what arrives, up to the subscription's capacity, and drops what the active member reports
handled (a progress notice every :data:`PROGRESS_PERIOD_S`: the last sequence number per
publisher). When the active member goes (``kill -9`` included: its token goes with its
session), the next oldest delivers what it holds that was not reported handled, then the live
stream: nothing is lost within the capacity (what overflows it is counted in ``lost``), and a
takeover repeats at most what arrived in the last progress period (counted in ``replayed``).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from embodied_bus.engines.base import (
    AckFn,
    EngineBuffer,
    EngineSubscriber,
    GroupMembership,
    MembershipCallback,
    MessageSink,
)
from embodied_bus.model.batches import HeaderRun
from embodied_bus.model.header import Header

__all__ = ["PROGRESS_PERIOD_S", "FailoverGate", "FailoverSubscriber", "open_failover"]


class Coordinating(Protocol):
    """What failover needs of an engine: lightweight topics and group membership."""

    def notify(self, topic: str, payload: bytes, *, block: bool = False) -> None:
        """Send on a lightweight topic."""
        ...

    def listen(self, topic: str, callback: Callable[[str, bytes], None]) -> Any:
        """Receive from a lightweight topic."""
        ...

    async def watch_group(self, group: str, on_change: MembershipCallback) -> GroupMembership:
        """Watch a group's members."""
        ...


#: How often the active member reports what it has handled, in seconds.
PROGRESS_PERIOD_S = 0.1
#: How long a new member listens for the members already there before it may become active.
SETTLE_S = 0.3

_Source = tuple[str, int]  # (stream, publisher id)


class FailoverGate:
    """A :class:`MessageSink` in front of a subscription's own: it passes samples on while this
    member is active, and holds them while it stands by. Thread-safe (engine threads deliver,
    the membership thread activates)."""

    def __init__(self, sink: MessageSink, capacity: int) -> None:
        self.sink = sink
        self.capacity = capacity
        self.active = False
        #: Held samples pushed out of the bound before the active member reported them handled.
        self.lost = 0
        #: Held samples delivered on takeover (some may repeat the previous member's last ones).
        self.replayed = 0
        self._lock = threading.Lock()
        self._held: deque[tuple[Header, bytes]] = deque()
        self._delivered: dict[_Source, int] = {}
        self._handled: dict[_Source, int] = {}

    # -- MessageSink ------------------------------------------------------------------------
    def deliver(self, header: Header, payload: bytes | EngineBuffer, ack: AckFn | None) -> None:
        with self._lock:
            if self.active and not self._was_handled(header):
                self._delivered[(header.stream, header.publisher_id)] = header.seq
                self.sink.deliver(header, payload, ack)
                return
            if not self.active:
                self._hold(header, payload if isinstance(payload, bytes) else payload.to_bytes())
        if ack is not None:
            ack()

    def deliver_batch(self, items: list[tuple[Header, bytes]], ack: AckFn | None = None) -> None:
        with self._lock:
            if self.active:
                fresh = [(h, p) for h, p in items if not self._was_handled(h)]
                for header, _ in fresh:
                    self._delivered[(header.stream, header.publisher_id)] = header.seq
                if fresh:
                    self.sink.deliver_batch(fresh, ack)
                skipped = len(items) - len(fresh)
            else:
                for header, payload in items:
                    self._hold(header, payload)
                skipped = len(items)
        if ack is not None:
            for _ in range(skipped):
                ack()

    def deliver_run(self, run: HeaderRun, ack: AckFn | None = None) -> None:
        self.deliver_batch(list(zip(run.headers(), run.payloads, strict=True)), ack)

    def reject(self, error: Exception, ack: AckFn | None) -> None:
        self.sink.reject(error, ack)

    # -- standing by and taking over --------------------------------------------------------
    def _was_handled(self, header: Header) -> bool:
        """Reported handled by the member that was active before (a sample that reaches this
        one late, after it took over, is not repeated)."""
        return header.seq <= self._handled.get((header.stream, header.publisher_id), -1)

    def _hold(self, header: Header, payload: bytes) -> None:
        if self._was_handled(header):
            return
        self._held.append((header, payload))
        if len(self._held) > self.capacity:
            self._held.popleft()
            self.lost += 1

    def handled(self, progress: dict[_Source, int]) -> None:
        """The active member's report: drop what it has handled."""
        with self._lock:
            for source, seq in progress.items():
                if seq > self._handled.get(source, -1):
                    self._handled[source] = seq
            if self._held:
                done = self._handled
                self._held = deque(
                    (h, p) for h, p in self._held if h.seq > done.get((h.stream, h.publisher_id), -1)
                )

    def activate(self) -> None:
        """Become the active member: deliver what is held and not reported handled, then pass
        every sample on."""
        with self._lock:
            if self.active:
                return
            self.active = True
            held, self._held = self._held, deque()
            for header, payload in held:
                self.replayed += 1
                self._delivered[(header.stream, header.publisher_id)] = header.seq
                self.sink.deliver(header, payload, None)

    def stand_by(self) -> None:
        """Stop delivering (another member is older, e.g. after a partition healed)."""
        with self._lock:
            self.active = False

    def progress(self) -> dict[_Source, int]:
        """What this member has delivered: the last sequence number per source."""
        with self._lock:
            return dict(self._delivered)


def encode_progress(progress: dict[_Source, int]) -> bytes:
    return json.dumps([[stream, pid, seq] for (stream, pid), seq in progress.items()]).encode()


def decode_progress(payload: bytes) -> dict[_Source, int]:
    try:
        rows = json.loads(payload)
        return {(str(stream), int(pid)): int(seq) for stream, pid, seq in rows}
    except (ValueError, TypeError):
        return {}  # not a progress notice: ignored


class FailoverSubscriber(EngineSubscriber):
    """The engine subscription, the group membership and the progress reports of one member."""

    def __init__(
        self, inner: EngineSubscriber, gate: FailoverGate, group: GroupMembership, listener: Any
    ) -> None:
        self.inner = inner
        self.gate = gate
        self.group = group
        self._listener = listener
        self._reporter: asyncio.Task[None] | None = None
        self._send: Callable[[bool], None] = lambda block: None

    def start_reports(self, engine: Coordinating, topic: str) -> None:
        def send(block: bool = False) -> None:
            if self.gate.active:
                engine.notify(topic, encode_progress(self.gate.progress()), block=block)

        async def report() -> None:
            while True:
                await asyncio.sleep(PROGRESS_PERIOD_S)
                send()

        self._send = send
        self._reporter = asyncio.create_task(report())

    async def close(self) -> None:
        if self._reporter is not None:
            self._reporter.cancel()
            self._send(True)  # leaving in order: the next member repeats nothing
        await self.group.leave()
        self._listener.undeclare()
        await self.inner.close()


async def open_failover(
    engine: Coordinating,
    group_name: str,
    sink: MessageSink,
    capacity: int,
    subscribe: Any,
) -> FailoverSubscriber:
    """Join ``group_name`` and subscribe through a :class:`FailoverGate` (``subscribe(sink)``
    makes the engine subscription)."""
    gate = FailoverGate(sink, capacity)
    me = f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"
    settled = threading.Event()
    joined: list[GroupMembership] = []  # the group, once watched (its callback may come first)

    def elect() -> None:
        if not settled.is_set() or not joined:
            return
        members = joined[0].members()
        if me not in members:
            return
        if min(members) == me:
            gate.activate()
        else:
            gate.stand_by()

    topic = f"failover/{group_name}/progress"
    listener = engine.listen(topic, lambda _key, payload: gate.handled(decode_progress(payload)))
    group = await engine.watch_group(f"failover.{group_name}", lambda *_: elect())
    joined.append(group)
    inner = await subscribe(gate)
    await group.announce(me, "m")
    await asyncio.sleep(SETTLE_S)  # the members already there are seen before electing
    await group.refresh()  # and asked for: on a loaded host their tokens may still be on the way
    settled.set()
    elect()
    sub = FailoverSubscriber(inner, gate, group, listener)
    sub.start_reports(engine, topic)
    return sub
