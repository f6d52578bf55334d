"""Thin synchronous wrappers for scripts and ROS callbacks.

Each :class:`SyncBus` runs its own event loop in a named daemon thread; calls block the caller
until the coroutine finishes on that loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator, Sequence
from typing import Any, TypeVar

from embodied_bus.bus import Bus, open_bus
from embodied_bus.engines.urls import DEFAULT_URL
from embodied_bus.errors import BusClosedError
from embodied_bus.model.sample import Payload, Sample
from embodied_bus.model.wire import Header
from embodied_bus.streams.publisher import Publisher
from embodied_bus.streams.subscriber import RECV_MANY_DEFAULT, Subscription

__all__ = ["SyncBus", "SyncPublisher", "SyncSubscription"]

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


async def _open(url: str, namespace: str | None, timeout: float | None) -> Bus:
    return await open_bus(url, namespace=namespace, connect_timeout_s=timeout)
