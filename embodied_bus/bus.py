"""The bus: one engine session, opened from a URL, scoped to a robot namespace."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

from embodied_bus.engines import Engine, open_engine, parse_bus_url
from embodied_bus.engines.urls import DEFAULT_URL, PulsarSettings, ZenohSettings
from embodied_bus.errors import BusClosedError, BusConfigError, BusConnectionError
from embodied_bus.model.clock import BucketClock
from embodied_bus.model.encoding import ENCODING_RAW
from embodied_bus.model.header import Modality, validate_stream_name
from embodied_bus.model.qos import PublisherOptions, SubscriptionOptions
from embodied_bus.streams.publisher import Publisher
from embodied_bus.streams.subscriber import Subscription

__all__ = ["Bus", "open_bus"]

_log = logging.getLogger("embodied_bus")
#: First and longest pause between tries of a bus that cannot be reached yet, seconds.
WAIT_FIRST_S = 0.5
WAIT_MAX_S = 5.0


class Bus:
    """A connection to the bus. Open with :func:`open_bus`; close with :meth:`close` or
    ``async with``. Several buses may be open in one process (no global state)."""

    def __init__(self, url: str, settings: ZenohSettings | PulsarSettings, engine: Engine) -> None:
        self.url = url
        self.settings = settings
        self.engine = engine
        self.namespace = settings.namespace
        self._publishers: list[Publisher] = []
        self._subscriptions: list[Subscription] = []
        self._closed = False
        self._on_close: list[Callable[[], None]] = []

    @property
    def engine_name(self) -> str:
        """``zenoh`` or ``pulsar``."""
        return self.engine.name

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def add_close_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` (on the event loop) when :meth:`close` starts, e.g. to fail what waits
        on this bus; an error it raises is logged."""
        self._on_close.append(fn)

    def remove_close_callback(self, fn: Callable[[], None]) -> None:
        """Forget a callback of :meth:`add_close_callback` (no error if it is not there)."""
        if fn in self._on_close:
            self._on_close.remove(fn)

    def _check(self) -> None:
        if self._closed:
            raise BusClosedError(f"bus {self.url!r} is closed")

    async def publisher(
        self,
        stream: str,
        *,
        modality: Modality | str = Modality.OTHER,
        encoding: str = ENCODING_RAW,
        frame_id: str = "",
        clock: BucketClock | None = None,
        options: PublisherOptions | None = None,
    ) -> Publisher:
        """Declare a publisher on a stream.

        Args:
            stream: Stream name (``lidar/front``, ``camera``...).
            modality: Sensor kind (enum or name).
            encoding: Default payload encoding (``raw``, ``npy``, ``cdr:<type>``, ``jpeg``...).
            frame_id: Default coordinate frame.
            clock: Bucket width and phase (default: 100 ms, phase 0).
            options: Backpressure, size limit, chunking, shared memory.
        """
        self._check()
        validate_stream_name(stream)
        opts = options or PublisherOptions()
        engine_pub = await self.engine.create_publisher(stream, opts)
        pub = Publisher(
            engine_pub,
            stream=stream,
            modality=Modality.parse(modality),
            encoding=encoding,
            frame_id=frame_id,
            clock=clock or BucketClock(),
            options=opts,
        )
        self._publishers.append(pub)
        return pub

    async def subscribe(
        self,
        stream: str | Sequence[str] | None = None,
        *,
        options: SubscriptionOptions | None = None,
    ) -> Subscription:
        """Subscribe to a stream, to several streams in one subscription (e.g. every input of
        a fusion worker), or to every stream of the namespace (``stream=None``)."""
        self._check()
        target: str | tuple[str, ...] | None
        if stream is None or isinstance(stream, str):
            target = stream
        else:
            target = tuple(stream)
            if not target:
                raise BusConfigError("subscribe() needs at least one stream name")
        for name in [target] if isinstance(target, str) else (target or ()):
            validate_stream_name(name)
        opts = options or SubscriptionOptions()
        sub = Subscription(target, opts, asyncio.get_running_loop())
        sub._attach(await self.engine.create_subscriber(target, sub, opts))
        self._subscriptions.append(sub)
        return sub

    async def close(self) -> None:
        """Flush publishers, close subscriptions and the engine session; idempotent."""
        if self._closed:
            return
        self._closed = True
        callbacks, self._on_close = self._on_close, []
        for fn in callbacks:
            try:
                fn()
            except Exception:
                logging.getLogger("embodied_bus").exception("a close callback of bus %r failed", self.url)
        try:
            for pub in self._publishers:
                await pub.close()
            for sub in self._subscriptions:
                await sub.close()
        finally:
            await self.engine.close()

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _BusOpener:
    """Awaitable and async context manager returned by :func:`open_bus`."""

    def __init__(
        self, url: str, namespace: str | None, connect_timeout_s: float | None, wait_s: float
    ) -> None:
        self._url = url
        self._namespace = namespace
        self._timeout = connect_timeout_s
        self._wait_s = wait_s
        self._bus: Bus | None = None

    async def _open(self) -> Bus:
        settings = parse_bus_url(self._url, namespace=self._namespace, connect_timeout_s=self._timeout)
        deadline = time.monotonic() + self._wait_s
        pause_s = WAIT_FIRST_S
        while True:
            try:
                engine = await open_engine(settings)
                return Bus(self._url, settings, engine)
            except BusConnectionError as err:
                if time.monotonic() + pause_s > deadline:
                    raise
                _log.warning("waiting for the bus at %s: %s (trying again in %g s)", self._url, err, pause_s)
            await asyncio.sleep(pause_s)
            pause_s = min(WAIT_MAX_S, pause_s * 2)

    def __await__(self) -> Generator[Any, None, Bus]:
        return self._open().__await__()

    async def __aenter__(self) -> Bus:
        self._bus = await self._open()
        return self._bus

    async def __aexit__(self, *exc: object) -> None:
        if self._bus is not None:
            await self._bus.close()


def open_bus(
    url: str = DEFAULT_URL,
    *,
    namespace: str | None = None,
    connect_timeout_s: float | None = None,
    wait_s: float = 0.0,
) -> _BusOpener:
    """Open a bus from a URL: ``bus = await open_bus(url)`` or ``async with open_bus(url) as bus``.

    Args:
        url: ``zenoh:`` (embedded peer, default), ``zenoh://router:7447``, ``pulsar://host:6650``,
            ``pulsar+ssl://host:6651`` ... (see :mod:`embodied_bus.engines.urls`).
        namespace: Robot namespace (overrides ``ns=`` in the URL; default ``default``).
        connect_timeout_s: Time to reach a router or broker (overrides ``timeout=``).
        wait_s: Keep trying for this long while the router or broker cannot be reached (it is
            starting, or restarting), with a log line per try (``math.inf``: until it answers).

    Raises:
        BusConfigError: Unknown scheme or option.
        BusConnectionError: Router or broker unreachable within the timeout.
    """
    return _BusOpener(url, namespace, connect_timeout_s, wait_s)
