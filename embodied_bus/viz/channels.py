"""One Foxglove channel fed from the bus: encode only what a viewer watches, latest wins.

A :class:`ViewChannel` takes items (a sample, a frame status...) as they arrive and keeps, per
channel, the newest ones not yet forwarded, bounded in count and bytes: when the view falls
behind, the oldest pending item of that channel is dropped and counted, so a slow viewer or a
slow conversion never holds the bus. Nothing is encoded while no viewer subscribes.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from embodied_bus.viz.messages import ChannelSchema

__all__ = ["ChannelCounts", "PendingLimits", "ViewChannel"]

_log = logging.getLogger("embodied_bus.viz")


@dataclass(frozen=True, slots=True)
class PendingLimits:
    """How much one channel keeps while the view is behind.

    Attributes:
        max_items: Items not yet forwarded, at most.
        max_bytes: Their payload bytes, at most (one item is always kept).
        max_rate_hz: Messages per second sent on one channel, at most (0: no limit); faster
            streams are thinned to the newest item per interval (a screen shows no more, and
            every message sent costs the viewer's host CPU).
    """

    max_items: int = 256
    max_bytes: int = 4 * 1024 * 1024
    max_rate_hz: float = 500.0


@dataclass(slots=True)
class ChannelCounts:
    """What a channel did with the items offered to it.

    Attributes:
        forwarded: Sent to the viewers.
        dropped: Replaced by newer items before they could be sent (the view was behind, or
            the stream is faster than ``max_rate_hz``).
        failed: Could not be encoded (the reason is logged and shown to viewers once).
        unwatched: Arrived while no viewer subscribed (not encoded).
    """

    forwarded: int = 0
    dropped: int = 0
    failed: int = 0
    unwatched: int = 0


@dataclass(frozen=True, slots=True)
class _Pending:
    time_ns: int
    size: int
    encode: Callable[[], bytes]


class ViewChannel:
    """A Foxglove channel with its pending items and counts.

    Args:
        topic: Channel topic (``/lidar/top``, ``/fused/status``).
        schema: What the channel advertises.
        context: The ``foxglove.Context`` of the server it belongs to.
        limits: Pending bounds.
        on_failure: Called once with the first encoding error's text (e.g. to tell viewers).
    """

    def __init__(
        self,
        topic: str,
        schema: ChannelSchema,
        context: Any,
        limits: PendingLimits,
        on_failure: Callable[[str, str], None] | None = None,
    ) -> None:
        import foxglove

        self.topic = topic
        self.schema = schema
        self._channel = foxglove.Channel(
            topic,
            schema=foxglove.Schema(name=schema.name, encoding=schema.encoding, data=schema.data),
            message_encoding=schema.message_encoding,
            context=context,
        )
        self._limits = limits
        self._pending: deque[_Pending] = deque()
        self._pending_bytes = 0
        self._on_failure = on_failure
        self._failure_told = False
        self._interval_s = 1.0 / limits.max_rate_hz if limits.max_rate_hz > 0 else 0.0
        self._last_sent_s = -1e18
        self.counts = ChannelCounts()

    @property
    def watched(self) -> bool:
        """Whether a viewer subscribes to this channel."""
        return bool(self._channel.has_sinks())

    def offer(self, time_ns: int, size: int, encode: Callable[[], bytes]) -> bool:
        """Keep an item for the next :meth:`flush` if a viewer watches; returns whether kept.

        Args:
            time_ns: The message time viewers see (the sensor stamp), UTC nanoseconds.
            size: Its payload size in bytes (for the pending bound).
            encode: Makes the message bytes, called only when it is sent.
        """
        if not self.watched:
            self.counts.unwatched += 1
            return False
        self._pending.append(_Pending(time_ns, size, encode))
        self._pending_bytes += size
        while len(self._pending) > 1 and (
            len(self._pending) > self._limits.max_items or self._pending_bytes > self._limits.max_bytes
        ):
            self._pending_bytes -= self._pending.popleft().size
            self.counts.dropped += 1
        return True

    @property
    def pending(self) -> int:
        """Items waiting for :meth:`flush`."""
        return len(self._pending)

    def flush(self, now_s: float) -> None:
        """Encode and send what is pending, oldest first, within the rate limit; past it only
        the newest item stays pending (``now_s``: a monotonic clock, seconds)."""
        while self._pending:
            if now_s - self._last_sent_s < self._interval_s:
                while len(self._pending) > 1:
                    self._pending_bytes -= self._pending.popleft().size
                    self.counts.dropped += 1
                return
            item = self._pending.popleft()
            self._pending_bytes -= item.size
            try:
                data = item.encode()
            except Exception as err:  # any bad payload is counted, never fatal
                self._failed(err)
                continue
            self._channel.log(data, log_time=item.time_ns)
            self._last_sent_s = now_s
            self.counts.forwarded += 1

    def _failed(self, err: Exception) -> None:
        self.counts.failed += 1
        if self._failure_told:
            return
        self._failure_told = True
        why = f"{type(err).__name__}: {err}"
        _log.warning("cannot show %s: %s", self.topic, why)
        if self._on_failure is not None:
            self._on_failure(self.topic, why)

    def close(self) -> None:
        """Unadvertise the channel."""
        self._channel.close()
