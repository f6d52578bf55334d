"""Engines by URL scheme.

A bus URL's scheme picks the engine: ``zenoh:`` the Zenoh engine, ``pulsar://`` and
``pulsar+ssl://`` the Pulsar engine. Each entry is ``module:attribute`` (imported on first use,
so an engine's client library is only needed where it is used) or the opener itself.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from embodied_bus.engines.base import Engine
from embodied_bus.errors import BusConfigError

__all__ = ["EngineOpener", "EngineSettings", "open_engine", "register_engine", "schemes"]


class EngineSettings(Protocol):
    """What every engine's settings say (see :mod:`embodied_bus.engines.urls`)."""

    @property
    def scheme(self) -> str:
        """The URL scheme that picks the engine."""
        ...

    @property
    def namespace(self) -> str:
        """Robot namespace of the bus."""
        ...


#: Opens an engine from its settings.
EngineOpener = Callable[[Any], Awaitable[Engine]]

_OPENERS: dict[str, str | EngineOpener] = {
    "zenoh": "embodied_bus.engines.zenoh.engine:ZenohEngine.open",
    "pulsar": "embodied_bus.engines.pulsar.engine:PulsarEngine.open",
    "pulsar+ssl": "embodied_bus.engines.pulsar.engine:PulsarEngine.open",
}


def register_engine(scheme: str, opener: str | EngineOpener) -> None:
    """Open buses whose URL has ``scheme`` with ``opener`` (``module:attribute`` or callable)."""
    _OPENERS[scheme.lower()] = opener


def schemes() -> list[str]:
    """The URL schemes an engine is registered for."""
    return sorted(_OPENERS)


def _resolve(entry: str) -> EngineOpener:
    module, _, path = entry.partition(":")
    target: Any = importlib.import_module(module)
    for name in path.split("."):
        target = getattr(target, name)
    opener: EngineOpener = target
    return opener


async def open_engine(settings: EngineSettings) -> Engine:
    """Open the engine of ``settings.scheme`` (imports only that engine's client).

    Raises:
        BusConfigError: No engine is registered for the scheme.
    """
    scheme = settings.scheme
    entry = _OPENERS.get(scheme)
    if entry is None:
        raise BusConfigError(f"no engine for bus URL scheme {scheme!r}; known: {', '.join(schemes())}")
    if isinstance(entry, str):
        entry = _OPENERS[scheme] = _resolve(entry)
    return await entry(settings)
