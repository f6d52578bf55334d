"""The state service: latest values per key of a namespace, served on a Zenoh bus from a
:class:`~embodied_bus.state.store.StateStore`.

``embodied-bus queue`` hosts one beside the action queue; ``embodied-bus state serve`` hosts
one alone. It answers puts and reads on the ``state`` service and sends every stored write,
in revision order, on the ``state/<table>`` topic, where the tables' readers keep their copies.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from pathlib import Path

from embodied_bus.bus import Bus
from embodied_bus.engines.capabilities import notifications, request_reply
from embodied_bus.errors import EmbodiedBusError
from embodied_bus.state.codec import (
    OP_PUT,
    OP_SINCE,
    decode_entries,
    decode_request,
    encode_entries,
    encode_error,
    encode_reply,
)
from embodied_bus.state.model import validate_key, validate_table
from embodied_bus.state.store import StateStore

__all__ = ["SERVICE", "StateService", "change_topic"]

_log = logging.getLogger("embodied_bus.state")
#: Request/reply service name of the state service.
SERVICE = "state"


def change_topic(table: str) -> str:
    """The topic the service sends ``table``'s writes on."""
    return f"state/{table}"


class StateService:
    """Serves the state tables of a namespace on a bus.

    Args:
        bus: The bus to serve on (Zenoh).
        db_path: SQLite file (WAL, fsync on commit).
    """

    def __init__(self, bus: Bus, db_path: str | Path) -> None:
        self.bus = bus
        self.store = StateStore(db_path)
        #: Requests answered with an error (malformed or invalid).
        self.bad_requests = 0
        self._lock = threading.Lock()
        self._changes: queue.SimpleQueue[tuple[str, bytes] | None] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_changes, name="eb-state-send", daemon=True)

    def handle(self, data: bytes) -> bytes:
        """Answer one request (called from engine threads)."""
        try:
            request = decode_request(data)
            validate_table(request.table)
            if request.op == OP_PUT:
                entries = decode_entries(request.body)
                for entry in entries:
                    validate_key(entry.key)
                with self._lock:  # writes go out in the order of their revisions
                    stored = self.store.put(request.table, entries)
                    if stored:
                        self._changes.put((change_topic(request.table), encode_entries(stored)))
                return encode_reply(stored[0].revision if stored else self.store.revision(request.table))
            if request.op == OP_SINCE and len(request.body) == 8:
                revision, found = self.store.since(request.table, int.from_bytes(request.body, "little"))
                return encode_reply(revision, encode_entries(found))
            raise EmbodiedBusError(f"unknown state request {request.op}")
        except EmbodiedBusError as err:
            self.bad_requests += 1
            _log.warning("state request refused: %s", err)
            return encode_error(str(err))

    def _send_changes(self) -> None:
        while (item := self._changes.get()) is not None:
            try:
                notifications(self.bus.engine, "the state service").notify(*item, block=True)
            except EmbodiedBusError as err:  # closing: readers catch up from the store
                _log.debug("%s not sent: %s", item[0], err)

    async def run(self, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        """Serve until ``stop``."""
        self._sender.start()
        handle = request_reply(self.bus.engine, "the state service").serve(SERVICE, self.handle)
        if ready is not None:
            ready.set()
        try:
            await stop.wait()
        finally:
            handle.undeclare()
            self._changes.put(None)
            await asyncio.to_thread(self._sender.join, 5.0)
            self.store.close()
