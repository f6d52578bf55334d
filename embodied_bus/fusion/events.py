"""What an assembler emits besides frames, and its counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from embodied_bus.fusion.frame import MultiModalFrame
from embodied_bus.model.sample import Sample

__all__ = ["AssemblerStats", "DroppedFrame", "Event", "LateSample", "StampJump"]


@dataclass(frozen=True, slots=True)
class LateSample:
    """A sample that a frame already out would have taken (sent to the late side stream);
    ``bucket`` is that frame's."""

    sample: Sample
    bucket: int
    stamp_ns: int


@dataclass(frozen=True, slots=True)
class StampJump:
    """A stream's stamp moved backwards, or forwards by more than the jump threshold."""

    stream: str
    from_ns: int
    to_ns: int

    @property
    def backwards(self) -> bool:
        """True for a jump into the past (clock reset, looping recording)."""
        return self.to_ns < self.from_ns


@dataclass(frozen=True, slots=True)
class DroppedFrame:
    """An incomplete frame dropped by ``incomplete: drop``."""

    bucket: int
    reference_stamp_ns: int
    missing: tuple[str, ...]


Event = MultiModalFrame | LateSample | StampJump | DroppedFrame


@dataclass(slots=True)
class AssemblerStats:
    """Counters of an assembler (all monotonic)."""

    samples: int = 0
    frames: int = 0
    complete: int = 0
    incomplete: int = 0
    dropped_incomplete: int = 0
    forced: int = 0
    late: int = 0
    unused: int = 0
    duplicates: int = 0
    stamp_fallbacks: int = 0
    stamp_jumps: int = 0
    ignored: int = 0
    #: Frames anchored where the reference lost a sample (judged from its cadence).
    reference_lost: int = 0
    presence: dict[str, int] = field(default_factory=dict)
