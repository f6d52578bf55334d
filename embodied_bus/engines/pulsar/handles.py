"""Closing Pulsar clients, producers, consumers and readers, bounded in time."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

import pulsar

from embodied_bus.engines.blocking import call_bounded
from embodied_bus.engines.pulsar.tuning import CLOSE_TIMEOUT_S
from embodied_bus.engines.urls import PulsarSettings

_logger = logging.getLogger("embodied_bus.pulsar")


class PulsarConnection(Protocol):
    """What the engine's parts need of it: its settings, its client, and whether it closed."""

    @property
    def settings(self) -> PulsarSettings:
        """Where and how the client connects."""
        ...

    @property
    def client(self) -> pulsar.Client:
        """The open Pulsar client."""
        ...

    @property
    def closed(self) -> bool:
        """Whether the engine (its client and every handle of it) is closed."""
        ...


def resolve_future(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def close_handle(handle: Any, engine: PulsarConnection | None = None) -> None:
    """Close a Pulsar client, producer, consumer or reader, bounded by :data:`CLOSE_TIMEOUT_S`.

    Errors (already closed, broker gone) and a close that does not finish are logged at debug level
    and otherwise ignored: the caller is shutting down. With the ``engine`` the handle belongs
    to, nothing is done once that engine is closed: closing its client closed the handle, and
    closing it again only makes the C++ client log an error (e.g. an executor that stops after
    its bus was closed under it).
    """
    if engine is not None and engine.closed:
        return
    try:
        await call_bounded(handle.close, CLOSE_TIMEOUT_S, name="eb-pulsar-close")
    except (pulsar.PulsarException, TimeoutError, ValueError) as err:  # ValueError: closed before
        _logger.debug("close did not finish: %s", err or type(err).__name__)
