"""A deterministic multi-sensor scenario: lidar 10 Hz, camera 30 Hz, GPS 5 Hz, IMU 200 Hz with
stamp jitter and transport latency, and optional faults (loss, blackout, clock offset, delay
spike). Produces samples in arrival order, for fusion tests and benchmarks."""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from embodied_bus.model.header import Header, HeaderFlags, Modality
from embodied_bus.model.sample import Sample

if TYPE_CHECKING:
    from embodied_bus.fusion.frame import MultiModalFrame
    from embodied_bus.fusion.spec import FusionSpec

__all__ = ["T0_NS", "Scenario", "generate", "lost_input"]

#: Scenario epoch: a round 100 ms multiple, so lidar sweeps sit on 100 ms marks.
T0_NS = 1_700_000_000_000_000_000
_MS = 1_000_000


@dataclass(frozen=True, slots=True)
class Scenario:
    """Parameters of a generated run (all times in ns unless noted).

    Attributes:
        duration_s: Length of the run in seconds.
        loss: Probability that any sample is lost.
        camera_blackout: (start_s, length_s) during which the camera sends nothing.
        camera_offset_ns: Added to camera stamps (a camera clock running ahead).
        camera_delay_spike: (start_s, length_s, extra_ns) extra camera transport delay.
        zero_stamps: Streams whose header stamps are all 0 (receive-time fallback).
        seed: Random seed.
    """

    duration_s: float = 10.0
    loss: float = 0.0
    camera_blackout: tuple[float, float] | None = None
    camera_offset_ns: int = 0
    camera_delay_spike: tuple[float, float, int] | None = None
    zero_stamps: tuple[str, ...] = ()
    seed: int = 1


#: stream -> (modality, period ns, stamp jitter ns, latency range ns)
SENSORS: dict[str, tuple[Modality, int, int, tuple[int, int]]] = {
    "lidar/top": (Modality.LIDAR, 100 * _MS, 8 * _MS, (40 * _MS, 60 * _MS)),
    "camera/front": (Modality.CAMERA, 33_333_333, 1 * _MS, (20 * _MS, 40 * _MS)),
    "gps": (Modality.GPS, 200 * _MS, 0, (15 * _MS, 25 * _MS)),
    "imu": (Modality.IMU, 5 * _MS, 200_000, (1 * _MS, 3 * _MS)),
}


def generate(sc: Scenario, *, lost: list[tuple[str, int]] | None = None) -> list[Sample]:
    """All samples of the scenario in arrival (receive time) order.

    Args:
        sc: The scenario.
        lost: If given, (stream, stamp_ns) of every sample lost to ``sc.loss`` is appended to it
            (stamps as they would have been sent, camera offset included).
    """
    rng = random.Random(sc.seed)
    out: list[Sample] = []
    end = T0_NS + int(sc.duration_s * 1e9)
    for pub_id, (stream, (mod, period, jitter, (lat_lo, lat_hi))) in enumerate(SENSORS.items(), 1):
        seq = 0
        k = 0
        while True:
            nominal = T0_NS + k * period + (7 * _MS if stream == "camera/front" else 0)
            k += 1
            if nominal >= end:
                break
            stamp = nominal + (rng.randrange(jitter) if jitter else 0)
            latency = rng.randrange(lat_lo, lat_hi)
            t_s = (nominal - T0_NS) / 1e9
            if stream == "camera/front":
                if sc.camera_blackout and sc.camera_blackout[0] <= t_s < sum(sc.camera_blackout):
                    continue
                if sc.camera_delay_spike:
                    start, length, extra = sc.camera_delay_spike
                    if start <= t_s < start + length:
                        latency += extra
                stamp += sc.camera_offset_ns
            seq += 1
            if sc.loss and rng.random() < sc.loss:
                if lost is not None:
                    lost.append((stream, stamp))
                continue
            receive = nominal + latency
            header_stamp = 0 if stream in sc.zero_stamps else stamp
            flags = HeaderFlags.NONE
            h = Header(
                stream=stream,
                modality=mod,
                seq=seq,
                stamp_ns=header_stamp,
                bucket=0,
                bucket_width_ns=100 * _MS,
                bucket_offset_ns=0,
                encoding="raw",
                frame_id=stream,
                publisher_id=pub_id,
                publish_ns=receive - 100_000,
                flags=flags,
            )
            out.append(Sample(h, b"", receive))
    out.sort(key=lambda s: (s.receive_ns, s.header.stream))
    return out


def lost_input(spec: FusionSpec, lost: list[tuple[str, int]]) -> Callable[[MultiModalFrame], bool]:
    """A test of whether a frame lost input: a sample it could have used was lost in transport.

    Args:
        spec: The fusion spec the frames were assembled with.
        lost: (stream, stamp_ns) of the lost samples, as filled in by :func:`generate`.

    Returns:
        A function of a frame: True if a lost sample of some stream was stamped (clock offset
        applied) within the reach of that stream's pick around the frame's bucket: the bucket
        itself, widened by the max skew (nearest, interpolate) or back by the max age (hold_last).
    """
    from embodied_bus.fusion.spec import Pick

    reach: dict[str, tuple[int, int]] = {}
    for st in spec.streams:
        if st.pick in (Pick.NEAREST, Pick.INTERPOLATE):
            reach[st.name] = (spec.skew_ns(st), spec.skew_ns(st))
        elif st.pick is Pick.HOLD_LAST:
            reach[st.name] = (spec.age_ns(st), 0)
        else:
            reach[st.name] = (0, 0)
    stamps: dict[str, list[int]] = {}
    offsets = {st.name: st.clock_offset_ns for st in spec.streams}
    for name, stamp in lost:
        if name in reach:
            stamps.setdefault(name, []).append(stamp + offsets[name])
    for values in stamps.values():
        values.sort()

    def test(frame: MultiModalFrame) -> bool:
        for name, values in stamps.items():
            before, after = reach[name]
            i = bisect.bisect_left(values, frame.start_ns - before)
            if i < len(values) and values[i] < frame.end_ns + after:
                return True
        return False

    return test
