"""What the Zenoh engine's publishers, subscribers and groups need of it."""

from __future__ import annotations

from typing import Protocol

import zenoh

from embodied_bus.engines.urls import ZenohSettings

__all__ = ["ZenohConnection"]


class ZenohConnection(Protocol):
    """An open Zenoh engine as its parts see it."""

    @property
    def settings(self) -> ZenohSettings:
        """Where and how the session connects."""
        ...

    @property
    def session(self) -> zenoh.Session:
        """The open Zenoh session."""
        ...

    @property
    def shm_enabled(self) -> bool:
        """Whether large payloads go through shared memory by default."""
        ...
