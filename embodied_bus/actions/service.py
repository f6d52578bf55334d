"""The queue service: an :class:`ActionStore` served over the bus (Zenoh request/reply).

Any process can host it (``embodied-bus queue``, or inside a planner). Requests are JSON:
``submit``, ``lease``, ``retire``, ``extend``, ``checkpoint``, ``ack``, ``ack_many`` (acks that ended
together, each answered on its own), ``nack``, ``get``, ``get_many`` (the terminal ones among
up to 1000 ids), ``cancel``, ``dlq``, ``backlog``. Executors announce themselves in the
``actions-executors`` group; when one dies its leases are released at once (each counts as a
lost attempt). Results go out on
the lightweight topic ``actions/result/<id>`` and are stored, so a planner that was away can
fetch them with ``get``.

Dispatch is pull with a push fast path: an executor leases what is ready (``lease``); when a
lease leaves it with free slots it is recorded as idle, and a later submit leases new actions
to idle executors at once and sends them on ``actions/assign/<executor>`` (congestion control
block), saving the wake-up and lease round trip. An executor's next ``lease`` request is
reduced by what was pushed to it since its previous one, so the concurrency limit holds even
when a push and a lease cross. ``retire`` (an executor stopping) ends pushes to it. A push that
never arrives (the executor died) is released like any lease of a lost executor.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from embodied_bus.actions.model import (
    MAX_PAYLOAD_BYTES,
    Action,
    ActionError,
    action_from_dict,
    action_to_dict,
    decode_action,
)
from embodied_bus.actions.policy import DEFAULT_RETRY, RetryPolicy
from embodied_bus.actions.store import DEFAULT_KEEP_ENDED, ActionStore
from embodied_bus.bus import Bus
from embodied_bus.model.limits import DEFAULT_LIMITS

__all__ = ["EXECUTOR_GROUP", "SERVICE", "QueueService"]

_log = logging.getLogger("embodied_bus.actions.service")

#: Request/reply service name.
SERVICE = "actions"
#: Liveliness group of executors.
EXECUTOR_GROUP = "actions-executors"
#: How often expired leases are swept, seconds.
SWEEP_S = 0.2
#: How often ended actions beyond the store's ``keep_ended`` are deleted, seconds (and once at
#: start).
PRUNE_S = 60.0
#: Largest request accepted, bytes (a batch of submits included).
MAX_REQUEST_BYTES = 16 * 1024 * 1024


def _ok(**kw: Any) -> bytes:
    return json.dumps({"ok": True, **kw}).encode()


def _err(msg: str) -> bytes:
    return json.dumps({"ok": False, "error": msg}).encode()


class QueueService:
    """Serves a durable action queue on a bus.

    Args:
        bus: The bus to serve on (Zenoh).
        db_path: SQLite file (WAL, fsync on commit).
        policy: Retry policy.
        keep_ended: Ended actions (succeeded or canceled) kept for planners that look them up
            later: the newest this many by submit order; older ones are deleted every
            :data:`PRUNE_S` seconds (dead letters stay until requeued or purged).
    """

    def __init__(
        self,
        bus: Bus,
        db_path: str | Path,
        policy: RetryPolicy = DEFAULT_RETRY,
        *,
        keep_ended: int = DEFAULT_KEEP_ENDED,
    ) -> None:
        self.bus = bus
        self.store = ActionStore(db_path, policy, keep_ended=keep_ended)
        self._lock = threading.Lock()
        self._live: set[str] = set()
        self._handle: Any = None
        self._closed = False
        #: Requests answered with an error (malformed, invalid or oversized).
        self.bad_requests = 0
        #: Idle executors: name -> their last lease request (kinds, labels, lease_s) and free slots.
        self._idle: dict[str, tuple[list[str], dict[str, str], float, int]] = {}
        #: Actions pushed to each executor since its last lease request.
        self._pushed_since: dict[str, int] = {}
        #: Actions handed to idle executors on submit (no lease round trip).
        self.pushed = 0
        self._request_bytes = 0  # of the request being dispatched

    def _executor_change(self, member: str, _value: str, joined: bool) -> None:
        with self._lock:
            if self._closed:
                return
            if joined:
                self._live.add(member)
                return
            self._live.discard(member)
            self._idle.pop(member, None)
            self._pushed_since.pop(member, None)
            lost = self.store.release_lost(executor=member)
        for a in lost:
            self._wake(a.kind)

    def _wake(self, kind: str) -> None:
        if not self._closed:
            try:
                self.bus.engine.notify(f"actions/wake/{kind}", b"")
            except Exception:
                pass

    def idle_executors(self) -> dict[str, int]:
        """Executors waiting for work that new actions are pushed to: name -> free slots."""
        with self._lock:
            return {name: rec[3] for name, rec in self._idle.items()}

    def _push_to_idle(self, kinds: set[str]) -> set[str]:
        """Lease newly submitted actions of ``kinds`` to idle executors and send them (under
        the lock). Returns the kinds whose ready actions were all handed out (no wake needed)."""
        done: set[str] = set()
        for name, (ex_kinds, labels, lease_s, free) in list(self._idle.items()):
            wanted = [k for k in ex_kinds if k in kinds and k not in done]
            if not wanted:
                continue
            leased = self.store.lease_many(
                name, wanted, free, labels=labels, lease_s=lease_s, live_executors=self._live
            )
            if len(leased) < free:
                done.update(wanted)  # it took all it could see: nothing of these kinds is left
            if not leased:
                continue
            try:
                self.bus.engine.notify(
                    f"actions/assign/{name}",
                    b"[" + b",".join(self.store.encoded(a) for a in leased) + b"]",
                    block=True,
                )
            except Exception:  # the lease expires or the executor's loss releases it
                pass
            self.pushed += len(leased)
            self._pushed_since[name] = self._pushed_since.get(name, 0) + len(leased)
            if len(leased) >= free:
                del self._idle[name]
            else:
                self._idle[name] = (ex_kinds, labels, lease_s, free - len(leased))
        for expired in self.store.take_expired():
            self._publish_result(expired)
        return done

    def _publish_result(self, a: Action) -> None:
        self.bus.engine.notify(f"actions/result/{a.id}", self.store.encoded(a))

    def handle(self, raw: bytes) -> bytes:
        """One request (called on engine threads). A bad request is answered with the reason
        and counted in :attr:`bad_requests`; the service keeps serving."""
        reply = self._answer(raw)
        if reply.startswith(b'{"ok": false'):
            self.bad_requests += 1
        return reply

    def _answer(self, raw: bytes) -> bytes:
        if len(raw) > MAX_REQUEST_BYTES:
            return _err(f"request of {len(raw)} bytes exceeds {MAX_REQUEST_BYTES} bytes")
        request_bytes = len(raw)
        try:
            req = json.loads(raw)
            op = req.get("op")
        except (ValueError, AttributeError, RecursionError):
            return _err("request is not a JSON object")
        for key in ("id", "executor", "reason"):
            if key in req and not isinstance(req[key], str):
                return _err(f"bad {op!r} request: field {key!r} must be a string")
        if "kinds" in req and not (
            isinstance(req["kinds"], list) and all(isinstance(k, str) for k in req["kinds"])
        ):
            return _err(f"bad {op!r} request: field 'kinds' must be a list of strings")
        try:
            with self._lock:
                if self._closed:
                    return _err("the action queue service is shutting down")
                self._request_bytes = request_bytes
                return self._dispatch(op, req)
        except ActionError as err:
            return _err(str(err))
        except (
            KeyError,
            TypeError,
            ValueError,
            OverflowError,
            sqlite3.InterfaceError,
            sqlite3.ProgrammingError,
        ) as err:
            return _err(f"bad {op!r} request: missing or wrong field {err}")

    def _lease(self, req: dict[str, Any]) -> list[bytes] | bytes:
        """Lease ready actions to ``req['executor']`` (a lease request, or the ``lease`` part of
        an ack): their stored envelopes, or an error reply."""
        s = self.store
        want = req.get("max", 1)
        if isinstance(want, bool) or not isinstance(want, int) or not 1 <= want <= 256:
            return _err("bad 'lease' request: 'max' must be an integer 1..256")
        executor = req["executor"]
        if not isinstance(executor, str) or not isinstance(req["kinds"], list):
            return _err("bad 'lease' request: 'executor' must be a string and 'kinds' a list")
        labels = req.get("labels") or {}
        lease_s = req.get("lease_s", 10.0)
        if not isinstance(labels, dict) or isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)):
            return _err("bad 'lease' request: 'labels' must be an object and 'lease_s' a number")
        # pushes the executor may not have counted when it asked: never exceed its limit
        free = want - self._pushed_since.pop(executor, 0)
        leased = (
            s.lease_many(
                executor, req["kinds"], free, labels=labels, lease_s=lease_s, live_executors=self._live
            )
            if free > 0
            else []
        )
        bodies = [s.encoded(a) for a in leased]
        if free - len(leased) > 0 and req.get("push", False):
            self._idle[executor] = (list(req["kinds"]), labels, float(lease_s), free - len(leased))
        else:
            self._idle.pop(executor, None)
        for expired in s.take_expired():  # passed by on the way: never started
            self._publish_result(expired)
        return bodies

    def _with_lease(self, reply: bytes, req: dict[str, Any]) -> bytes:
        """An ack's reply, plus the next actions when the ack asked for them (``lease``: the
        fields of a lease request): one round trip instead of two per action under a backlog."""
        lease = req.get("lease")
        if lease is None:
            return reply
        if not isinstance(lease, dict):
            return _err("bad ack request: 'lease' must be an object with the fields of a lease request")
        leased = self._lease(lease)
        if isinstance(leased, bytes):
            return leased
        return reply[:-1] + b', "actions": [' + b",".join(leased) + b"]}"

    def _dispatch(self, op: str, req: dict[str, Any]) -> bytes:
        s = self.store
        if op == "submit":
            out = []
            if not isinstance(req["actions"], list):
                return _err("bad 'submit' request: 'actions' must be a list")
            if self._request_bytes <= DEFAULT_LIMITS.max_action_bytes:
                # every envelope is smaller than the request: no per-action JSON round trip
                big = self._request_bytes > MAX_PAYLOAD_BYTES
                actions = [action_from_dict(env, check_payload=big) for env in req["actions"]]
            else:
                actions = [decode_action(json.dumps(env)) for env in req["actions"]]
            stored = s.submit_many(actions)
            for a, new in stored:
                out.append({"id": a.id, "duplicate": not new, "status": a.status.value})
            kinds = {a.kind for a, new in stored if new}
            if kinds:
                # an action with a selector may be hidden from the idle executors: wake the rest
                plain = kinds - {a.kind for a, new in stored if new and a.selector}
                for kind in kinds - (self._push_to_idle(kinds) & plain):
                    self._wake(kind)
            return _ok(actions=out)
        if op == "lease":
            leased = self._lease(req)
            if isinstance(leased, bytes):
                return leased
            # the stored envelopes spliced in as they are (no decode and re-encode per action)
            first = leased[0] if leased else b"null"
            return b'{"ok": true, "action": ' + first + b', "actions": [' + b",".join(leased) + b"]}"
        if op == "retire":
            self._idle.pop(req["executor"], None)
            return _ok()
        if op == "extend":
            a = s.extend(req["id"], req["executor"], req.get("lease_s", 10.0))
            return _ok(cancel_requested=a.cancel_requested)
        if op == "checkpoint":
            s.checkpoint(req["id"], req["executor"], req.get("state"))
            return _ok()
        if op == "ack":
            a = s.ack(req["id"], req["executor"], req.get("result"))
            self._publish_result(a)
            return self._with_lease(_ok(status=a.status.value), req)
        if op == "ack_many":
            acks = req["acks"]
            if not isinstance(acks, list) or len(acks) > 256 or not all(isinstance(x, dict) for x in acks):
                return _err("bad 'ack_many' request: 'acks' must be a list of at most 256 ack objects")
            for item in acks:
                if not isinstance(item.get("id"), str) or not isinstance(item.get("executor"), str):
                    return _err("bad 'ack_many' request: every ack needs string fields 'id' and 'executor'")
            answers: list[dict[str, Any]] = []
            outcomes = s.ack_many([(x["id"], x["executor"], x.get("result")) for x in acks])
            for outcome in outcomes:  # each ack stands alone: one refused ack sinks no other
                if isinstance(outcome, ActionError):
                    answers.append({"ok": False, "error": str(outcome)})
                else:
                    self._publish_result(outcome)
                    answers.append({"ok": True, "status": outcome.status.value})
            return self._with_lease(_ok(answers=answers), req)
        if op == "nack":
            a = s.nack(
                req["id"], req["executor"], str(req.get("reason", "")), permanent=bool(req.get("permanent"))
            )
            if a.status.terminal:
                self._publish_result(a)
            else:
                retry = threading.Timer(
                    max(0.0, s.policy.backoff_s(a.attempt_count)) + 0.01, self._wake, (a.kind,)
                )
                retry.daemon = True  # a pending wake-up never holds the process open
                retry.start()
            return _ok(status=a.status.value)
        if op == "get_many":
            ids = req["ids"]
            if not isinstance(ids, list) or len(ids) > 1000 or not all(isinstance(i, str) for i in ids):
                return _err("bad 'get_many' request: 'ids' must be a list of at most 1000 strings")
            return _ok(done=[action_to_dict(a) for a in s.terminal_among(ids)])
        if op == "get":
            found = s.get(req["id"])
            return _ok(action=action_to_dict(found) if found else None)
        if op == "cancel":
            canceled = s.cancel(req["id"])
            if canceled is not None and canceled.status.terminal:
                self._publish_result(canceled)
            return _ok(action=action_to_dict(canceled) if canceled else None)
        if op == "dlq":
            what = req.get("what", "list")
            if what == "list":
                return _ok(actions=[action_to_dict(a) for a in s.dead_letters()])
            if what == "requeue":
                a = s.requeue(req["id"])
                self._wake(a.kind)
                return _ok(id=a.id)
            if what == "purge":
                return _ok(purged=s.purge_dead())
            return _err(f"unknown dlq request {what!r}")
        if op == "backlog":
            return _ok(**self._backlog())
        return _err(f"unknown request {op!r}")

    def _backlog(self) -> dict[str, Any]:
        s = self.store
        return {
            "backlog": s.backlog(),
            "stats": s.stats(),
            "redeliveries": s.redeliveries,
            "pruned": s.pruned,
        }

    def backlog(self) -> dict[str, Any]:
        """What a planner's ``backlog`` request answers (see :meth:`Planner.backlog`), from any
        thread; empty once the service stopped."""
        with self._lock:
            return {} if self._closed else self._backlog()

    async def run(self, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        """Serve until ``stop``; sweeps expired leases every :data:`SWEEP_S`."""
        self._handle = self.bus.engine.serve(SERVICE, self.handle)
        group = await self.bus.engine.watch_group(EXECUTOR_GROUP, self._executor_change)
        if ready is not None:
            ready.set()
        next_prune = time.monotonic()
        try:
            while not stop.is_set():
                if time.monotonic() >= next_prune:
                    next_prune = time.monotonic() + PRUNE_S
                    with self._lock:
                        pruned = self.store.prune()
                    if pruned:
                        keep = self.store.keep_ended
                        _log.info("deleted %d ended action(s) beyond the newest %d", pruned, keep)
                try:
                    await asyncio.wait_for(stop.wait(), SWEEP_S)
                except TimeoutError:
                    pass
                with self._lock:
                    lost = self.store.release_lost(now_ns=time.time_ns())
                    self.store.expire_deadlines()
                    expired = self.store.take_expired()
                for a in lost:
                    self._wake(a.kind)
                for a in expired:
                    self._publish_result(a)
        finally:
            self._handle.undeclare()
            await group.leave()
            with self._lock:  # an answer in flight on an engine thread finishes first
                self._closed = True
                self.store.close()
