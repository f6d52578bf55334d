"""Per-stream statistics: rate, bandwidth, gaps and latency."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from embodied_bus.streams.tracker import SequenceTracker, Verdict

__all__ = ["LATENCY_WINDOW", "RATE_WINDOW_S", "SNAPSHOT_S", "StreamStats"]

#: Number of most recent latencies kept for percentiles.
LATENCY_WINDOW = 2048
#: Sliding window for rates, in seconds.
RATE_WINDOW_S = 2.0
#: Spacing of the rate snapshots, in seconds.
SNAPSHOT_S = 0.1


@dataclass(slots=True)
class StreamStats:
    """Counters of one stream as seen by one subscription.

    Attributes:
        received: Samples that reached the subscription (before de-duplication).
        delivered: Samples handed to the application.
        dropped: Samples discarded by a full ``drop_oldest`` buffer.
        bytes: Payload bytes received.
    """

    stream: str
    received: int = 0
    delivered: int = 0
    dropped: int = 0
    bytes: int = 0
    seq: SequenceTracker = field(default_factory=SequenceTracker)
    _latencies_ns: deque[int] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    #: Runs accounted by :meth:`observe_run`: (receive time, the samples' publish times), UTC
    #: ns; their latencies are computed only when asked for. The oldest runs are let go once the
    #: newer ones hold :data:`LATENCY_WINDOW` samples.
    _latency_runs: deque[tuple[int, Sequence[int]]] = field(default_factory=deque)
    _latency_run_samples: int = 0
    #: (monotonic s, received, bytes) snapshots, one per :data:`SNAPSHOT_S` at most.
    _snaps: deque[tuple[float, int, int]] = field(default_factory=deque)

    @property
    def latency_run_samples(self) -> int:
        """Samples whose latencies the kept runs hold (bounded by about :data:`LATENCY_WINDOW`)."""
        return self._latency_run_samples

    def observe(self, publisher_id: int, seq: int, size: int, latency_ns: int) -> Verdict:
        """Account one received sample; returns its sequence verdict."""
        self.received += 1
        self.bytes += size
        self._latencies_ns.append(latency_ns)
        self._snapshot()
        return self.seq.observe(publisher_id, seq)

    def observe_run(
        self,
        publisher_id: int,
        first_seq: int,
        sizes: Sequence[int],
        receive_ns: int,
        publish_ns: Sequence[int],
    ) -> bool:
        """Account samples of one publisher with consecutive sequence numbers from ``first_seq``
        as :meth:`observe` would one by one, if all of them come after the last one seen from
        that publisher (so none is a duplicate or late); else do nothing and return False.

        Args:
            publisher_id: Their publisher.
            first_seq: The first one's sequence number.
            sizes: Their payload sizes in bytes.
            receive_ns: When they arrived, UTC ns (one time for all).
            publish_ns: Their publish times, UTC ns (kept as given: don't change it after).
        """
        n = len(sizes)
        if not self.seq.advance_run(publisher_id, first_seq, first_seq + n - 1):
            return False
        self.received += n
        self.bytes += sum(sizes)
        runs = self._latency_runs
        runs.append((receive_ns, publish_ns))
        kept = self._latency_run_samples + n
        while kept - len(runs[0][1]) >= LATENCY_WINDOW:
            kept -= len(runs.popleft()[1])
        self._latency_run_samples = kept
        self._snapshot()
        return True

    def _snapshot(self) -> None:
        """Record (now, received, bytes) for rates, at most once per :data:`SNAPSHOT_S`."""
        now = time.monotonic()
        snaps = self._snaps
        if not snaps or now - snaps[-1][0] >= SNAPSHOT_S:
            snaps.append((now, self.received, self.bytes))
            while now - snaps[0][0] > RATE_WINDOW_S:
                snaps.popleft()

    def _window(self) -> tuple[float, int, int]:
        now = time.monotonic()
        snaps = self._snaps
        while snaps and now - snaps[0][0] > RATE_WINDOW_S:
            snaps.popleft()
        if not snaps:
            return (0.0, 0, 0)
        t0, n0, b0 = snaps[0]
        return (now - t0, self.received - n0, self.bytes - b0)

    def rate_hz(self) -> float:
        """Samples per second over about the last :data:`RATE_WINDOW_S` seconds."""
        span, n, _ = self._window()
        return n / span if span > 0.05 else 0.0

    def bandwidth_bps(self) -> float:
        """Payload bytes per second over about the last :data:`RATE_WINDOW_S` seconds."""
        span, _, b = self._window()
        return b / span if span > 0.05 else 0.0

    def latency_percentiles_ms(self) -> tuple[float, float]:
        """Publish-to-receive latency (p50, p99) in milliseconds over recent samples: the last
        :data:`LATENCY_WINDOW` accounted one by one and the last runs that hold at least as many."""
        latencies = list(self._latencies_ns)
        for receive_ns, publish_ns in list(self._latency_runs):
            latencies.extend(map(receive_ns.__sub__, publish_ns))
        if not latencies:
            return (float("nan"), float("nan"))
        arr = np.fromiter(latencies, dtype=np.int64) / 1e6
        p50, p99 = np.percentile(arr, [50, 99])
        return (float(p50), float(p99))

    def as_dict(self) -> dict[str, object]:
        """A JSON-ready summary."""
        p50, p99 = self.latency_percentiles_ms()
        return {
            "stream": self.stream,
            "received": self.received,
            "delivered": self.delivered,
            "rate_hz": round(self.rate_hz(), 2),
            "bandwidth_MBps": round(self.bandwidth_bps() / 1e6, 3),
            "gaps": self.seq.gaps,
            "missing": self.seq.missing,
            "out_of_order": self.seq.out_of_order,
            "duplicates": self.seq.duplicates,
            "dropped": self.dropped,
            "latency_p50_ms": None if p50 != p50 else round(p50, 3),
            "latency_p99_ms": None if p99 != p99 else round(p99, 3),
        }
