"""Time buckets: the event time and routing key of every sample."""

from __future__ import annotations

from dataclasses import dataclass

from embodied_bus.errors import BusConfigError

__all__ = ["DEFAULT_BUCKET_WIDTH_NS", "BucketClock"]

#: Default bucket width: 100 ms, one sweep of a 10 Hz lidar.
DEFAULT_BUCKET_WIDTH_NS = 100_000_000


@dataclass(frozen=True, slots=True)
class BucketClock:
    """Maps sensor stamps to time buckets: ``bucket = (stamp_ns - offset_ns) // width_ns``.

    Args:
        width_ns: Bucket width in nanoseconds (> 0).
        offset_ns: Phase offset in nanoseconds, ``0 <= offset_ns < width_ns``; shifts bucket
            boundaries, e.g. to put a lidar sweep in the middle of its bucket.
    """

    width_ns: int = DEFAULT_BUCKET_WIDTH_NS
    offset_ns: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.width_ns, int) or self.width_ns <= 0:
            raise BusConfigError(f"bucket width_ns must be a positive integer, got {self.width_ns!r}")
        if not isinstance(self.offset_ns, int) or not 0 <= self.offset_ns < self.width_ns:
            raise BusConfigError(
                f"bucket offset_ns must satisfy 0 <= offset_ns < width_ns ({self.width_ns}), "
                f"got {self.offset_ns!r}"
            )

    def bucket_of(self, stamp_ns: int) -> int:
        """Return the bucket id of a stamp in nanoseconds (floor division, also for negatives)."""
        return (stamp_ns - self.offset_ns) // self.width_ns

    def start_ns(self, bucket: int) -> int:
        """Return the first nanosecond of a bucket."""
        return bucket * self.width_ns + self.offset_ns

    def end_ns(self, bucket: int) -> int:
        """Return the first nanosecond after a bucket (exclusive end)."""
        return (bucket + 1) * self.width_ns + self.offset_ns
