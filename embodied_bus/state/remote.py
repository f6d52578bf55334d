"""State tables on Zenoh: a :class:`~embodied_bus.state.service.StateService` stores them; a
table loads what the service holds and follows the writes it sends.

Every write carries its table revision. A reader that sees a revision skip (a change lost on
the way) or hears nothing for :data:`RESYNC_S` asks the service for what came after the last
revision it holds, so a lost change costs latency, never a wrong value.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from embodied_bus.engines.capabilities import notifications, request_reply
from embodied_bus.errors import BusConnectionError, EmbodiedBusError
from embodied_bus.state.codec import (
    OP_PUT,
    OP_SINCE,
    decode_entries,
    decode_reply,
    encode_entries,
    encode_request,
)
from embodied_bus.state.model import StateEntry
from embodied_bus.state.service import SERVICE, change_topic
from embodied_bus.state.table import ApplyFn, StateOptions

if TYPE_CHECKING:
    from embodied_bus.bus import Bus

__all__ = ["RESYNC_S", "ServiceState", "open_service_state"]

_log = logging.getLogger("embodied_bus.state")
#: A reader asks the service for writes it may have missed this often, seconds.
RESYNC_S = 2.0


class ServiceState:
    """One table served by the state service of the bus's namespace."""

    def __init__(self, bus: Bus, table: str, options: StateOptions) -> None:
        self.bus = bus
        self.table = table
        self.options = options
        self._apply: ApplyFn | None = None
        self._revision = 0  # every write up to this one has been applied
        self._listener: Any = None
        self._resync: asyncio.Task[None] | None = None
        self._catching_up = False
        self._catch_task: asyncio.Future[None] | None = None

    async def _ask(self, op: int, body: bytes) -> tuple[int, bytes, int]:
        payload = encode_request(op, self.table, body)
        answer = await request_reply(self.bus.engine, "a state table served by a state service").request(
            SERVICE, payload, self.options.request_timeout_s
        )
        if answer is None:
            raise BusConnectionError(
                f"no state service answered on {self.bus.url} (namespace {self.bus.namespace!r}) within "
                f"{self.options.request_timeout_s:g} s: run `embodied-bus queue` (it hosts one) or "
                "`embodied-bus state serve`"
            )
        revision, offset = decode_reply(answer)
        return revision, answer, offset

    async def load(self, apply: ApplyFn) -> list[StateEntry]:
        loop = asyncio.get_running_loop()
        self._apply = apply

        def on_change(_topic: str, payload: bytes) -> None:
            loop.call_soon_threadsafe(self._changed, payload)

        self._listener = notifications(self.bus.engine, "a state table served by a state service").listen(
            change_topic(self.table), on_change
        )
        revision, answer, offset = await self._ask(OP_SINCE, (0).to_bytes(8, "little"))
        self._revision = max(self._revision, revision)
        self._resync = asyncio.create_task(self._resync_loop(), name=f"eb-state-resync-{self.table}")
        return decode_entries(answer, offset)

    def _changed(self, payload: bytes) -> None:
        try:
            entries = decode_entries(payload)
        except EmbodiedBusError as err:
            _log.warning("a malformed change of state table %r ignored: %s", self.table, err)
            return
        if not entries or self._apply is None:
            return
        self._apply(entries)
        if entries[0].revision <= self._revision + 1:
            self._revision = max(self._revision, entries[-1].revision)
        elif not self._catching_up:
            self._catch_task = asyncio.ensure_future(self._catch_up())

    async def _catch_up(self, *, quiet: bool = False) -> None:
        self._catching_up = True
        try:
            since = self._revision
            revision, answer, offset = await self._ask(OP_SINCE, since.to_bytes(8, "little"))
            if self._apply is not None:
                self._apply(decode_entries(answer, offset))
            self._revision = max(self._revision, revision)
        except EmbodiedBusError as err:
            level = logging.DEBUG if quiet else logging.WARNING
            _log.log(level, "state table %r could not catch up: %s", self.table, err)
        finally:
            self._catching_up = False

    async def _resync_loop(self) -> None:
        while True:
            await asyncio.sleep(RESYNC_S)
            if not self._catching_up:
                await self._catch_up(quiet=True)

    async def put(self, entries: Sequence[StateEntry]) -> list[StateEntry]:
        first, _, _ = await self._ask(OP_PUT, encode_entries(entries))
        return [e._replace(revision=first + i) for i, e in enumerate(entries)]

    async def close(self) -> None:
        self._apply = None
        if self._resync is not None:
            self._resync.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._resync
        if self._listener is not None:
            with contextlib.suppress(Exception):  # the session may be closed already
                self._listener.undeclare()
            self._listener = None


def open_service_state(bus: Bus, table: str, options: StateOptions) -> ServiceState:
    """The Zenoh backend of :func:`~embodied_bus.state.open_state`."""
    return ServiceState(bus, table, options)
