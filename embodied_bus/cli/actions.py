"""Action queue commands: ``queue``, ``executor``, ``send``, ``dlq``, ``actions``."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from embodied_bus.actions import (
    DEFAULT_RETRY,
    ActionError,
    Executor,
    Planner,
    QueueService,
    RetryPolicy,
    SessionFailure,
)
from embodied_bus.actions.queue import EXECUTOR_GROUP, Backlog, executors_with
from embodied_bus.actions.store import DEFAULT_KEEP_ENDED
from embodied_bus.bus import Bus, open_bus
from embodied_bus.cli.common import (
    add_bus_args,
    add_credential_args,
    add_metrics_arg,
    at_least_one,
    at_least_zero,
    credentials,
    fmt_table,
    install_stop_signals,
    queue_backend,
)
from embodied_bus.cli.retry import add_retry_args, add_retry_policy_parser, policies_from_args, retry_policy
from embodied_bus.engines.capabilities import membership
from embodied_bus.engines.urls import parse_bus_url
from embodied_bus.errors import BusConfigError
from embodied_bus.security import Signer, Verifier, WatchedAllowList, load_private_key
from embodied_bus.state import StateService

__all__ = ["ActionsView", "add_parsers", "load_handlers"]

_log = logging.getLogger(__name__)


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("queue", help="host the durable action queue service")
    add_bus_args(p)
    p.add_argument("--db", default="actions.db", help="SQLite file (default actions.db)")
    p.add_argument(
        "--state-db",
        default=None,
        metavar="PATH",
        help="also host the namespace's state service (latest values, `embodied-bus state`) in this "
        "SQLite file (default: state.db beside --db; 'none': do not host it)",
    )
    add_retry_args(p)
    p.add_argument(
        "--keep-ended",
        type=at_least_zero,
        default=DEFAULT_KEEP_ENDED,
        metavar="N",
        help=f"ended actions (succeeded, canceled) kept for planners that look them up later: the "
        f"newest N; older ones are deleted (default {DEFAULT_KEEP_ENDED}; dead letters stay until purged)",
    )
    add_credential_args(p)
    add_metrics_arg(p)  # the backlog as Prometheus gauges, and as JSON on /backlog (autoscalers)
    p.set_defaults(func=run_queue)

    p = sub.add_parser("executor", help="run action handlers: --handlers module:MAPPING")
    add_bus_args(p)
    p.add_argument(
        "--handlers",
        required=True,
        metavar="MODULE:OBJECT",
        help="a dict of kind -> async handler(action, ctx), e.g. myrobot.actions:HANDLERS",
    )
    p.add_argument("--name", default=None)
    p.add_argument("--concurrency", type=at_least_one, default=1, help="handlers running at once")
    p.add_argument(
        "--prefetch",
        type=at_least_one,
        default=None,
        metavar="N",
        help="Pulsar: actions per priority level fetched ahead of a free slot (default 2; more moves "
        "short actions faster, but a busy executor then holds up to N + 1 that others could run)",
    )
    p.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--allow",
        metavar="ALLOW.yaml",
        default=None,
        help="run only actions signed by a key this allow-list permits for their kind (see 'keys')",
    )
    p.add_argument(
        "--nonce-db",
        default=None,
        help="SQLite file of the signature nonces seen, kept across restarts (default, with --allow: "
        "nonces-<namespace>.db under $XDG_STATE_HOME/embodied_bus or ~/.local/state/embodied_bus)",
    )
    add_credential_args(p)
    _add_connect_timeout(p, "the broker or the queue service", None)
    add_metrics_arg(p)  # completed / failed / running actions of this executor
    p.set_defaults(func=run_executor)

    add_retry_policy_parser(sub)

    p = sub.add_parser("send", help="submit an action and optionally wait for its result")
    p.add_argument("kind")
    add_bus_args(p)
    p.add_argument("--payload", default="null", help="JSON payload")
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--deadline", type=float, default=None, metavar="S")
    p.add_argument("--key", default=None, help="idempotency key")
    p.add_argument(
        "--session",
        default=None,
        metavar="ID",
        help="the next step of this ordered session: it starts once every earlier step has ended",
    )
    p.add_argument(
        "--on-failure",
        choices=[f.value for f in SessionFailure],
        default=SessionFailure.CANCEL.value,
        help="if this step is dead-lettered, the session's later steps end canceled (default), "
        "hold until it is requeued or purged, or continue",
    )
    p.add_argument(
        "--max-attempts",
        type=at_least_one,
        default=None,
        help="this action's own tries before dead-lettering (default: the queue's policy of its kind)",
    )
    p.add_argument(
        "--backoff",
        type=float,
        default=None,
        metavar="S",
        help="with --max-attempts: delay after its first failure, seconds (doubles per failure)",
    )
    p.add_argument("--wait", action="store_true", help="print the result when it ends")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--sign", metavar="KEY.pem", default=None, help="sign the action with this private key")
    p.add_argument("--ttl", type=float, default=60.0, help="signature lifetime in seconds (retries included)")
    _add_connect_timeout(p, "the broker or the queue service", 30.0)
    add_credential_args(p)
    p.set_defaults(func=run_send)

    p = sub.add_parser("dlq", help="dead-letter queue: list | show ID | requeue ID | purge")
    p.add_argument("what", choices=["list", "show", "requeue", "purge"])
    p.add_argument("id", nargs="?")
    add_bus_args(p)
    add_credential_args(p)
    p.set_defaults(func=run_dlq)

    p = sub.add_parser(
        "actions", help="live view of the action queue: backlog, in flight, rates, redeliveries, dead letters"
    )
    add_bus_args(p)
    p.add_argument(
        "--duration", type=float, default=0.0, help="stop after this many seconds (default: never)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON document per refresh")
    add_credential_args(p)
    add_metrics_arg(p)  # also serves the backlog as JSON on /backlog (KEDA's metrics-api scaler)
    p.set_defaults(func=run_actions)


def _nonce_db(args: argparse.Namespace, namespace: str) -> Path:
    """Where an executor keeps the signature nonces it saw (across restarts)."""
    if args.nonce_db:
        return Path(args.nonce_db)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    folder = Path(base) / "embodied_bus"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"nonces-{namespace}.db"


def _add_connect_timeout(p: argparse.ArgumentParser, what: str, default: float | None) -> None:
    shown = "wait until it answers" if default is None else f"default {default:g} s"
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=default,
        metavar="S",
        help=f"how long to wait for {what} while it is away, at start or later ({shown})",
    )


def _wait_s(args: argparse.Namespace) -> float:
    return math.inf if args.connect_timeout is None else float(args.connect_timeout)


def load_handlers(spec: str) -> dict[str, Any]:
    """``module:OBJECT`` → a dict of kind → handler.

    Raises:
        BusConfigError: The module or object is missing or not a dict of callables.
    """
    mod_name, sep, obj_name = spec.partition(":")
    if not sep:
        raise BusConfigError(f"--handlers expects module:OBJECT, got {spec!r}")
    try:
        obj = getattr(importlib.import_module(mod_name), obj_name)
    except (ImportError, AttributeError) as err:
        raise BusConfigError(f"cannot load handlers {spec!r}: {err}") from err
    if not isinstance(obj, dict) or not all(callable(v) for v in obj.values()):
        raise BusConfigError(f"{spec!r} must be a dict of kind -> async handler")
    return obj


async def run_queue(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    install_stop_signals(stop)
    if not parse_bus_url(args.bus).needs_queue_service:
        raise BusConfigError(
            f"no queue service is needed on Pulsar ({args.bus}): planners and executors use its "
            "topics directly; run `embodied-bus queue` on Zenoh"
        )
    async with open_bus(args.bus, namespace=args.ns) as bus:
        ready = asyncio.Event()
        sealer, trust = credentials(args)
        service = QueueService(
            bus, args.db, policies_from_args(args), keep_ended=args.keep_ended, sealer=sealer, trust=trust
        )
        task = asyncio.create_task(service.run(stop, ready))
        await ready.wait()
        print(f"action queue serving on {args.bus} (db {args.db})", flush=True)
        state_task = await _serve_state(bus, args, stop)
        exporter = None
        if args.metrics_port is not None:
            from embodied_bus.metrics import MetricsExporter

            exporter = MetricsExporter(args.metrics_port)
            view = ActionsView()
            exporter.add_actions(lambda: view.update(service.backlog(), time.monotonic()))
            where = f":{exporter.port}"
            print(f"metrics on {where}/metrics, backlog JSON on {where}/backlog", flush=True)
        try:
            await task
            if state_task is not None:
                await state_task
        finally:
            if exporter is not None:
                exporter.close()
    return 0


async def _serve_state(bus: Bus, args: argparse.Namespace, stop: asyncio.Event) -> asyncio.Task[None] | None:
    """The state service beside the queue (``--state-db``), once it serves."""
    if args.state_db == "none":
        return None
    path = Path(args.state_db) if args.state_db else Path(args.db).with_name("state.db")
    ready = asyncio.Event()
    task = asyncio.create_task(StateService(bus, path).run(stop, ready))
    await ready.wait()
    print(f"state service serving on {args.bus} (db {path})", flush=True)
    return task


async def run_executor(args: argparse.Namespace) -> int:
    handlers = load_handlers(args.handlers)
    labels = dict(item.split("=", 1) for item in args.label if "=" in item)
    stop = asyncio.Event()
    install_stop_signals(stop)
    async with open_bus(args.bus, namespace=args.ns, wait_s=_wait_s(args)) as bus:
        verifier = (
            Verifier(
                WatchedAllowList(args.allow), audience=bus.namespace, nonce_db=_nonce_db(args, bus.namespace)
            )
            if args.allow
            else None
        )
        backend = queue_backend(args, args.prefetch)
        if verifier is not None and getattr(backend, "trust", None) is None:
            _log.warning(
                "actions are verified but queue messages are not sealed: a party on the bus can forge "
                "leases and results (give --seal and --trust on Zenoh; broker authorization on Pulsar, "
                "see docs/security.md)"
            )
        ex = Executor(
            bus,
            args.name,
            concurrency=args.concurrency,
            labels=labels,
            verifier=verifier,
            connect_timeout_s=args.connect_timeout,
            backend=backend,
        )
        for kind, fn in handlers.items():
            ex.handler(kind)(fn)
        exporter = None
        if args.metrics_port is not None:
            from embodied_bus.metrics import MetricsExporter

            exporter = MetricsExporter(args.metrics_port)
            exporter.add_executor(ex.stats)
            print(f"metrics on :{exporter.port}/metrics", flush=True)
        print(f"executor {ex.name} running {', '.join(sorted(handlers))}", flush=True)
        try:
            await ex.run(stop)
        finally:
            if exporter is not None:
                exporter.close()
        print(json.dumps({"executor": ex.name, "completed": ex.completed, "failed": ex.failed}))
    return 0


async def run_send(args: argparse.Namespace) -> int:
    try:
        payload = json.loads(args.payload)
    except json.JSONDecodeError as err:
        raise ActionError(f"--payload is not valid JSON: {err}") from err
    async with open_bus(args.bus, namespace=args.ns, wait_s=_wait_s(args)) as bus:
        signer = (
            Signer(load_private_key(args.sign), ttl_s=args.ttl, audience=bus.namespace) if args.sign else None
        )
        async with Planner(
            bus, signer=signer, connect_timeout_s=_wait_s(args), backend=queue_backend(args)
        ) as planner:
            return await _send(args, bus, planner, payload)


def _own_retry(args: argparse.Namespace) -> RetryPolicy | None:
    """``send --max-attempts [--backoff]``: the action's own policy (None: the queue's)."""
    if args.max_attempts is None:
        if args.backoff is not None:
            raise BusConfigError("--backoff needs --max-attempts (the action's own retry policy)")
        return None
    backoff_s = DEFAULT_RETRY.initial_backoff_s if args.backoff is None else args.backoff
    return retry_policy(args.max_attempts, backoff_s)


async def _send(args: argparse.Namespace, bus: Bus, planner: Planner, payload: Any) -> int:
    """Submit one action; with --wait print its outcome."""
    h = await planner.submit(
        args.kind,
        payload,
        priority=args.priority,
        deadline_s=args.deadline,
        idempotency_key=args.key,
        session=args.session,
        on_failure=args.on_failure,
        retry=_own_retry(args),
    )
    if not args.wait:
        print(json.dumps({"id": h.id, "duplicate": h.duplicate, "session": args.session}))
        return 0
    watcher = asyncio.create_task(_warn_without_executor(bus, args.kind))
    try:
        done = await h.result(timeout_s=args.timeout)
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    print(
        json.dumps(
            {
                "id": done.id,
                "status": done.status.value,
                "session": done.session,
                "ended_reason": done.ended_reason,
                "result": done.result,
                "attempts": [
                    {"executor": a.executor, "outcome": a.outcome, "reason": a.reason} for a in done.attempts
                ],
            }
        )
    )
    return 0 if done.status.value == "succeeded" else 1


#: How long `send --wait` gives executors to show up before it warns that none runs the kind, s.
EXECUTOR_GRACE_S = 2.0


async def _warn_without_executor(bus: Bus, kind: str) -> None:
    """Tell the user (stderr) when no live executor has announced ``kind``: the action then
    waits in the queue until one does, which otherwise looks like a hang."""
    live: dict[str, str] = {}

    def changed(member: str, value: str, joined: bool) -> None:
        if joined:
            live[member] = value
        else:
            live.pop(member, None)

    group = await membership(bus.engine, "watching the executors").watch_group(EXECUTOR_GROUP, changed)
    try:
        await asyncio.sleep(EXECUTOR_GRACE_S)
        if not executors_with(live, kind):
            print(
                f"warning: no live executor runs {kind!r} (executors seen: {sorted(live) or 'none'}); "
                "the action stays queued until one does",
                file=sys.stderr,
                flush=True,
            )
    finally:
        await group.leave()


async def run_dlq(args: argparse.Namespace) -> int:
    backend = queue_backend(args)
    async with (
        open_bus(args.bus, namespace=args.ns) as bus,
        Planner(bus, backend=backend) as planner,
    ):
        if args.what in ("show", "requeue") and not args.id:
            raise BusConfigError(f"dlq {args.what} needs an action id")
        if args.what == "list":
            rows = [
                {
                    "id": a.id,
                    "kind": a.kind,
                    "session": a.session,
                    "attempts": a.attempt_count,
                    "last_reason": a.attempts[-1].reason if a.attempts else "",
                }
                for a in await planner.dead_letters()
            ]
            print(
                fmt_table(rows, ["id", "kind", "session", "attempts", "last_reason"])
                if rows
                else "dead-letter queue is empty"
            )
        elif args.what == "show":
            a = await planner.get(args.id)
            if a is None:
                print(f"no action {args.id}", file=sys.stderr)
                return 1
            print(f"action {a.id}: kind={a.kind} status={a.status.value} priority={a.priority}")
            for t in a.attempts:
                print(
                    f"attempt {t.number}: executor={t.executor or '-'} outcome={t.outcome} reason={t.reason}"
                )
        elif args.what == "requeue":
            print(json.dumps({"id": (await planner.requeue(args.id)).id}))
        else:
            print(json.dumps({"purged": await planner.purge_dead()}))
    return 0


#: The ended statuses counted by the live view's rate.
_ENDED = ("succeeded", "dead", "canceled")


class ActionsView:
    """What ``embodied-bus actions`` shows, from successive backlog replies
    (:meth:`Planner.backlog`): transport-free.

    Rates are the change of a count between two replies over the time between them, never
    below zero (a Zenoh queue service reports what it pruned, so its count of ended actions
    only grows; a Pulsar state-log view forgets its oldest ended actions past its bound).
    """

    def __init__(self) -> None:
        self._last: tuple[float, int, int] | None = None  # (time s, ended, redeliveries)

    def update(self, reply: Backlog, now_s: float) -> dict[str, Any]:
        """The view of one backlog received at ``now_s`` (monotonic seconds)."""
        as_dict = reply.as_dict()
        backlog: dict[str, dict[str, int]] = as_dict["backlog"]
        totals: dict[str, int] = as_dict["stats"]
        redeliveries = reply.redeliveries
        ended = sum(int(totals.get(k, 0)) for k in _ENDED) + reply.pruned
        kinds: dict[str, dict[str, int]] = {}
        for key, row in backlog.items():
            kind = key.rpartition("/p")[0] or key
            into = kinds.setdefault(kind, {"queued": 0, "leased": 0, "retrying": 0, "dead": 0, "blocked": 0})
            for state, n in row.items():
                into[state] = into.get(state, 0) + int(n)
        rates: dict[str, float | None] = {"ended_per_s": None, "redeliveries_per_s": None}
        if self._last is not None and now_s > self._last[0]:
            dt = now_s - self._last[0]
            rates["ended_per_s"] = round(max(0, ended - self._last[1]) / dt, 2)
            rates["redeliveries_per_s"] = round(max(0, redeliveries - self._last[2]) / dt, 2)
        self._last = (now_s, ended, redeliveries)
        column = reply.column_totals()
        return {
            "backlog": backlog,
            "kinds": kinds,
            "queued": column["queued"],
            "in_flight": column["leased"],
            "retrying": column["retrying"],
            "dead_letters": column["dead"],
            "ended": ended,
            "redeliveries": redeliveries,
            "rates": rates,
            "totals": totals,
        }

    @staticmethod
    def text(view: dict[str, Any]) -> str:
        """The view as a table and a summary line."""
        rows = [{"kind/priority": k, **v} for k, v in sorted(view["backlog"].items())]
        table = (
            fmt_table(rows, ["kind/priority", "queued", "leased", "retrying", "dead"])
            if rows
            else "no actions"
        )
        rates = view["rates"]

        def rate(key: str) -> str:
            return "" if rates[key] is None else f" ({rates[key]:g}/s)"

        summary = (
            f"queued {view['queued']}  in flight {view['in_flight']}  retrying {view['retrying']}  "
            f"dead letters {view['dead_letters']}  ended {view['ended']}{rate('ended_per_s')}  "
            f"redeliveries {view['redeliveries']}{rate('redeliveries_per_s')}"
        )
        return f"{table}\n{summary}"


async def run_actions(args: argparse.Namespace) -> int:
    from embodied_bus.metrics import MetricsExporter

    stop = asyncio.Event()
    install_stop_signals(stop)
    t0 = time.monotonic()
    view = ActionsView()
    latest: dict[str, Any] = {}
    exporter = MetricsExporter(args.metrics_port) if args.metrics_port is not None else None
    if exporter is not None:
        exporter.add_actions(lambda: dict(latest))
        print(
            f"metrics on :{exporter.port}/metrics, backlog JSON on :{exporter.port}/backlog", file=sys.stderr
        )
    try:
        backend = queue_backend(args)
        async with (
            open_bus(args.bus, namespace=args.ns) as bus,
            Planner(bus, backend=backend) as planner,
        ):
            while not stop.is_set():
                shown = view.update(await planner.backlog(), time.monotonic())
                latest.clear()
                latest.update(shown)
                if args.json:
                    print(json.dumps(shown), flush=True)
                else:
                    print("\x1b[2J\x1b[H" if sys.stdout.isatty() else "", end="")
                    print(ActionsView.text(shown), flush=True)
                if args.duration and time.monotonic() - t0 >= args.duration:
                    break
                try:
                    await asyncio.wait_for(stop.wait(), 1.0)
                except TimeoutError:
                    pass
    finally:
        if exporter is not None:
            exporter.close()
    return 0
