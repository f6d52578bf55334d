"""A deterministic multi-sensor scenario: lidar 10 Hz, camera 30 Hz, GPS 5 Hz, IMU 200 Hz with
stamp jitter and transport latency, and what real sensors add: clocks that drift from their
nominal rate (a 10.03 Hz lidar, a 29.97 Hz camera), jitter, clock offsets, stamp bursts under
load, loss, blackouts and delay spikes. Produces samples in arrival order, for fusion tests and
benchmarks."""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from embodied_bus.model.header import Header, HeaderFlags, Modality
from embodied_bus.model.sample import Sample

if TYPE_CHECKING:
    from embodied_bus.fusion.frame import MultiModalFrame
    from embodied_bus.fusion.spec import FusionSpec

__all__ = ["REAL_CLOCKS", "SENSORS", "T0_NS", "Scenario", "Sensor", "generate", "lost_input"]

#: Scenario epoch: a round 100 ms multiple, so lidar sweeps sit on 100 ms marks.
T0_NS = 1_700_000_000_000_000_000
_MS = 1_000_000


@dataclass(frozen=True, slots=True)
class Sensor:
    """One simulated sensor.

    Attributes:
        modality: What it measures.
        rate_hz: Its real sample rate (its clock may drift from the nominal rate).
        jitter_ns: Each stamp is up to this much after the sample's nominal time (uniform).
        latency_ns: (low, high) transport latency, uniform.
        phase_ns: Time of its first sample after the scenario epoch.
    """

    modality: Modality
    rate_hz: float
    jitter_ns: int
    latency_ns: tuple[int, int]
    phase_ns: int = 0


#: The default sensors, by stream.
SENSORS: dict[str, Sensor] = {
    "lidar/top": Sensor(Modality.LIDAR, 10.0, 8 * _MS, (40 * _MS, 60 * _MS)),
    "camera/front": Sensor(Modality.CAMERA, 30.0, 1 * _MS, (20 * _MS, 40 * _MS), 7 * _MS),
    "gps": Sensor(Modality.GPS, 5.0, 0, (15 * _MS, 25 * _MS)),
    "imu": Sensor(Modality.IMU, 200.0, 200_000, (1 * _MS, 3 * _MS)),
}


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
        rates_hz: Real rates replacing the default sensors' (e.g. ``{"lidar/top": 10.03}``).
        jitter_ns: Stamp jitter replacing the default sensors'.
        phases_ns: First-sample times replacing the default sensors'.
        imu_bursts: (period_s, length_s): every ``period_s`` seconds the IMU driver is starved
            for ``length_s`` and then stamps the samples it buffered with the time it reads
            them, 50 µs apart, all arriving at once (a driver under load).
    """

    duration_s: float = 10.0
    loss: float = 0.0
    camera_blackout: tuple[float, float] | None = None
    camera_offset_ns: int = 0
    camera_delay_spike: tuple[float, float, int] | None = None
    zero_stamps: tuple[str, ...] = ()
    seed: int = 1
    rates_hz: Mapping[str, float] = field(default_factory=dict)
    jitter_ns: Mapping[str, int] = field(default_factory=dict)
    phases_ns: Mapping[str, int] = field(default_factory=dict)
    imu_bursts: tuple[float, float] | None = None

    def sensor(self, stream: str) -> Sensor:
        """The sensor of ``stream`` with this scenario's overrides."""
        base = SENSORS[stream]
        return Sensor(
            base.modality,
            self.rates_hz.get(stream, base.rate_hz),
            self.jitter_ns.get(stream, base.jitter_ns),
            base.latency_ns,
            self.phases_ns.get(stream, base.phase_ns),
        )


