"""Fused perception: specs, the transport-free assembler and MultiModalFrames."""

from embodied_bus.fusion.assembler import (
    Assembler,
    AssemblerStats,
    DroppedFrame,
    Event,
    LateSample,
    StampJump,
)
from embodied_bus.fusion.codec import FRAME_ENCODING, decode_frame, encode_frame, frame_summary
from embodied_bus.fusion.decode import frame_arrays
from embodied_bus.fusion.frame import Member, MultiModalFrame
from embodied_bus.fusion.spec import (
    FusionSpec,
    Incomplete,
    Pick,
    Role,
    SpecError,
    StreamSpec,
    load_spec,
    spec_from_dict,
)

__all__ = [
    "FRAME_ENCODING",
    "Assembler",
    "AssemblerStats",
    "DroppedFrame",
    "Event",
    "FusionSpec",
    "Incomplete",
    "LateSample",
    "Member",
    "MultiModalFrame",
    "Pick",
    "Role",
    "SpecError",
    "StampJump",
    "StreamSpec",
    "decode_frame",
    "encode_frame",
    "frame_arrays",
    "frame_summary",
    "load_spec",
    "spec_from_dict",
]

# the worker runs the assembler on a bus: imported last (it needs the bus, which needs the rest)
from embodied_bus.fusion.worker import FusionWorker

__all__ += ["FusionWorker"]
