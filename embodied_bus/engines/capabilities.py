"""What an engine offers beyond streams, each declared by the engine that has it.

:class:`~embodied_bus.engines.base.Engine` covers streams. Request/reply, lightweight
notifications and group membership are separate capabilities: an engine declares each it has
by inheriting it, and a part that needs one asks for it (:func:`request_reply`,
:func:`notifications`, :func:`membership`), which names
what was missing instead of failing deep inside a call.

========================  =====  ======
capability                zenoh  pulsar
========================  =====  ======
:class:`RequestReply`     yes    no
:class:`Notifications`    yes    no
:class:`Membership`       yes    yes (heartbeats on a topic)
========================  =====  ======
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

from embodied_bus.engines.base import Engine, GroupMembership, MembershipCallback
from embodied_bus.errors import BusConfigError

__all__ = [
    "Membership",
    "Notifications",
    "RequestReply",
    "membership",
    "notifications",
    "request_reply",
]


class RequestReply(abc.ABC):
    """Named services answering requests (a queue service, a state service)."""

    #: What the capability is called in errors.
    label = "request/reply"

    @abc.abstractmethod
    def serve(self, name: str, handler: Callable[[bytes], bytes]) -> Any:
        """Answer requests on ``name`` with ``handler`` (called from engine threads); returns a
        handle with ``undeclare()``."""

    @abc.abstractmethod
    async def request(
        self, name: str, payload: bytes, timeout_s: float, accept: Callable[[bytes], bool] | None = None
    ) -> bytes | None:
        """Ask the service ``name``; None if nobody answered within ``timeout_s`` seconds.

        ``accept`` (e.g. a seal check) makes the request go to every server of ``name`` and
        returns the first answer it accepts: a stand-in that answers first, or instead of the
        real server, does not keep the request from it."""


class Notifications(abc.ABC):
    """Fire-and-forget messages on lightweight topics (no header, no sequence)."""

    label = "lightweight topics"

    @abc.abstractmethod
    def notify(self, topic: str, payload: bytes, *, block: bool = False) -> None:
        """Send ``payload`` on ``topic``.

        Args:
            block: Wait for room when the transport is congested instead of dropping.
        """

    @abc.abstractmethod
    def listen(self, topic: str, callback: Callable[[str, bytes], None]) -> Any:
        """Receive ``notify`` messages (``topic`` may end in ``/**``); returns a handle with
        ``undeclare()``; the callback gets (topic, payload) on an engine thread."""


class Membership(abc.ABC):
    """Groups whose members see each other's liveness."""

    label = "group membership"

    @abc.abstractmethod
    async def watch_group(self, group: str, on_change: MembershipCallback) -> GroupMembership:
        """Watch a group; call :meth:`GroupMembership.announce` to join it. A member that
        crashes leaves the group when its session is lost (or its heartbeats stop)."""


def _require(engine: Engine, capability: type, needed_by: str) -> None:
    if not isinstance(engine, capability):
        label = capability.label  # type: ignore[attr-defined]
        raise BusConfigError(
            f"{needed_by} needs {label}, which the {engine.name} engine does not have (use a zenoh: bus URL)"
        )


def request_reply(engine: Engine, needed_by: str) -> RequestReply:
    """``engine``'s request/reply.

    Raises:
        BusConfigError: The engine has none; the message names it and what ``needed_by``.
    """
    _require(engine, RequestReply, needed_by)
    return engine  # type: ignore[return-value]


def notifications(engine: Engine, needed_by: str) -> Notifications:
    """``engine``'s lightweight topics.

    Raises:
        BusConfigError: The engine has none; the message names it and what ``needed_by``.
    """
    _require(engine, Notifications, needed_by)
    return engine  # type: ignore[return-value]


def membership(engine: Engine, needed_by: str) -> Membership:
    """``engine``'s group membership.

    Raises:
        BusConfigError: The engine has none; the message names it and what ``needed_by``.
    """
    _require(engine, Membership, needed_by)
    return engine  # type: ignore[return-value]
