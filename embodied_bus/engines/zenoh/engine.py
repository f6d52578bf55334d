"""The Zenoh engine: an embedded peer (default), a client of a router, or a router itself.

Key layout: ``eb/<namespace>/s/<stream>``. The binary header rides in the Zenoh attachment and
the payload is passed through untouched.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import zenoh

from embodied_bus.engines.base import (
    Engine,
    EnginePublisher,
    EngineSubscriber,
    GroupMembership,
    MembershipCallback,
    MessageSink,
)
from embodied_bus.engines.blocking import call_bounded
from embodied_bus.engines.capabilities import Membership, Notifications, RequestReply
from embodied_bus.engines.urls import ZenohSettings
from embodied_bus.engines.zenoh.config import (
    SHM_ENABLED_KEY,
    build_zenoh_config,
    init_logging,
    stream_key,
)
from embodied_bus.engines.zenoh.failover import open_failover
from embodied_bus.engines.zenoh.publisher import ZenohPublisher
from embodied_bus.engines.zenoh.subscriber import ZenohGroup, ZenohMulti, ZenohSubscriber
from embodied_bus.engines.zenoh.tuning import CLOSE_TIMEOUT_S, REQUEST_GRACE_S
from embodied_bus.errors import (
    BusClosedError,
    BusConfigError,
    BusConnectionError,
)
from embodied_bus.model.qos import PublisherOptions, SubscriptionOptions

_logger = logging.getLogger("embodied_bus.zenoh")


class ZenohEngine(Engine, RequestReply, Notifications, Membership):
    """A Zenoh session used as a bus engine.

    Open with :meth:`open`; the session is closed by :meth:`close`.
    """

    name = "zenoh"

    def __init__(self, settings: ZenohSettings, session: zenoh.Session, *, shm_enabled: bool = True) -> None:
        self.settings = settings
        self.session = session
        #: Whether the session's shared-memory transport is on (publishers' default for
        #: writing large payloads into their own pools).
        self.shm_enabled = shm_enabled and settings.shm is not False
        self._closed = False

    @classmethod
    async def open(cls, settings: ZenohSettings) -> ZenohEngine:
        """Open the session.

        Raises:
            BusConnectionError: None of the ``connect`` endpoints answered in time, or a listen
                endpoint could not be bound.
        """
        init_logging()
        cfg = build_zenoh_config(settings)
        shm_enabled = cfg.get_json(SHM_ENABLED_KEY) != "false"
        try:
            session = await call_bounded(
                lambda: zenoh.open(cfg), settings.connect_timeout_s + 5.0, name="eb-zenoh-open"
            )
        except zenoh.ZError as err:
            where = ", ".join(settings.connect or settings.listen) or "the default endpoints"
            raise BusConnectionError(
                f"cannot open Zenoh session ({settings.mode}) with {where} within "
                f"{settings.connect_timeout_s:g} s: {err}"
            ) from err
        except TimeoutError as err:
            raise BusConnectionError(
                f"opening the Zenoh session did not finish within {settings.connect_timeout_s + 5:g} s"
            ) from err
        return cls(settings, session, shm_enabled=shm_enabled)

    def key(self, stream: str | None) -> str:
        """Key expression of a stream in this namespace."""
        return stream_key(self.settings.namespace, stream)

    def _check(self) -> None:
        if self._closed:
            raise BusClosedError("the Zenoh bus is closed")

    async def create_publisher(self, stream: str, options: PublisherOptions) -> EnginePublisher:
        self._check()
        return ZenohPublisher(self, self.key(stream), options)

    async def create_subscriber(
        self, stream: str | tuple[str, ...] | None, sink: MessageSink, options: SubscriptionOptions
    ) -> EngineSubscriber:
        self._check()
        if options.key_shared_ranges is not None:
            raise BusConfigError("key_shared_ranges is a Pulsar option; on Zenoh use the ownership ring")
        if options.failover_group is not None:
            return await open_failover(
                self, options.failover_group, sink, options.capacity, partial(self._subscribe, stream)
            )
        return await self._subscribe(stream, sink)

    async def _subscribe(self, stream: str | tuple[str, ...] | None, sink: MessageSink) -> EngineSubscriber:
        if isinstance(stream, tuple):
            return ZenohMulti([ZenohSubscriber(self, self.key(s), sink) for s in stream])
        return ZenohSubscriber(self, self.key(stream), sink)

    def _svc_key(self, name: str) -> str:
        return f"eb/{self.settings.namespace}/@svc/{name}"

    def serve(self, name: str, handler: Callable[[bytes], bytes]) -> Any:
        self._check()

        def on_query(query: zenoh.Query) -> None:
            payload = query.payload.to_bytes() if query.payload is not None else b""
            try:
                answer = handler(payload)
            except Exception as err:  # a failing handler must not kill the queryable
                answer = json.dumps({"error": f"{type(err).__name__}: {err}"}).encode()
            query.reply(query.key_expr, answer)

        return self.session.declare_queryable(
            self._svc_key(name), zenoh.handlers.Callback(on_query, indirect=False), complete=True
        )

    async def request(
        self, name: str, payload: bytes, timeout_s: float, accept: Callable[[bytes], bool] | None = None
    ) -> bytes | None:
        self._check()
        # with a check, every complete queryable is asked (not the one Zenoh finds best, which
        # may be a stand-in) and the first answer that passes the check wins
        target = zenoh.QueryTarget.ALL_COMPLETE if accept is not None else zenoh.QueryTarget.BEST_MATCHING
        # every answer reaches the check (none merged away because another came for the same key)
        consolidation = zenoh.ConsolidationMode.NONE if accept is not None else None
        loop = asyncio.get_running_loop()
        key = self._svc_key(name)

        async def ask(budget_s: float) -> bytes | None:
            # Callback-based get: no thread per request, so many concurrent requests (executors,
            # planners) do not queue behind a small thread pool.
            fut: asyncio.Future[bytes | None] = loop.create_future()

            def settle(value: bytes | None) -> None:
                if not fut.done():
                    fut.set_result(value)

            def on_reply(reply: zenoh.Reply) -> None:
                if reply.ok is not None:
                    answer = reply.ok.payload.to_bytes()
                    if accept is None or accept(answer):
                        loop.call_soon_threadsafe(settle, answer)

            def on_done() -> None:
                loop.call_soon_threadsafe(settle, None)

            # indirect=False: the two callbacks only hand the answer to the loop, so they run on
            # Zenoh's own thread instead of a Python thread started for every request.
            try:
                self.session.get(
                    key,
                    zenoh.handlers.Callback(on_reply, on_done, indirect=False),
                    payload=payload,
                    target=target,
                    consolidation=consolidation,
                    timeout=budget_s,
                )
            except zenoh.ZError as err:
                self._check()  # closed meanwhile: BusClosedError
                raise BusConnectionError(f"zenoh query {key!r} failed: {err}") from err
            # bounded here too: a session closed while the query runs never calls on_done
            try:
                async with asyncio.timeout(budget_s + REQUEST_GRACE_S):
                    return await fut
            except TimeoutError:
                self._check()
                return None

        # Right after connecting, the service may not be routed yet and a query returns at once
        # with no reply: ask again until the timeout.
        deadline = time.monotonic() + timeout_s
        while True:
            answer = await ask(max(0.05, deadline - time.monotonic()))
            if answer is not None or time.monotonic() >= deadline:
                return answer
            await asyncio.sleep(0.05)

    def notify(self, topic: str, payload: bytes, *, block: bool = False) -> None:
        self._check()
        cc = zenoh.CongestionControl.BLOCK if block else zenoh.CongestionControl.DROP  # DROP: put's default
        self.session.put(f"eb/{self.settings.namespace}/@n/{topic}", payload, congestion_control=cc)

    def listen(self, topic: str, callback: Callable[[str, bytes], None]) -> Any:
        self._check()
        prefix = f"eb/{self.settings.namespace}/@n/"

        def on_sample(sample: zenoh.Sample) -> None:
            callback(str(sample.key_expr)[len(prefix) :], sample.payload.to_bytes())

        return self.session.declare_subscriber(
            prefix + topic, zenoh.handlers.Callback(on_sample, indirect=False)
        )

    async def watch_group(self, group: str, on_change: MembershipCallback) -> GroupMembership:
        self._check()
        if not group or any(c in group for c in "*$#?@"):
            raise BusConfigError(f"invalid group name {group!r}")
        return ZenohGroup(self, group, on_change)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                await call_bounded(self.session.close, CLOSE_TIMEOUT_S, name="eb-zenoh-close")
            except TimeoutError:
                _logger.warning("the Zenoh session did not close within %g s; left behind", CLOSE_TIMEOUT_S)
