"""Rate gates: forward at most N samples a second of a stream, by sensor stamp."""

from __future__ import annotations

__all__ = ["RateGate"]


class RateGate:
    """Keeps samples at most ``rate_hz`` apart on average (None: every one), and at
    ``down_rate_hz`` while the link is degraded (0: none). Decided by sensor stamp, so a
    recording replayed gives the same samples; a jittering or drifting source keeps its
    average rate (a kept sample is due one period after the last one was due, not after it
    came)."""

    def __init__(self, rate_hz: float | None, down_rate_hz: float | None = None) -> None:
        self._period_ns = _period_ns(rate_hz)
        self._down_period_ns = self._period_ns if down_rate_hz is None else _period_ns(down_rate_hz)
        self._due_ns: int | None = None

    def keep(self, stamp_ns: int, *, degraded: bool = False) -> bool:
        """Whether to forward the sample stamped ``stamp_ns``."""
        period = self._down_period_ns if degraded else self._period_ns
        if period is None:
            return True
        if period < 0:  # a rate of 0: nothing
            return False
        due = self._due_ns
        if due is not None and stamp_ns < due:
            return False
        # due one period after the last due time; a long silence (or a stamp jump back) restarts
        self._due_ns = due + period if due is not None and stamp_ns - due < period else stamp_ns + period
        return True


def _period_ns(rate_hz: float | None) -> int | None:
    if rate_hz is None:
        return None
    if rate_hz == 0:
        return -1
    return round(1e9 / rate_hz)
