"""Options and helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from embodied_bus.engines.urls import DEFAULT_URL
from embodied_bus.errors import BusConfigError, EmbodiedBusError
from embodied_bus.fusion.spec import load_spec
from embodied_bus.loop import install_stop_signals
from embodied_bus.model.clock import BucketClock
from embodied_bus.ros.config import robot_config_from_dict
from embodied_bus.security import Sealer, Trust, WatchedAllowList, load_private_key

if TYPE_CHECKING:
    from embodied_bus.actions.queue import BackendOptions, Backlog
    from embodied_bus.bus import Bus

__all__ = [
    "add_bus_args",
    "add_clock_arg",
    "add_credential_args",
    "add_metrics_arg",
    "at_least_one",
    "at_least_zero",
    "bucket_clock",
    "credentials",
    "fmt_table",
    "install_stop_signals",
    "queue_backlog",
    "serve_until",
]


async def queue_backlog(bus: Bus, timeout_s: float) -> Backlog | None:
    """The Zenoh action queue service's backlog, or None where none answers within
    ``timeout_s`` seconds (or on Pulsar, whose queue is its topics: ask a
    :class:`~embodied_bus.actions.Planner` there)."""
    from embodied_bus.actions.queue import QueueOptions
    from embodied_bus.actions.remote import ServiceQueue, ZenohTransport

    if bus.engine_name != "zenoh":
        return None
    try:
        return await ServiceQueue(ZenohTransport(bus), QueueOptions(request_timeout_s=timeout_s)).backlog()
    except EmbodiedBusError as err:
        logging.getLogger("embodied_bus.cli").debug("no action backlog: %s", err)
        return None


def add_bus_args(parser: argparse.ArgumentParser) -> None:
    """``--bus`` and ``--ns``."""
    parser.add_argument(
        "--bus",
        default=os.environ.get("EMBODIED_BUS_URL", DEFAULT_URL),
        help="bus URL: zenoh: (embedded peer), zenoh://HOST:PORT (router), pulsar://HOST:PORT "
        "(default: $EMBODIED_BUS_URL or %(default)s)",
    )
    parser.add_argument(
        "--ns",
        default=os.environ.get("EMBODIED_BUS_NAMESPACE"),
        help="robot namespace (default: ns= in the URL, else 'default')",
    )


def add_metrics_arg(parser: argparse.ArgumentParser) -> None:
    """``--metrics-port``: serve Prometheus metrics."""
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics on this port (/metrics)",
    )


async def serve_until(
    stop: asyncio.Event,
    tasks: Iterable[asyncio.Future[Any]],
    *,
    duration_s: float = 0.0,
    every_s: float = 1.0,
    on_tick: Callable[[], None] | None = None,
) -> None:
    """Wait until ``stop`` is set, ``duration_s`` has passed (0: no limit) or one of ``tasks``
    (the command's workers) ended. A worker that ended with an error sets ``stop`` and raises
    that error, so the command exits non-zero naming it instead of staying up doing nothing.
    ``on_tick`` is called every ``every_s`` seconds meanwhile (live status lines).

    Raises:
        BaseException: The error a worker ended with.
    """
    watched = list(tasks)
    loop = asyncio.get_running_loop()
    end = loop.time() + duration_s if duration_s else None
    stopping = asyncio.ensure_future(stop.wait())
    try:
        while not stop.is_set():
            wait_s = every_s if end is None else max(0.0, min(every_s, end - loop.time()))
            await asyncio.wait([stopping, *watched], timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
            for t in watched:
                if t.done() and not t.cancelled() and t.exception() is not None:
                    stop.set()
                    raise t.exception()  # type: ignore[misc]
            if any(t.done() for t in watched) or (end is not None and loop.time() >= end):
                stop.set()
            elif on_tick is not None and not stop.is_set():
                on_tick()
    finally:
        stopping.cancel()


def fmt_ms(value: float | None) -> str:
    """A duration in ms for a status line; ``n/a`` when there is none."""
    return "n/a" if value is None else f"{value} ms"


def fmt_table(rows: Iterable[dict[str, Any]], columns: list[str]) -> str:
    """Render dict rows as an aligned text table."""
    rows = list(rows)
    cells = [[("-" if r.get(c) is None else str(r.get(c))) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=False))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=False)) for row in cells]
    return "\n".join(lines)


def add_credential_args(p: argparse.ArgumentParser) -> None:
    """``--seal`` and ``--trust``: this process's queue credentials."""
    p.add_argument(
        "--seal",
        metavar="KEY.pem",
        default=None,
        help="seal this process's queue messages with this private key (a Zenoh queue service that "
        "trusts known parties only answers sealed requests)",
    )
    p.add_argument(
        "--trust",
        metavar="ALLOW.yaml",
        default=None,
        help="believe only queue messages sealed by keys of this allow-list, with the roles they need "
        "(re-read while it changes: revoking a key takes effect within a second)",
    )


def credentials(args: argparse.Namespace) -> tuple[Sealer | None, Trust | None]:
    """The ``--seal`` and ``--trust`` of a command."""
    sealer = Sealer(load_private_key(args.seal)) if args.seal else None
    trust = Trust(WatchedAllowList(args.trust)) if args.trust else None
    return sealer, trust


def queue_backend(args: argparse.Namespace, prefetch: int | None = None) -> BackendOptions | None:
    """The queue backend options of a command: ``--seal``/``--trust`` (the Zenoh queue
    service) or ``--prefetch`` (Pulsar); None: neither.

    Raises:
        BusConfigError: Options of both backends were given.
    """
    from embodied_bus.actions.queue import PulsarQueueOptions, ZenohQueueOptions

    if prefetch is not None:
        if args.seal or args.trust:
            raise BusConfigError(
                "--prefetch is for the Pulsar queue and --seal/--trust for the Zenoh queue service: "
                "give the options of your bus's engine only"
            )
        return PulsarQueueOptions(prefetch)
    if not (args.seal or args.trust):
        return None
    return ZenohQueueOptions(*credentials(args))


def add_clock_arg(parser: argparse.ArgumentParser) -> None:
    """``--spec``: stamp buckets with a fusion spec's clock."""
    parser.add_argument(
        "--spec",
        metavar="YAML",
        help="stamp buckets with this fusion spec's clock (a fusion YAML, or a robot YAML with "
        "fusion: or clock:); fusion workers refuse samples of another clock (default: 100 ms, offset 0)",
    )


def bucket_clock(spec: str | None, *, config: str | None = None) -> BucketClock:
    """The bucket clock to stamp with: ``spec``'s, else the robot YAML ``config``'s (when it has
    ``clock:`` or ``fusion:``), else the default."""
    for path in (spec, config):
        if not path:
            continue
        try:
            doc = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise BusConfigError(f"cannot read {path!r}: {err}") from err
        if isinstance(doc, dict) and ("clock" in doc or "fusion" in doc):
            only_clock = {k: doc[k] for k in ("clock", "fusion") if k in doc}
            return robot_config_from_dict(only_clock, where=path).clock
        if path == spec:
            return load_spec(path).clock
    return BucketClock()


def _at_least(low: int, text: str) -> int:
    """An integer >= ``low``, or an argparse error naming what was wrong."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
    return value


def at_least_one(text: str) -> int:
    """An argparse type: an integer >= 1."""
    return _at_least(1, text)


def at_least_zero(text: str) -> int:
    """An argparse type: an integer >= 0."""
    return _at_least(0, text)
