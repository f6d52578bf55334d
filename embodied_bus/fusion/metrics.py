"""Metrics of a fusion pipeline: rates, completeness, presence, skew per stream, latency
percentiles and what the slow frames waited on. A figure that cannot be computed is None."""

from __future__ import annotations

import heapq
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from embodied_bus.fusion.frame import MultiModalFrame
from embodied_bus.fusion.spec import FusionSpec

__all__ = ["E2E_UNAVAILABLE", "SLOWEST_FRAMES", "FusionMetrics", "end_to_end_ms"]

#: Frames the percentiles are taken over (the most recent).
_WINDOW = 4096
#: Slowest frames named in the summary.
SLOWEST_FRAMES = 5
#: An end-to-end latency (emit - reference stamp) beyond this many seconds is not a latency:
#: the stamps are not on the wall clock (a recording replayed with its own stamps).
E2E_PLAUSIBLE_S = 60.0
#: What the summary says instead of end-to-end latencies that cannot be computed.
E2E_UNAVAILABLE = (
    "not available: the frames' sensor stamps are not on this host's wall clock "
    "(a recording replayed with its own stamps, or a sensor clock far off)"
)


def end_to_end_ms(emitted_ns: int, reference_stamp_ns: int) -> float | None:
    """Emit - reference stamp in ms, or None where the stamps are not on the wall clock."""
    ms = (emitted_ns - reference_stamp_ns) / 1e6
    return ms if abs(ms) <= E2E_PLAUSIBLE_S * 1e3 else None


def _pct(values: deque[float] | list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    p50, p99 = np.percentile(np.fromiter(list(values), dtype=float), [50, 99])
    return round(float(p50), 3), round(float(p99), 3)


@dataclass(order=True, frozen=True, slots=True)
class _Slow:
    added_ms: float
    reference_stamp_ns: int
    waited_on: str
    forced: bool


@dataclass
class FusionMetrics:
    """Pipeline metrics: rates, completeness, presence, skew and latency percentiles (ms)."""

    #: The reference stream's name.
    reference: str = ""
    started: float = field(default_factory=time.monotonic)
    frames: int = 0
    complete: int = 0
    late: int = 0
    dropped: int = 0
    jumps: int = 0
    #: Frames forced out by the lateness bound or an idle flush rather than on completion.
    forced: int = 0
    #: Frames whose reference sample was lost (anchored where it was due).
    reference_lost: int = 0
    presence: dict[str, int] = field(default_factory=dict)
    #: Per stream, each frame's largest |member stamp - reference stamp| (ms).
    skew_ms: dict[str, deque[float]] = field(default_factory=dict)
    #: Each frame's largest skew over its members besides the reference (ms).
    frame_skew_ms: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    added_ms: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    #: Added latency of the frames emitted on completion (not forced), ms.
    added_on_completion_ms: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    #: Frames by the stream they waited on last.
    waited_on: Counter[str] = field(default_factory=Counter)
    #: The slowest frames (added latency), kept to name them.
    slowest: list[_Slow] = field(default_factory=list)
    e2e_ms: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    #: Frames whose end-to-end latency cannot be computed (see :data:`E2E_UNAVAILABLE`).
    e2e_unavailable: int = 0

    @classmethod
    def for_spec(cls, spec: FusionSpec) -> FusionMetrics:
        """Metrics of a pipeline running ``spec``."""
        return cls(
            reference=spec.reference.name,
            skew_ms={s.name: deque(maxlen=_WINDOW) for s in spec.streams if s is not spec.reference},
        )

    def record(self, frame: MultiModalFrame, emitted_ns: int) -> None:
        self.frames += 1
        self.complete += frame.complete
        for name, ms in frame.members.items():
            self.presence[name] = self.presence.get(name, 0) + 1
            per_stream = self.skew_ms.get(name)
            if per_stream is not None and ms:
                per_stream.append(max(abs(m.skew_ns) for m in ms) / 1e6)
        if frame.max_skew_ns is not None:
            self.frame_skew_ms.append(frame.max_skew_ns / 1e6)
        if frame.forced:
            self.forced += 1
        if self.reference in frame.missing:
            self.reference_lost += 1
        if frame.waited_on:
            self.waited_on[frame.waited_on] += 1
        if frame.last_arrival_ns:
            added_ms = (emitted_ns - frame.last_arrival_ns) / 1e6
            self.added_ms.append(added_ms)
            if not frame.forced:
                self.added_on_completion_ms.append(added_ms)
            slow = _Slow(round(added_ms, 3), frame.reference_stamp_ns, frame.waited_on or "", frame.forced)
            if len(self.slowest) < SLOWEST_FRAMES:
                heapq.heappush(self.slowest, slow)
            elif slow > self.slowest[0]:
                heapq.heapreplace(self.slowest, slow)
        e2e = end_to_end_ms(emitted_ns, frame.reference_stamp_ns)
        if e2e is None:
            self.e2e_unavailable += 1
        else:
            self.e2e_ms.append(e2e)

    def as_dict(self) -> dict[str, Any]:
        elapsed = max(1e-9, time.monotonic() - self.started)
        skew = _pct(self.frame_skew_ms)
        added = _pct(self.added_ms)
        on_completion = _pct(self.added_on_completion_ms)
        e2e = _pct(self.e2e_ms)
        per_stream = {name: _pct(v) for name, v in sorted(self.skew_ms.items())}
        return {
            "frames": self.frames,
            "frames_per_s": round(self.frames / elapsed, 2),
            "completeness_pct": round(100 * self.complete / self.frames, 2) if self.frames else None,
            "presence_pct": {k: round(100 * v / self.frames, 2) for k, v in sorted(self.presence.items())}
            if self.frames
            else {},
            "reference_lost": self.reference_lost,
            "skew_p50_ms": skew[0],
            "skew_p99_ms": skew[1],
            "skew_ms_by_stream": {name: {"p50": p[0], "p99": p[1]} for name, p in per_stream.items()},
            "added_latency_p50_ms": added[0],
            "added_latency_p99_ms": added[1],
            "added_latency_on_completion_p50_ms": on_completion[0],
            "added_latency_on_completion_p99_ms": on_completion[1],
            "waited_on": dict(self.waited_on.most_common()),
            "slowest_frames": [
                {
                    "reference_stamp_ns": s.reference_stamp_ns,
                    "added_latency_ms": s.added_ms,
                    "waited_on": s.waited_on or None,
                    "forced": s.forced,
                }
                for s in sorted(self.slowest, reverse=True)
            ],
            "forced": self.forced,
            "end_to_end_p50_ms": e2e[0],
            "end_to_end_p99_ms": e2e[1],
            **({"end_to_end": E2E_UNAVAILABLE} if self.e2e_unavailable and not self.e2e_ms else {}),
            "late": self.late,
            "dropped_incomplete": self.dropped,
            "stamp_jumps": self.jumps,
        }
