"""A state table as its users see it: a local copy of the latest value per key, kept up to date
by the engine's backend, with durable puts and watchers."""

from __future__ import annotations

import asyncio
import importlib
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from embodied_bus.errors import BusClosedError, BusConfigError
from embodied_bus.state.model import StateEntry, encode_value, validate_key, validate_table

if TYPE_CHECKING:
    from embodied_bus.bus import Bus

__all__ = ["StateBackend", "StateOptions", "StateTable", "open_state", "register_state"]

#: Called on the event loop with entries the backend received, in the order they were written.
ApplyFn = Callable[[Sequence[StateEntry]], None]


class StateBackend(Protocol):
    """How one engine stores a table and tells its readers what changed."""

    async def load(self, apply: ApplyFn) -> list[StateEntry]:
        """Start following the table's writes (``apply`` gets each, on the loop) and return
        the latest entry of every key that has a value now."""
        ...

    async def put(self, entries: Sequence[StateEntry]) -> list[StateEntry]:
        """Store ``entries`` durably, in order; return them as stored for the table to apply at
        once, or nothing if they come back through ``apply`` before this returns."""
        ...

    async def close(self) -> None:
        """Stop following and release what the backend holds."""
        ...


@dataclass(frozen=True, slots=True)
class StateOptions:
    """How a table reaches its store.

    Attributes:
        request_timeout_s: How long a put or a load waits for the store, seconds.
        watch_queue: Changes a watcher may fall behind by before the oldest are dropped (and
            counted in :attr:`StateTable.watch_dropped`).
    """

    request_timeout_s: float = 5.0
    watch_queue: int = 100_000


#: A backend: makes the store of one table of a bus.
StateFactory = Callable[["Bus", str, StateOptions], StateBackend]
_BACKENDS: dict[str, str | StateFactory] = {
    "zenoh": "embodied_bus.state.remote:open_service_state",
    "pulsar": "embodied_bus.state.pulsar:open_pulsar_state",
}


def register_state(engine: str, factory: str | StateFactory) -> None:
    """Make ``factory`` the state backend of buses on ``engine``."""
    _BACKENDS[engine] = factory


class _Watch:
    __slots__ = ("prefix", "queue")

    def __init__(self, prefix: str, size: int) -> None:
        self.prefix = prefix
        self.queue: asyncio.Queue[StateEntry | None] = asyncio.Queue(size)


