"""Feedback on a queue service's topics, and who may send it.

``actions/fb/<id>`` carries ``{"executor": <name>, "attempt": <n>, "data": <JSON>}``, sealed by
the executor where the queue is sealed. A planner that checks seals believes feedback only from
the executor holding the action's current attempt: the sealing key must act as that executor,
and the queue (asked once per attempt) must say that attempt is the action's running one. Any
other executor's key, or the holder of an earlier attempt, is refused and logged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from embodied_bus.actions.model import Action
from embodied_bus.security.allowlist import AllowedKey

__all__ = ["FeedbackEnvelope", "HolderGate", "decode_feedback", "encode_feedback"]

_log = logging.getLogger("embodied_bus.actions")


class FeedbackEnvelope(msgspec.Struct, frozen=True):
    """One feedback message: the executor and attempt it comes from, and its JSON."""

    executor: str
    attempt: int
    data: msgspec.Raw


_DECODER = msgspec.json.Decoder(FeedbackEnvelope)


def encode_feedback(executor: str, attempt: int, data: bytes) -> bytes:
    """The envelope of ``data`` (JSON bytes) sent by ``executor`` for ``attempt``."""
    return msgspec.json.encode(FeedbackEnvelope(executor, attempt, msgspec.Raw(data)))


def decode_feedback(body: bytes) -> FeedbackEnvelope:
    """An envelope from its bytes.

    Raises:
        msgspec.DecodeError, msgspec.ValidationError: It is not one.
    """
    return _DECODER.decode(body)


class HolderGate:
    """Passes one action's feedback on (in arrival order) only from its lease holder.

    Args:
        action_id: The action.
        lookup: The action as the queue has it now.
        deliver: Called with each believed feedback's data (decoded JSON), on the loop.
    """

    def __init__(
        self,
        action_id: str,
        lookup: Callable[[str], Awaitable[Action | None]],
        deliver: Callable[[Any], None],
    ) -> None:
        self.action_id = action_id
        self._lookup = lookup
        self._deliver = deliver
        self._inbox: asyncio.Queue[tuple[FeedbackEnvelope, AllowedKey]] = asyncio.Queue()
        self._holder: tuple[str, int] | None = None
        self._refused: set[tuple[str, int]] = set()
        #: Feedback messages refused (not from the holder of the running attempt).
        self.refused = 0
        self._task = asyncio.create_task(self._run())

    def offer(self, envelope: FeedbackEnvelope, sender: AllowedKey) -> None:
        """A feedback message opened from ``sender``'s seal (loop thread)."""
        self._inbox.put_nowait((envelope, sender))

    async def _run(self) -> None:
        while True:
            envelope, sender = await self._inbox.get()
            if await self._from_holder(envelope, sender):
                try:
                    self._deliver(msgspec.json.decode(envelope.data))
                except msgspec.DecodeError:
                    _log.debug("feedback of %s is not JSON", self.action_id)

    async def _from_holder(self, envelope: FeedbackEnvelope, sender: AllowedKey) -> bool:
        claimed = (envelope.executor, envelope.attempt)
        if not sender.acts_as(envelope.executor):
            return self._refuse(f"key {sender.name} may not act as executor {envelope.executor!r}")
        if claimed == self._holder:
            return True
        if claimed in self._refused or (self._holder is not None and envelope.attempt < self._holder[1]):
            return self._refuse(None)
        try:
            action = await self._lookup(self.action_id)
        except Exception as err:  # the queue is away: believe nothing it did not confirm
            _log.debug("feedback of %s not confirmed: %s", self.action_id, err)
            return False
        last = action.attempts[-1] if action is not None and action.attempts else None
        if last is None or (last.executor, last.number) != claimed or last.ended_ns:
            self._refused.add(claimed)
            return self._refuse(f"executor {envelope.executor!r} does not hold attempt {envelope.attempt}")
        self._holder = claimed
        return True

    def _refuse(self, why: str | None) -> bool:
        self.refused += 1
        if why is not None:
            _log.warning("refused feedback of action %s: %s", self.action_id, why)
        return False

    def close(self) -> None:
        """Stop passing feedback on."""
        self._task.cancel()
