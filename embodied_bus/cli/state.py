"""``embodied-bus state``: put, get, watch and delete latest values; host a state service."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from typing import Any

from embodied_bus.bus import open_bus
from embodied_bus.cli.common import add_bus_args, fmt_table, install_stop_signals
from embodied_bus.engines import parse_bus_url
from embodied_bus.errors import BusConfigError
from embodied_bus.state import StateEntry, StateService, StateTable, open_state

__all__ = ["add_parser", "parse_value"]

#: Table the commands use without ``--table``.
DEFAULT_TABLE = "default"


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("state", help="latest-value state: put | get | watch | delete | serve")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)

    v = verbs.add_parser("put", help="store a value under a key (durable once the command returns)")
    v.add_argument("key")
    v.add_argument("value", help="JSON (text that is not JSON is stored as a JSON string)")
    v.add_argument("--raw", action="store_true", help="store VALUE's UTF-8 bytes as bytes, not JSON")
    _common(v)
    v.set_defaults(func=run_put)

    v = verbs.add_parser("get", help="print one key's value, or every key's")
    v.add_argument("key", nargs="?", help="the key (default: every key)")
    v.add_argument("--prefix", default="", help="only keys starting with this")
    _common(v)
    v.set_defaults(func=run_get)

    v = verbs.add_parser("watch", help="print the current values, then every change, until Ctrl-C")
    v.add_argument("prefix", nargs="?", default="", help="only keys starting with this")
    v.add_argument("--count", type=int, default=0, help="exit after N changes (0 = never)")
    v.add_argument("--changes-only", action="store_true", help="do not print the current values first")
    _common(v)
    v.set_defaults(func=run_watch)

    v = verbs.add_parser("delete", help="remove keys")
    v.add_argument("keys", nargs="+")
    _common(v)
    v.set_defaults(func=run_delete)

    v = verbs.add_parser("serve", help="host the state service of a namespace (Zenoh)")
    add_bus_args(v)
    v.add_argument("--db", default="state.db", help="SQLite file (default state.db)")
    v.set_defaults(func=run_serve)


def _common(p: argparse.ArgumentParser) -> None:
    add_bus_args(p)
    p.add_argument("--table", default=DEFAULT_TABLE, help=f"state table (default {DEFAULT_TABLE})")
    p.add_argument("--json", action="store_true", help="print JSON (one document per line)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S", help="wait for the store this long")


def parse_value(text: str, *, raw: bool = False) -> Any:
    """A command-line value: its UTF-8 bytes with ``raw``, else its JSON, else the text itself."""
    if raw:
        return text.encode()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _shown(entry: StateEntry) -> str:
    value = entry.value
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return f"<{len(value)} bytes>"
    return json.dumps(value)


def _print(entry: StateEntry, as_json: bool) -> None:
    if as_json:
        print(json.dumps(entry.to_json()), flush=True)
    elif entry.deleted:
        print(f"{entry.key} deleted", flush=True)
    else:
        print(f"{entry.key} = {_shown(entry)}", flush=True)


async def _open(args: argparse.Namespace) -> tuple[Any, StateTable]:
    from embodied_bus.state import StateOptions

    bus = await open_bus(args.bus, namespace=args.ns)
    try:
        return bus, await open_state(bus, args.table, StateOptions(request_timeout_s=args.timeout))
    except BaseException:
        await bus.close()
        raise


async def run_put(args: argparse.Namespace) -> int:
    bus, table = await _open(args)
    try:
        await table.put(args.key, parse_value(args.value, raw=args.raw))
        if args.json:
            print(json.dumps({"key": args.key, "stored": True}), flush=True)
    finally:
        await bus.close()
    return 0


async def run_get(args: argparse.Namespace) -> int:
    bus, table = await _open(args)
    try:
        if args.key is not None:
            entry = table.entry(args.key)
            if entry is None:
                print(f"no key {args.key!r} in state table {args.table!r}", file=sys.stderr)
                return 1
            print(json.dumps(entry.to_json()) if args.json else _shown(entry), flush=True)
            return 0
        entries = sorted(table.snapshot(args.prefix).values(), key=lambda e: e.key)
        if args.json:
            print(json.dumps([e.to_json() for e in entries]), flush=True)
        else:
            now_ns = time.time_ns()
            rows = [
                {"KEY": e.key, "VALUE": _shown(e), "AGE_S": f"{(now_ns - e.stamp_ns) / 1e9:.1f}"}
                for e in entries
            ]
            print(fmt_table(rows, ["KEY", "VALUE", "AGE_S"]), flush=True)
    finally:
        await bus.close()
    return 0


async def run_watch(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    install_stop_signals(stop)
    bus, table = await _open(args)
    try:
        changes = 0

        async def follow() -> None:
            nonlocal changes
            current = len(table.snapshot(args.prefix)) if not args.changes_only else 0
            async for entry in table.watch(args.prefix, initial=not args.changes_only):
                _print(entry, args.json)
                if current:
                    current -= 1
                    continue
                changes += 1
                if args.count and changes >= args.count:
                    return

        task = asyncio.create_task(follow())
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait([task, stopping], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    finally:
        await bus.close()
    return 0


async def run_delete(args: argparse.Namespace) -> int:
    bus, table = await _open(args)
    try:
        await table.delete(*args.keys)
    finally:
        await bus.close()
    return 0


async def run_serve(args: argparse.Namespace) -> int:
    if not parse_bus_url(args.bus).needs_queue_service:
        raise BusConfigError(
            f"no state service is needed on Pulsar ({args.bus}): each table is a compacted topic; "
            "run `embodied-bus state serve` on Zenoh"
        )
    stop = asyncio.Event()
    install_stop_signals(stop)
    async with open_bus(args.bus, namespace=args.ns) as bus:
        ready = asyncio.Event()
        task = asyncio.create_task(StateService(bus, args.db).run(stop, ready))
        await ready.wait()
        print(f"state service serving on {args.bus} (db {args.db})", flush=True)
        await task
    return 0
