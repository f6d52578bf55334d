"""The reference stream's real cadence, learned from its stamps, and the samples it lost.

A sensor does not keep its nominal period (a lidar at 10.03 Hz, stamps jittering by a few
milliseconds), so a lost reference sample is judged from the stream's own recent intervals,
never from a fixed grid: the period is the median of its last :data:`INTERVALS` intervals
(the nominal period until :data:`MIN_INTERVALS` are known), and a gap longer than
:data:`GAP_FACTOR` periods lost ``round(gap / period) - 1`` samples, placed one period apart
after the last sample seen. The online assembler and the offline computation share these
rules, so both anchor the same frames.
"""

from __future__ import annotations

from collections import deque

__all__ = ["GAP_FACTOR", "INTERVALS", "MIN_INTERVALS", "Cadence", "lost_anchors"]

#: Intervals the period is the median of.
INTERVALS = 8
#: Intervals needed before the learned period replaces the nominal one.
MIN_INTERVALS = 3
#: A gap longer than this many periods lost at least one sample.
GAP_FACTOR = 1.5


def lost_anchors(last_ns: int, next_ns: int, period_ns: int) -> list[int]:
    """Stamps of the samples lost between two consecutive reference samples (ns)."""
    gap = next_ns - last_ns
    if gap <= GAP_FACTOR * period_ns:
        return []
    n = round(gap / period_ns) - 1
    return [last_ns + k * period_ns for k in range(1, n + 1)]


class Cadence:
    """The period of a stream, learned from consecutive stamps.

    Args:
        nominal_ns: The expected period, used until enough intervals are known.
    """

    __slots__ = ("_intervals", "_last_ns", "nominal_ns")

    def __init__(self, nominal_ns: int) -> None:
        self.nominal_ns = nominal_ns
        self._intervals: deque[int] = deque(maxlen=INTERVALS)
        self._last_ns: int | None = None

    def observe(self, stamp_ns: int) -> None:
        """Add the next stamp of the stream (in stamp order)."""
        if self._last_ns is not None and stamp_ns > self._last_ns:
            self._intervals.append(stamp_ns - self._last_ns)
        self._last_ns = stamp_ns

    def reset(self) -> None:
        """Forget the stamps seen (the stream restarted)."""
        self._intervals.clear()
        self._last_ns = None

    @property
    def period_ns(self) -> int:
        """The learned period (the lower median of the recent intervals), or the nominal one."""
        if len(self._intervals) < MIN_INTERVALS:
            return self.nominal_ns
        ordered = sorted(self._intervals)
        return ordered[(len(ordered) - 1) // 2]
