"""``embodied-bus doctor``: check this machine and a bus before a robot depends on them.

Each check ends ``ok``, ``warn`` (works, but not as well as it could: the detail says what to
change), ``fail`` (does not work: the detail says why) or ``skip`` (does not apply here). The
exit status is 1 if any check failed, else 0.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes.util
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from embodied_bus.actions.queue import EXECUTOR_GROUP, Backlog, executors_with, parse_announcement
from embodied_bus.bus import Bus, open_bus
from embodied_bus.cli.actions import ActionsView
from embodied_bus.cli.common import add_bus_args, fmt_table, queue_backlog
from embodied_bus.engines.capabilities import membership
from embodied_bus.engines.urls import ZenohSettings
from embodied_bus.errors import EmbodiedBusError
from embodied_bus.loop import LOOP_ENV, loop_runner
from embodied_bus.model.qos import Backpressure, PublisherOptions, SubscriptionOptions

__all__ = [
    "DOCTOR_STREAM",
    "PULSAR_SLOW_P50_MS",
    "SHM_WANTED_BYTES",
    "ZENOH_SLOW_P50_MS",
    "Check",
    "add_parser",
    "check_actions",
    "check_round_trip",
    "check_shm_room",
    "run_checks",
]

#: Stream the round trip uses (one name, so repeated runs leave at most one Pulsar topic).
DOCTOR_STREAM = "_doctor"
#: A Pulsar round trip slower than this at the median, milliseconds, is reported with the two
#: broker settings that bring it under a millisecond (the README's "Pulsar brokers for robots").
PULSAR_SLOW_P50_MS = 3.0
#: A Zenoh round trip slower than this at the median, milliseconds, is reported (one process
#: on loopback takes about 0.15 ms; through a router on another host, the network's share).
ZENOH_SLOW_P50_MS = 2.0
#: Room in ``/dev/shm`` below which Zenoh's shared memory is reported as too small, bytes:
#: twice a publisher's pool for 8 MiB point clouds (Docker gives containers 64 MiB).
SHM_WANTED_BYTES = 2 * 64 * 1024 * 1024
#: How long the executor group is watched before its members are counted, seconds (Pulsar
#: members are heard on heartbeats every 0.25 s; Zenoh's liveliness answers at once).
EXECUTORS_SETTLE_S = 0.8

_PULSAR_HINT = (
    "set managedLedgerNewEntriesCheckDelayInMillis=0 (broker.conf) and "
    "journalFlushWhenQueueEmpty=true (bookkeeper.conf): see the README's "
    "'Pulsar brokers for robots: two settings'"
)


@dataclass(frozen=True)
class Check:
    """The outcome of one check.

    Attributes:
        name: What was checked.
        status: ``ok``, ``warn``, ``fail`` or ``skip``.
        detail: What was found, and for ``warn`` and ``fail`` what to do about it.
    """

    name: str
    status: str
    detail: str


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "doctor",
        help="check this machine and a bus: packages, shared memory, reachability, round-trip latency",
    )
    add_bus_args(p)
    p.add_argument(
        "--samples",
        type=int,
        default=100,
        metavar="N",
        help="1 KiB samples sent one at a time for the round trip (default %(default)s)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="longest wait to open the bus, and for each sample, seconds (default %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="the checks as one JSON array")
    p.set_defaults(func=run)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_packages(engine: str) -> list[Check]:
    """The Python packages embodied_bus uses, and whether the ones ``engine`` needs are there."""
    where = f"Python {platform.python_version()} on {platform.machine()} {sys.platform}"
    out = [Check("python", "ok", where)]
    zenoh = _version("eclipse-zenoh")
    out.append(
        Check("eclipse-zenoh", "ok", zenoh)
        if zenoh
        else Check("eclipse-zenoh", "fail", "not installed: pip install eclipse-zenoh")
    )
    pulsar = _version("pulsar-client")
    if pulsar:
        out.append(Check("pulsar-client", "ok", pulsar))
    else:
        need = "pip install 'embodied_bus[pulsar]'"
        out.append(
            Check("pulsar-client", "fail", f"not installed, and the bus is Pulsar: {need}")
            if engine == "pulsar"
            else Check("pulsar-client", "skip", f"not installed (needed for pulsar:// buses: {need})")
        )
    if _version("open3d") is None:
        why = "not installed (point clouds as open3d objects: embodied_bus[pointcloud])"
        out.append(Check("open3d", "skip", why))
    elif ctypes.util.find_library("usb-1.0") is None:
        out.append(Check("open3d", "fail", "installed, but libusb-1.0 is missing: apt install libusb-1.0-0"))
    else:
        out.append(Check("open3d", "ok", str(_version("open3d"))))
    try:
        loop, _ = loop_runner()
    except EmbodiedBusError as err:
        out.append(Check("event loop", "fail", str(err)))
    else:
        if loop == "uvloop":
            detail = f"uvloop {_version('uvloop')} for the command line ({LOOP_ENV}=asyncio: asyncio's)"
            out.append(Check("event loop", "ok", detail))
        elif _version("uvloop") is None:
            detail = "asyncio's own: pip install uvloop for less CPU per action"
            out.append(Check("event loop", "warn", detail))
        else:
            out.append(Check("event loop", "ok", f"asyncio's own, as {LOOP_ENV} asks"))
    out.append(
        Check("rclpy", "ok", "ROS 2 nodes can run")
        if importlib.util.find_spec("rclpy") is not None
        else Check("rclpy", "skip", "no ROS 2 here: the bus works, the ROS 2 nodes need a sourced ROS 2")
    )
    return out


def check_shm_room(free_bytes: int | None) -> Check:
    """Whether ``/dev/shm`` (``free_bytes`` free; None: there is none) has room for Zenoh's
    shared memory."""
    if free_bytes is None:
        return Check("/dev/shm", "skip", "no /dev/shm: Zenoh moves large payloads over its links")
    mib = free_bytes / (1 << 20)
    if free_bytes < SHM_WANTED_BYTES:
        return Check(
            "/dev/shm",
            "warn",
            f"{mib:.0f} MiB free, {SHM_WANTED_BYTES >> 20} MiB wanted: large payloads then go "
            "the ordinary way, with more copies (in Docker: --shm-size=512m)",
        )
    return Check("/dev/shm", "ok", f"{mib:.0f} MiB free")


def check_round_trip(engine: str, latencies_ms: list[float], expected: int, *, path: str = "") -> Check:
    """Judge a round trip of ``expected`` samples of which these latencies arrived (``path``:
    which way they went, for the detail)."""
    if len(latencies_ms) < expected:
        return Check(
            "round trip",
            "fail",
            f"{expected - len(latencies_ms)} of {expected} samples did not come back",
        )
    if not latencies_ms:
        return Check("round trip", "skip", "no samples sent")
    p50 = statistics.median(latencies_ms)
    p99 = sorted(latencies_ms)[min(len(latencies_ms) - 1, int(0.99 * len(latencies_ms)))]
    detail = f"{expected} samples of 1 KiB{path}, publish to receive p50 {p50:.2f} ms, p99 {p99:.2f} ms"
    if engine == "pulsar" and p50 > PULSAR_SLOW_P50_MS:
        return Check("round trip", "warn", f"{detail}: slow for a broker; {_PULSAR_HINT}")
    if engine == "zenoh" and p50 > ZENOH_SLOW_P50_MS:
        return Check("round trip", "warn", f"{detail}: slow for Zenoh (a distant router or a busy host?)")
    return Check("round trip", "ok", detail)


def check_actions(engine: str, executors: Mapping[str, str], backlog: Backlog | None) -> list[Check]:
    """The action queue and its executors.

    Args:
        engine: ``zenoh`` or ``pulsar``.
        executors: Live members of the executor group (name -> announced JSON with ``kinds``).
        backlog: The Zenoh queue service's backlog (None: none answered); unused
            on Pulsar, whose queue is its topics.
    """
    out: list[Check] = []
    if engine == "pulsar":
        out.append(Check("action queue", "ok", "the broker's topics (no queue service needed on Pulsar)"))
    elif backlog is None:
        out.append(
            Check(
                "action queue",
                "skip",
                "no action queue service answered on this bus (start `embodied-bus queue` to send "
                "actions over Zenoh)",
            )
        )
    else:
        v = ActionsView().update(backlog, 0.0)
        out.append(
            Check(
                "action queue",
                "ok",
                f"queue service answered: {v['queued']} queued, {v['in_flight']} in flight, "
                f"{v['retrying']} retrying, {v['dead_letters']} dead letter(s)",
            )
        )
    if not executors:
        out.append(Check("action executors", "skip", "none live on this bus"))
    else:
        listed = ", ".join(
            f"{name} ({', '.join(_kinds(value)) or 'no kinds'})" for name, value in sorted(executors.items())
        )
        out.append(Check("action executors", "ok", f"{len(executors)} live: {listed}"))
    waiting = sorted(
        {
            key.rpartition("/p")[0]
            for key, row in (backlog.rows if backlog is not None else {}).items()
            if row.queued + row.retrying > 0
        }
    )
    orphans = [k for k in waiting if not executors_with(executors, k)]
    if orphans:
        out.append(
            Check(
                "action kinds",
                "warn",
                "queued with no live executor to run them: "
                + ", ".join(repr(k) for k in orphans)
                + " (start `embodied-bus executor` with handlers for them)",
            )
        )
    return out


def _kinds(value: str) -> list[str]:
    ann = parse_announcement(value)
    return ann.kinds if ann is not None else []


async def _actions(bus: Bus, timeout_s: float) -> tuple[dict[str, str], Backlog | None]:
    """The executor group's live members and (Zenoh) the queue service's backlog."""
    group = await membership(bus.engine, "listing the executors").watch_group(EXECUTOR_GROUP, lambda *_: None)
    try:
        backlog = await queue_backlog(bus, min(timeout_s, 1.0))
        await asyncio.sleep(EXECUTORS_SETTLE_S)
        return group.members(), backlog
    finally:
        await group.leave()


def _shm_free_bytes() -> int | None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


async def _round_trip(bus: Bus, sub_bus: Bus, samples: int, timeout_s: float) -> list[float]:
    """Send ``samples`` samples one at a time from ``bus`` to ``sub_bus`` and time each from
    publish to receive, ms."""
    sub = await sub_bus.subscribe(
        DOCTOR_STREAM, options=SubscriptionOptions(capacity=16, backpressure=Backpressure.BLOCK)
    )
    pub = await bus.publisher(DOCTOR_STREAM, options=PublisherOptions(backpressure=Backpressure.BLOCK))
    out: list[float] = []
    try:
        await pub.wait_for_subscribers(timeout_s)
        payload = bytes(1024)
        for _ in range(samples):
            t0 = time.perf_counter()
            header = await pub.publish(payload, stamp_ns=time.time_ns())
            while True:  # skip the samples of another doctor run on the same stream
                got = await sub.recv(timeout_s=timeout_s)
                if got.header.publisher_id == header.publisher_id and got.header.seq == header.seq:
                    break
            out.append((time.perf_counter() - t0) * 1e3)
    except TimeoutError:
        pass
    finally:
        await pub.close()
        await sub.close()
    return out


async def run_checks(url: str, namespace: str | None, *, samples: int, timeout_s: float) -> list[Check]:
    """Every check, for the bus at ``url``."""
    engine = "pulsar" if url.startswith("pulsar") else "zenoh"
    checks = check_packages(engine)
    if engine == "zenoh":
        checks.append(check_shm_room(_shm_free_bytes()))
    t0 = time.perf_counter()
    try:
        bus = await open_bus(url, namespace=namespace, connect_timeout_s=timeout_s)
    except EmbodiedBusError as err:
        checks.append(Check("bus", "fail", str(err)))
        return checks
    try:
        opened_ms = (time.perf_counter() - t0) * 1e3
        checks.append(Check("bus", "ok", f"{url} opened in {opened_ms:.0f} ms (namespace {bus.namespace!r})"))
        session = getattr(bus.engine, "session", None)
        if session is not None:  # Zenoh: who this session reached
            routers, peers = len(list(session.info.routers_zid())), len(list(session.info.peers_zid()))
            zs = bus.settings
            wanted = isinstance(zs, ZenohSettings) and (bool(zs.connect) or zs.mode == "client")
            status = "warn" if wanted and routers + peers == 0 else "ok"
            detail = f"{routers} router(s), {peers} peer(s) reached"
            if status == "warn":
                detail += ": samples published here reach no other process"
            elif routers + peers == 0:
                detail += " (an embedded peer alone: other processes need a listen/connect pair or a router)"
            checks.append(Check("zenoh links", status, detail))
        sub_bus, path = bus, " through the broker" if engine == "pulsar" else " within this process"
        try:
            if isinstance(bus.settings, ZenohSettings) and bus.settings.connect:
                # a second session, so that the samples go out through the router or peer
                sub_bus = await open_bus(url, namespace=namespace, connect_timeout_s=timeout_s)
                path = " through the URL's endpoints"
            latencies = await _round_trip(bus, sub_bus, samples, timeout_s)
        except EmbodiedBusError as err:
            checks.append(Check("round trip", "fail", str(err)))
        else:
            checks.append(check_round_trip(engine, latencies, samples, path=path))
        finally:
            if sub_bus is not bus:
                await sub_bus.close()
        try:
            executors, backlog = await _actions(bus, timeout_s)
        except EmbodiedBusError as err:
            checks.append(Check("action queue", "fail", str(err)))
        else:
            checks.extend(check_actions(engine, executors, backlog))
    finally:
        await bus.close()
    return checks


async def run(args: argparse.Namespace) -> int:
    if args.samples < 1:
        print(f"embodied-bus doctor: --samples must be at least 1, got {args.samples}", file=sys.stderr)
        return 2
    checks = await run_checks(args.bus, args.ns, samples=args.samples, timeout_s=args.timeout)
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=1))
    else:
        print(fmt_table((asdict(c) for c in checks), ["name", "status", "detail"]))
    return 1 if any(c.status == "fail" for c in checks) else 0
