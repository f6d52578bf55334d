"""Metrics of a fusion pipeline: rates, completeness, presence, skew and latency percentiles."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from embodied_bus.fusion.frame import MultiModalFrame
from embodied_bus.fusion.spec import FusionSpec, Pick, Role

__all__ = ["E2E_UNAVAILABLE", "FusionMetrics", "end_to_end_ms"]

#: Frames the percentiles are taken over (the most recent).
_WINDOW = 4096
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


def _pct(values: deque[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    p50, p99 = np.percentile(np.fromiter(list(values), dtype=float), [50, 99])
    return round(float(p50), 3), round(float(p99), 3)


@dataclass
class FusionMetrics:
    """Pipeline metrics: rates, completeness, presence, skew and latency percentiles (ms)."""

    started: float = field(default_factory=time.monotonic)
    frames: int = 0
    complete: int = 0
    late: int = 0
    dropped: int = 0
    jumps: int = 0
    #: Frames forced out by the lateness bound or an idle flush rather than on completion.
    forced: int = 0
    presence: dict[str, int] = field(default_factory=dict)
    #: Whether the spec has a nearest- or latest-picked input besides the reference (the skew
    #: is taken over those; without one it is None, not a misleading 0).
    skew_tracked: bool = True
    skew_ms: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    added_ms: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    #: Added latency of the frames emitted on completion (not forced), ms.
    added_on_completion_ms: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    e2e_ms: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    #: Frames whose end-to-end latency cannot be computed (see :data:`E2E_UNAVAILABLE`).
    e2e_unavailable: int = 0

    @classmethod
    def for_spec(cls, spec: FusionSpec) -> FusionMetrics:
        """Metrics of a pipeline running ``spec``."""
        return cls(
            skew_tracked=any(
                s.role is not Role.REFERENCE and s.pick in (Pick.NEAREST, Pick.LATEST) for s in spec.streams
            )
        )

    def record(self, frame: MultiModalFrame, emitted_ns: int) -> None:
        self.frames += 1
        self.complete += frame.complete
        for name in frame.members:
            self.presence[name] = self.presence.get(name, 0) + 1
        if self.skew_tracked and frame.skew_measured:  # else 0 by definition, not a measurement
            self.skew_ms.append(frame.max_skew_ns / 1e6)
        if frame.forced:
            self.forced += 1
        if frame.last_arrival_ns:
            added_ms = (emitted_ns - frame.last_arrival_ns) / 1e6
            self.added_ms.append(added_ms)
            if not frame.forced:
                self.added_on_completion_ms.append(added_ms)
        e2e = end_to_end_ms(emitted_ns, frame.reference_stamp_ns)
        if e2e is None:
            self.e2e_unavailable += 1
        else:
            self.e2e_ms.append(e2e)

    def as_dict(self) -> dict[str, Any]:
        elapsed = max(1e-9, time.monotonic() - self.started)
        skew = _pct(self.skew_ms)
        added = _pct(self.added_ms)
        on_completion = _pct(self.added_on_completion_ms)
        e2e = _pct(self.e2e_ms)
        return {
            "frames": self.frames,
            "frames_per_s": round(self.frames / elapsed, 2),
            "completeness_pct": round(100 * self.complete / self.frames, 2) if self.frames else None,
            "presence_pct": {k: round(100 * v / self.frames, 2) for k, v in sorted(self.presence.items())}
            if self.frames
            else {},
            "skew_p50_ms": skew[0],
            "skew_p99_ms": skew[1],
            "added_latency_p50_ms": added[0],
            "added_latency_p99_ms": added[1],
            "added_latency_on_completion_p50_ms": on_completion[0],
            "added_latency_on_completion_p99_ms": on_completion[1],
            "forced": self.forced,
            "end_to_end_p50_ms": e2e[0],
            "end_to_end_p99_ms": e2e[1],
            **({"end_to_end": E2E_UNAVAILABLE} if self.e2e_unavailable and not self.e2e_ms else {}),
            "late": self.late,
            "dropped_incomplete": self.dropped,
            "stamp_jumps": self.jumps,
        }