#: Sensor clocks as they are on real robots, by name: drifting rates, jitter, an offset, bursts.
REAL_CLOCKS: dict[str, Scenario] = {
    "lidar_10.03hz": Scenario(rates_hz={"lidar/top": 10.03}),
    "lidar_9.98hz_camera_29.97hz_jitter_3ms": Scenario(
        rates_hz={"lidar/top": 9.98, "camera/front": 29.97},
        jitter_ns={"camera/front": 6 * _MS},
        phases_ns={"camera/front": 4 * _MS},
    ),
    "lidar_9.9hz_imu_jitter": Scenario(
        rates_hz={"lidar/top": 9.9, "imu": 199.7}, jitter_ns={"imu": 2 * _MS}, seed=3
    ),
    "lidar_10.1hz_camera_offset_20ms": Scenario(
        rates_hz={"lidar/top": 10.1, "camera/front": 29.97}, camera_offset_ns=20 * _MS, seed=4
    ),
    "imu_bursts_under_load": Scenario(rates_hz={"lidar/top": 10.02}, imu_bursts=(3.0, 0.04), seed=5),
    "loss_5pct_drift": Scenario(rates_hz={"lidar/top": 9.97, "camera/front": 29.97}, loss=0.05, seed=6),
}


def _burst_stamp(nominal: int, sc: Scenario) -> int | None:
    """The stamp and arrival time of an IMU sample read late by a starved driver (None: not in
    a burst)."""
    if sc.imu_bursts is None:
        return None
    period_s, length_s = sc.imu_bursts
    t_s = (nominal - T0_NS) / 1e9
    k = int(t_s // period_s)
    if k == 0 or t_s - k * period_s >= length_s:
        return None
    return T0_NS + int((k * period_s + length_s) * 1e9)


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
    for pub_id, stream in enumerate(SENSORS, 1):
        sensor = sc.sensor(stream)
        lat_lo, lat_hi = sensor.latency_ns
        period_ns = 1e9 / sensor.rate_hz
        seq = 0
        k = 0
        burst_n = 0
        while True:
            nominal = T0_NS + round(k * period_ns) + sensor.phase_ns
            k += 1
            if nominal >= end:
                break
            stamp = nominal + (rng.randrange(sensor.jitter_ns) if sensor.jitter_ns else 0)
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
            receive = nominal + latency
            if stream == "imu" and (read_at := _burst_stamp(nominal, sc)) is not None:
                burst_n += 1
                stamp = read_at + burst_n * 50_000
                receive = stamp + latency
            else:
                burst_n = 0
            seq += 1
            if sc.loss and rng.random() < sc.loss:
                if lost is not None:
                    lost.append((stream, stamp))
                continue
            header_stamp = 0 if stream in sc.zero_stamps else stamp
            h = Header(
                stream=stream,
                modality=sensor.modality,
                seq=seq,
                stamp_ns=header_stamp,
                bucket=0,
                bucket_width_ns=100 * _MS,
                bucket_offset_ns=0,
                encoding="raw",
                frame_id=stream,
                publisher_id=pub_id,
                publish_ns=receive - 100_000,
                flags=HeaderFlags.NONE,
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
        applied) within the reach of that stream's pick around the frame's reference stamp:
        the max skew either side (nearest, interpolate), the max age back (hold_last), or
        the window of an ``all`` / ``latest`` stream.
    """
    from embodied_bus.fusion.spec import Pick

    reach: dict[str, tuple[int, int]] = {}
    for st in spec.streams:
        if st.pick in (Pick.NEAREST, Pick.INTERPOLATE):
            reach[st.name] = (spec.skew_ns(st), spec.skew_ns(st))
        elif st.pick is Pick.HOLD_LAST:
            reach[st.name] = (spec.age_ns(st), 0)
        else:
            period = spec.reference_period_ns
            reach[st.name] = (period, period)
    stamps: dict[str, list[int]] = {}
    offsets = {st.name: st.clock_offset_ns for st in spec.streams}
    for name, stamp in lost:
        if name in reach:
            stamps.setdefault(name, []).append(stamp + offsets[name])
    for values in stamps.values():
        values.sort()

    def test(frame: MultiModalFrame) -> bool:
        r = frame.reference_stamp_ns
        for name, values in stamps.items():
            before, after = reach[name]
            i = bisect.bisect_left(values, r - before)
            if i < len(values) and values[i] <= r + after:
                return True
        return False

    return test
