"""Limits for decoding input from the network, with safe defaults.

Every decoder that reads bytes from another process (sample headers, frames, CDR sensor
messages, action envelopes) bounds what it will allocate by these numbers and raises a clear
error naming the limit instead. Pass your own :class:`DecodeLimits` to raise or lower them.
"""

from __future__ import annotations

from dataclasses import dataclass

from embodied_bus.errors import BusConfigError

__all__ = ["DEFAULT_LIMITS", "DecodeLimits"]


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """Bounds on decoded input.

    Attributes:
        max_payload_bytes: Largest sample or frame payload, bytes (64 MiB).
        max_frame_members: Most members in one fused frame (4096).
        max_frame_meta_bytes: Largest frame metadata block, bytes (4 MiB).
        max_string_bytes: Longest name, encoding or frame id, bytes (1024).
        max_points: Most points in one PointCloud2 (height * width; 20 million).
        max_point_fields: Most fields per point (256).
        max_image_pixels: Most pixels in an Image or decoded CompressedImage (80 million).
        max_action_bytes: Largest action envelope, bytes (512 KiB).
    """

    max_payload_bytes: int = 64 * 1024 * 1024
    max_frame_members: int = 4096
    max_frame_meta_bytes: int = 4 * 1024 * 1024
    max_string_bytes: int = 1024
    max_points: int = 20_000_000
    max_point_fields: int = 256
    max_image_pixels: int = 80_000_000
    max_action_bytes: int = 512 * 1024

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise BusConfigError(f"DecodeLimits.{name} must be a positive integer, got {value!r}")


#: The defaults used when a decoder is given no limits.
DEFAULT_LIMITS = DecodeLimits()
