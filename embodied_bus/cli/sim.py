"""``embodied-bus sim``: write a recording of simulated sensors with real-world clocks (drift,
jitter, an offset, bursts, loss), to try a fusion spec on timing you choose before a robot
shows it to you."""

from __future__ import annotations

import argparse
import dataclasses
import json

from embodied_bus.errors import BusConfigError
from embodied_bus.replay.synthetic import write_recording
from embodied_bus.sim.scenario import REAL_CLOCKS, SENSORS, Scenario, generate

__all__ = ["add_parser"]

_MS = 1_000_000


def _pairs(values: list[str], flag: str) -> dict[str, float]:
    """``STREAM=VALUE`` arguments as a mapping, checked against the simulated streams."""
    out: dict[str, float] = {}
    for v in values:
        stream, sep, number = v.partition("=")
        if not sep or stream not in SENSORS:
            raise BusConfigError(f"{flag} {v!r}: expected STREAM=NUMBER with STREAM one of {sorted(SENSORS)}")
        try:
            out[stream] = float(number)
        except ValueError:
            raise BusConfigError(f"{flag} {v!r}: {number!r} is not a number") from None
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "sim",
        help="write an MCAP of simulated lidar, camera, GPS and IMU with real-world clocks",
        description="Simulated lidar (10 Hz), camera (30 Hz), GPS (5 Hz) and IMU (200 Hz) as ROS 2 "
        "messages, with the sensor clocks you choose, logged at their arrival times. Replay it "
        "(embodied-bus replay OUT --spec YOUR_SPEC) into a fusion worker.",
    )
    p.add_argument("out", metavar="OUT.mcap")
    p.add_argument("--scenario", choices=sorted(REAL_CLOCKS), help="start from a named set of clocks")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of data (default 60)")
    p.add_argument("--rate", action="append", default=[], metavar="STREAM=HZ", help="a sensor's real rate")
    p.add_argument(
        "--jitter", action="append", default=[], metavar="STREAM=MS", help="a sensor's stamp jitter"
    )
    p.add_argument("--camera-offset", type=float, default=None, metavar="MS", help="camera clock ahead by MS")
    p.add_argument("--loss", type=float, default=None, help="probability that a sample is lost")
    p.add_argument("--seed", type=int, default=None)
    p.set_defaults(func=run)


async def run(args: argparse.Namespace) -> int:
    sc = REAL_CLOCKS[args.scenario] if args.scenario else Scenario()
    rates = {**sc.rates_hz, **_pairs(args.rate, "--rate")}
    jitter = {**sc.jitter_ns, **{k: round(v * _MS) for k, v in _pairs(args.jitter, "--jitter").items()}}
    if any(v <= 0 for v in rates.values()) or any(v < 0 for v in jitter.values()):
        raise BusConfigError("--rate must be > 0 and --jitter >= 0")
    if args.duration <= 0 or (args.loss is not None and not 0 <= args.loss < 1):
        raise BusConfigError("--duration must be > 0 and --loss in [0, 1)")
    sc = dataclasses.replace(
        sc,
        duration_s=args.duration,
        rates_hz=rates,
        jitter_ns=jitter,
        camera_offset_ns=sc.camera_offset_ns
        if args.camera_offset is None
        else round(args.camera_offset * _MS),
        loss=sc.loss if args.loss is None else args.loss,
        seed=sc.seed if args.seed is None else args.seed,
    )
    counts = write_recording(args.out, generate(sc))
    print(
        json.dumps(
            {"wrote": args.out, "messages": counts, "rates_hz": {n: sc.sensor(n).rate_hz for n in SENSORS}}
        )
    )
    return 0
