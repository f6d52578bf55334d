"""Thin synchronous wrappers for scripts and ROS callbacks.

Each :class:`SyncBus` runs its own event loop in a named daemon thread; calls block the caller
until the coroutine finishes on that loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

from embodied_bus.actions.client import ActionHandle, Planner
from embodied_bus.actions.model import Action, ActionStatus
from embodied_bus.actions.queue import Backlog
from embodied_bus.bus import Bus, open_bus
from embodied_bus.engines.urls import DEFAULT_URL
from embodied_bus.errors import BusClosedError
from embodied_bus.model.header import Header
from embodied_bus.model.sample import Payload, Sample
from embodied_bus.streams.publisher import Publisher
from embodied_bus.streams.subscriber import RECV_MANY_DEFAULT, Subscription

__all__ = ["SyncActionHandle", "SyncBus", "SyncPlanner", "SyncPublisher", "SyncSubscription"]

T = TypeVar("T")


class _LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="eb-sync-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5.0)
        self.loop.close()


class SyncPublisher:
    """Blocking facade of :class:`~embodied_bus.streams.Publisher`."""

    def __init__(self, runner: _LoopThread, pub: Publisher) -> None:
        self._runner = runner
        self.inner = pub

    def publish(self, payload: Payload, *, stamp_ns: int, **kw: Any) -> Header:
        """Publish one sample (see :meth:`Publisher.publish_nowait`)."""
        return self._runner.run(self.inner.publish(payload, stamp_ns=stamp_ns, **kw))

    def wait_for_subscribers(self, timeout_s: float = 5.0) -> bool:
        """Wait until a subscriber matches (see :meth:`Publisher.wait_for_subscribers`)."""
        return self._runner.run(self.inner.wait_for_subscribers(timeout_s))

    def publish_many(self, payloads: Sequence[Payload], *, stamps_ns: Sequence[int]) -> range:
        """Publish several samples in order (see :meth:`Publisher.publish_many`)."""
        return self._runner.run(self.inner.publish_many(payloads, stamps_ns=stamps_ns))

    def flush(self) -> None:
        """Wait until every sample is accepted by the engine."""
        self._runner.run(self.inner.flush())


class SyncSubscription:
    """Blocking facade of :class:`~embodied_bus.streams.Subscription`."""

    def __init__(self, runner: _LoopThread, sub: Subscription) -> None:
        self._runner = runner
        self.inner = sub

    def recv(self, timeout_s: float | None = None) -> Sample:
        """Wait for the next sample; raises TimeoutError after ``timeout_s`` seconds."""
        return self._runner.run(self.inner.recv(timeout_s))

    def recv_many(self, max_samples: int = RECV_MANY_DEFAULT, timeout_s: float | None = None) -> list[Sample]:
        """Wait for the next sample and take those buffered behind it (see
        :meth:`Subscription.recv_many`)."""
        return self._runner.run(self.inner.recv_many(max_samples, timeout_s))

    def __iter__(self) -> Iterator[Sample]:
        while True:
            try:
                yield self.recv()
            except BusClosedError:
                return

    def close(self) -> None:
        """Close the subscription."""
        self._runner.run(self.inner.close())


class SyncBus:
    """Blocking facade of :class:`~embodied_bus.Bus`: ``with SyncBus("zenoh:") as bus: ...``."""

    def __init__(
        self, url: str = DEFAULT_URL, *, namespace: str | None = None, connect_timeout_s: float | None = None
    ) -> None:
        self._runner = _LoopThread()
        try:
            self.inner: Bus = self._runner.run(_open(url, namespace, connect_timeout_s))
        except BaseException:
            self._runner.stop()
            raise

    def publisher(self, stream: str, **kw: Any) -> SyncPublisher:
        """Declare a publisher (same arguments as :meth:`Bus.publisher`)."""
        return SyncPublisher(self._runner, self._runner.run(self.inner.publisher(stream, **kw)))

    def subscribe(self, stream: str | None = None, **kw: Any) -> SyncSubscription:
        """Subscribe (same arguments as :meth:`Bus.subscribe`)."""
        return SyncSubscription(self._runner, self._runner.run(self.inner.subscribe(stream, **kw)))

    def planner(self, **kw: Any) -> SyncPlanner:
        """A planner on this bus (same keyword arguments as :class:`~embodied_bus.actions.Planner`)."""
        return SyncPlanner(self, **kw)

    def close(self) -> None:
        """Close the bus and stop its loop thread."""
        try:
            self._runner.run(self.inner.close())
        finally:
            self._runner.stop()

    def __enter__(self) -> SyncBus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncActionHandle:
    """Blocking facade of :class:`~embodied_bus.actions.ActionHandle`."""

    def __init__(self, runner: _LoopThread, handle: ActionHandle) -> None:
        self._runner = runner
        self.inner = handle
        #: The action's id.
        self.id = handle.id
        #: The submit matched an earlier action with the same idempotency key.
        self.duplicate = handle.duplicate

    def status(self) -> ActionStatus:
        """Current status."""
        return self._runner.run(self.inner.status())

    def result(self, timeout_s: float | None = None) -> Action:
        """Wait until the action ends; raises TimeoutError after ``timeout_s`` seconds."""
        return self._runner.run(self.inner.result(timeout_s))

    def feedback(self) -> Iterator[Any]:
        """Feedback messages of the running action until it ends (blocking iterator)."""
        stream: AsyncIterator[Any] = self.inner.feedback()
        try:
            while True:
                try:
                    yield self._runner.run(_next(stream))
                except StopAsyncIteration:
                    return
        finally:
            self._runner.run(stream.aclose())  # type: ignore[attr-defined]

    def cancel(self) -> Action | None:
        """Cancel: removed if queued, signalled if running."""
        return self._runner.run(self.inner.cancel())


class SyncPlanner:
    """Blocking facade of :class:`~embodied_bus.actions.Planner`, for scripts and ROS callbacks:
    ``with SyncBus(url) as bus, bus.planner() as planner: planner.submit("dock").result(60)``.

    Args:
        bus: The bus the planner runs on (its event loop thread).
        **kw: Keyword arguments of :class:`~embodied_bus.actions.Planner` (``timeout_s``,
            ``signer``, ``policy``).
    """

    def __init__(self, bus: SyncBus, **kw: Any) -> None:
        self._runner = bus._runner
        self.inner: Planner = self._runner.run(_planner(bus.inner, kw))

    def _handle(self, handle: ActionHandle) -> SyncActionHandle:
        return SyncActionHandle(self._runner, handle)

    def submit(self, kind: str, payload: Any = None, **kw: Any) -> SyncActionHandle:
        """Submit one action (same arguments as :meth:`Planner.submit`); returns once it is
        durably queued."""
        return self._handle(self._runner.run(self.inner.submit(kind, payload, **kw)))

    def submit_many(self, actions: Sequence[Action]) -> list[SyncActionHandle]:
        """Submit a batch in one request (see :meth:`Planner.submit_many`)."""
        return [self._handle(h) for h in self._runner.run(self.inner.submit_many(actions))]

    def get(self, action_id: str) -> Action | None:
        """The current state of an action (results of a planner that was away included)."""
        return self._runner.run(self.inner.get(action_id))

    def handle(self, action_id: str) -> SyncActionHandle:
        """A handle on an existing action (e.g. after a restart)."""
        return self._handle(self.inner.handle(action_id))

    def backlog(self) -> Backlog:
        """The queue's backlog (see :meth:`Planner.backlog`)."""
        return self._runner.run(self.inner.backlog())

    def dead_letters(self) -> list[Action]:
        """The dead-letter queue with every attempt's reason."""
        return self._runner.run(self.inner.dead_letters())

    def close(self) -> None:
        """Stop listening for results (what is still awaited fails with BusClosedError)."""
        self._runner.run(self.inner.close())

    def __enter__(self) -> SyncPlanner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _planner(bus: Bus, kw: dict[str, Any]) -> Planner:
    return Planner(bus, **kw)  # made on the bus's loop, where it runs


async def _next(stream: AsyncIterator[Any]) -> Any:
    return await anext(stream)


async def _open(url: str, namespace: str | None, timeout: float | None) -> Bus:
    return await open_bus(url, namespace=namespace, connect_timeout_s=timeout)