class StateTable:
    """Latest value per key of one table. Open with :func:`open_state`.

    Reads (:meth:`get`, :meth:`snapshot`) come from the local copy, which a put updates before
    it returns (read your writes) and the backend updates as other writers write.
    """

    def __init__(self, name: str, backend: StateBackend, options: StateOptions) -> None:
        self.name = name
        self.options = options
        self._backend = backend
        self._entries: dict[str, StateEntry] = {}
        self._revisions: dict[str, int] = {}
        self._watches: list[_Watch] = []
        self._last_stamp_ns = 0
        self._closed = False
        self._closing: asyncio.Future[None] | None = None
        self._detach: Callable[[], None] | None = None  # forgets the bus's close callback
        #: Changes dropped because a watcher fell behind by more than ``watch_queue``.
        self.watch_dropped = 0

    async def _load(self) -> None:
        self._apply(await self._backend.load(self._apply))

    def _apply(self, entries: Iterable[StateEntry]) -> None:
        for e in entries:
            if e.revision and e.revision <= self._revisions.get(e.key, 0):
                continue  # an older write seen late (a read that crossed a change)
            if e.revision:
                self._revisions[e.key] = e.revision
            if e.deleted:
                if self._entries.pop(e.key, None) is None:
                    continue
            else:
                self._entries[e.key] = e
            for w in self._watches:
                if e.key.startswith(w.prefix):
                    self._offer(w, e)

    def _offer(self, watch: _Watch, entry: StateEntry) -> None:
        if watch.queue.full():
            watch.queue.get_nowait()
            self.watch_dropped += 1
        watch.queue.put_nowait(entry)

    def _stamp(self) -> int:
        self._last_stamp_ns = max(time.time_ns(), self._last_stamp_ns + 1)
        return self._last_stamp_ns

    def _check(self) -> None:
        if self._closed:
            raise BusClosedError(f"state table {self.name!r} is closed")

    async def put(self, key: str, value: Any) -> None:
        """Store ``value`` (bytes, or anything JSON-serialisable) under ``key``; durable once
        this returns."""
        await self.put_many({key: value})

    async def put_many(self, values: Mapping[str, Any]) -> None:
        """Store several keys in one durable write (one transaction, one round trip)."""
        self._check()
        entries = []
        for key, value in values.items():
            data, is_json = encode_value(value)
            entries.append(StateEntry(validate_key(key), data, is_json, self._stamp()))
        await self._write(entries)

    async def delete(self, *keys: str) -> None:
        """Remove ``keys`` (a tombstone each; readers see them deleted); durable once this returns."""
        self._check()
        stamp = self._stamp
        await self._write([StateEntry(validate_key(k), b"", stamp_ns=stamp(), deleted=True) for k in keys])

    async def _write(self, entries: list[StateEntry]) -> None:
        if entries:
            self._apply(await self._backend.put(entries))

    async def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key`` (decoded JSON, or bytes), or ``default``."""
        entry = self._entries.get(key)
        return default if entry is None else entry.value

    def entry(self, key: str) -> StateEntry | None:
        """The entry of ``key`` (value, stamp), or None."""
        return self._entries.get(key)

    def snapshot(self, prefix: str = "") -> dict[str, StateEntry]:
        """Every key (starting with ``prefix``) and its entry, now."""
        if not prefix:
            return dict(self._entries)
        return {k: e for k, e in self._entries.items() if k.startswith(prefix)}

    def __len__(self) -> int:
        return len(self._entries)

    async def watch(self, prefix: str = "", *, initial: bool = False) -> AsyncIterator[StateEntry]:
        """Every change of a key starting with ``prefix``, from now on (first the current
        entries, with ``initial``); a delete comes as an entry with ``deleted`` set. Ends when
        the table closes."""
        self._check()
        watch = _Watch(prefix, self.options.watch_queue)
        if initial:
            for current in self.snapshot(prefix).values():
                self._offer(watch, current)
        self._watches.append(watch)
        try:
            while (change := await watch.queue.get()) is not None:
                yield change
        finally:
            if watch in self._watches:
                self._watches.remove(watch)

    async def close(self) -> None:
        """Stop following the table and end every watcher; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._detach is not None:
            self._detach()
        for w in self._watches:
            if w.queue.full():
                w.queue.get_nowait()
            w.queue.put_nowait(None)
        await self._backend.close()

    def _close_soon(self) -> None:
        self._closing = asyncio.ensure_future(self.close())

    async def __aenter__(self) -> StateTable:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def open_state(bus: Bus, name: str, options: StateOptions | None = None) -> StateTable:
    """Open the state table ``name`` of ``bus``'s namespace, loaded with the latest value of
    every key.

    Raises:
        BusConfigError: Bad table name, or no backend serves the bus's engine.
        BusConnectionError: The store did not answer (Zenoh: no state service is running).
    """
    validate_table(name)
    opts = options or StateOptions()
    entry = _BACKENDS.get(bus.engine.name)
    if entry is None:
        raise BusConfigError(f"no state backend for the {bus.engine.name!r} engine")
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = _BACKENDS[bus.engine.name] = getattr(importlib.import_module(module), attr)
    table = StateTable(name, entry(bus, name, opts), opts)
    try:
        await table._load()
    except BaseException:
        await table.close()
        raise
    bus.add_close_callback(table._close_soon)
    table._detach = lambda: bus.remove_close_callback(table._close_soon)
    return table
