"""Planner API: submit actions, await results, stream feedback, cancel, look up by id."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from embodied_bus.actions.model import (
    Action,
    ActionError,
    ActionStatus,
    action_from_dict,
    action_to_dict,
    decode_action,
)
from embodied_bus.actions.policy import DEFAULT_RETRY, RetryPolicy
from embodied_bus.actions.service import SERVICE
from embodied_bus.bus import Bus
from embodied_bus.errors import BusClosedError, BusConnectionError
from embodied_bus.security.signing import Signer

__all__ = ["ActionHandle", "Planner"]

#: How long a request waits for the queue service, seconds.
REQUEST_TIMEOUT_S = 5.0
#: Results a planner keeps for actions nobody awaited yet.
RESULT_CACHE = 10_000
#: First look at the queue for awaited results the subscription did not bring, seconds.
POLL_FIRST_S = 1.0
#: Longest pause between such looks while nothing turns up, seconds.
POLL_MAX_S = 5.0
#: Action ids per batched look.
POLL_BATCH = 500
#: Finished waits stay in a planner's deadline heap until it holds twice this many entries
#: and twice as many as the waits still open (then they are swept out).
DEADLINE_PRUNE_AT = 1024


class Planner:
    """Sends actions through the action queue of a bus.

    On Zenoh the queue is a queue service (``embodied-bus queue`` or :class:`QueueService`
    hosted anywhere); on Apache Pulsar it is Pulsar's topics and subscriptions
    (:mod:`embodied_bus.actions.pulsar_queue`), with no service to run.

    Args:
        bus: The bus.
        timeout_s: How long a request waits for the queue service (Zenoh).
        signer: Sign every submitted action (executors with a verifier run only signed ones).
        policy: Retry policy for actions requeued from the dead-letter queue on Pulsar (on
            Zenoh the queue service's policy applies).

    Use it as an async context manager, or call :meth:`close`, to release its reply channel.
    """

    def __init__(
        self,
        bus: Bus,
        *,
        timeout_s: float = REQUEST_TIMEOUT_S,
        signer: Signer | None = None,
        policy: RetryPolicy = DEFAULT_RETRY,
    ) -> None:
        self.bus = bus
        self.timeout_s = timeout_s
        self.signer = signer
        self._pulsar: Any = None
        if bus.engine.name == "pulsar":
            from embodied_bus.actions.pulsar_queue import PulsarActionQueue

            self._pulsar = PulsarActionQueue(bus.engine, policy)  # type: ignore[arg-type]
        # One subscription for every result (not one per action), declared before the first
        # submit so results that arrive before anyone awaits them are kept (bounded).
        self._results: OrderedDict[str, Action] = OrderedDict()
        self._waiters: dict[str, list[asyncio.Future[Action]]] = {}
        self._results_sub: Any = None
        self._poller: asyncio.Task[None] | None = None
        # result waits with a timeout: (loop time, seq, future), earliest first
        self._deadlines: list[tuple[float, int, asyncio.Future[Action]]] = []
        self._deadline_seq = itertools.count()
        self._deadline_timer: asyncio.TimerHandle | None = None
        # feedback streams running: each ends with an error when the planner or its bus closes
        self._feedback_stops: set[Callable[[BaseException], None]] = set()
        self._gone: str | None = None  # why results can no longer come (closed)
        bus.add_close_callback(self._bus_closed)

    async def __aenter__(self) -> Planner:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _bus_closed(self) -> None:
        self._fail_waiters("its bus was closed")

    def _fail_waiters(self, why: str) -> None:
        """Nothing can arrive any more: every awaited result and feedback stream fails with a
        :class:`BusClosedError` that says so."""
        self._gone = why
        waiters, self._waiters = self._waiters, {}
        for action_id, futs in waiters.items():
            for fut in futs:
                if not fut.done():
                    fut.set_exception(_closed_error(action_id, why))
        for stop in list(self._feedback_stops):
            stop(BusClosedError(f"the planner stopped receiving feedback: {why}"))

    async def close(self) -> None:
        """Stop listening for results (and release the Pulsar reply topic and state reader).
        Results still awaited fail with :class:`BusClosedError`."""
        self.bus.remove_close_callback(self._bus_closed)
        self._fail_waiters("the planner was closed")
        if self._poller is not None:
            self._poller.cancel()
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        if self._results_sub is not None and self._pulsar is None:
            self._results_sub.undeclare()
        self._results_sub = None
        if self._pulsar is not None:
            await self._pulsar.close()

    async def _ensure_results_sub(self) -> None:
        if self._results_sub is not None:
            return
        loop = asyncio.get_running_loop()

        def on_result(topic: str, payload: bytes) -> None:  # engine thread
            loop.call_soon_threadsafe(self._settle, topic.rsplit("/", 1)[-1], payload)

        def on_results(results: list[tuple[str, Any]]) -> None:  # receiving thread (Pulsar)
            loop.call_soon_threadsafe(self._settle_many, results)

        if self._pulsar is not None:
            await self._pulsar.listen_results(on_results)
            self._results_sub = on_result
        else:
            self._results_sub = self.bus.engine.listen("actions/result/*", on_result)

    def _settle_many(self, results: list[tuple[str, Action]]) -> None:
        for action_id, envelope in results:
            self._settle(action_id, envelope)

    def _settle(self, action_id: str, payload: bytes | dict[str, Any] | Action) -> None:
        """A result arrived: ``payload`` is the envelope, as JSON bytes, parsed or decoded."""
        try:
            if isinstance(payload, Action):
                action = payload
            elif isinstance(payload, dict):
                action = action_from_dict(payload, check_payload=False)
            else:
                action = decode_action(payload)
        except ActionError:
            return
        self._results[action_id] = action
        while len(self._results) > RESULT_CACHE:
            self._results.popitem(last=False)
        for fut in self._waiters.pop(action_id, []):
            if not fut.done():
                fut.set_result(action)

    def _expire_at(self, when: float, fut: asyncio.Future[Action]) -> None:
        """Fail ``fut`` with a timeout at loop time ``when`` unless it is done by then (one loop
        timer for all waits, at the earliest deadline)."""
        heapq.heappush(self._deadlines, (when, next(self._deadline_seq), fut))
        if len(self._deadlines) > 2 * DEADLINE_PRUNE_AT and len(self._deadlines) > 2 * len(self._waiters):
            self._deadlines = [d for d in self._deadlines if not d[2].done()]  # results came
            heapq.heapify(self._deadlines)
        self._arm_deadline()

    def _arm_deadline(self) -> None:
        heap = self._deadlines
        while heap and heap[0][2].done():
            heapq.heappop(heap)
        if not heap:
            return
        when = heap[0][0]
        timer = self._deadline_timer
        if timer is not None and timer.when() <= when:
            return
        if timer is not None:
            timer.cancel()
        self._deadline_timer = asyncio.get_running_loop().call_at(when, self._expire_due)

    def _expire_due(self) -> None:
        self._deadline_timer = None
        now = asyncio.get_running_loop().time()
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _expire(heapq.heappop(heap)[2])
        self._arm_deadline()

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll_results())

    async def _poll_results(self) -> None:
        """Ask the queue about awaited actions in batches (the fallback to the subscription)."""
        interval_s = POLL_FIRST_S
        while self._waiters:
            await asyncio.sleep(interval_s)
            ids = list(self._waiters)
            found = 0
            for i in range(0, len(ids), POLL_BATCH):
                try:
                    reply = await self._call({"op": "get_many", "ids": ids[i : i + POLL_BATCH]})
                except (ActionError, BusConnectionError, BusClosedError):
                    break
                for env in reply.get("done", []):
                    self._settle(str(env["id"]), env)
                    found += 1
            interval_s = POLL_FIRST_S if found else min(interval_s * 2, POLL_MAX_S)

    async def _call(self, req: dict[str, Any]) -> dict[str, Any]:
        if req.get("op") == "dlq" and req.get("what") == "requeue":  # it runs again: forget the old outcome
            self._results.pop(str(req.get("id")), None)
        if self._pulsar is not None:
            try:
                out: dict[str, Any] = await self._pulsar.call(req)
            except (KeyError, TypeError, ValueError) as err:
                if isinstance(err, ActionError):
                    raise
                raise ActionError(f"bad {req.get('op')!r} request: missing or wrong field {err}") from err
            return out
        raw = await self.bus.engine.request(SERVICE, json.dumps(req).encode(), self.timeout_s)
        if raw is None:
            raise BusConnectionError(f"no action queue service answered within {self.timeout_s:g} s")
        reply: dict[str, Any] = json.loads(raw)
        if not reply.get("ok"):
            raise ActionError(str(reply.get("error")))
        return reply

    async def submit(
        self,
        kind: str,
        payload: Any = None,
        *,
        priority: int = 0,
        deadline_s: float | None = None,
        idempotency_key: str | None = None,
        selector: dict[str, str] | None = None,
    ) -> ActionHandle:
        """Submit one action; returns once it is durably queued.

        Args:
            deadline_s: Never start it after this many seconds from now.

        Raises:
            ActionError: Invalid action (the queue service says why).
            BusConnectionError: No queue service answered.
        """
        import time

        action = Action(
            kind,
            payload,
            priority=priority,
            idempotency_key=idempotency_key,
            selector=selector or {},
            deadline_ns=time.time_ns() + int(deadline_s * 1e9) if deadline_s else 0,
        ).validate()
        return (await self.submit_many([action]))[0]

    async def submit_many(self, actions: Sequence[Action]) -> list[ActionHandle]:
        """Submit a batch in one request (on Zenoh stored atomically: all or none; on Pulsar each
        action is persisted before this returns)."""
        await self._ensure_results_sub()
        signed = [self.signer.sign(a.validate()) if self.signer else a.validate() for a in actions]
        if self._pulsar is None:  # serialized right away by the request
            reply = await self._call({"op": "submit", "actions": [action_to_dict(a) for a in signed]})
        else:  # handed on as copies (own lists and dicts): the queue changes its own
            reply = await self._pulsar.submit([a.copy() for a in signed])
        return [ActionHandle(self, r["id"], duplicate=r["duplicate"]) for r in reply["actions"]]

    async def get(self, action_id: str) -> Action | None:
        """The current state of an action (results of a planner that was away included)."""
        reply = await self._call({"op": "get", "id": action_id})
        return action_from_dict(reply["action"]) if reply["action"] else None

    async def backlog(self) -> dict[str, Any]:
        """The queue's backlog, for dashboards and autoscalers.

        Returns:
            ``backlog``: per ``kind/p<priority>``, the actions queued, leased (running),
            retrying (waiting for their backoff) and dead (dead letters); ``stats``: how many
            actions the queue keeps in each status, ended ones included; ``redeliveries``:
            attempts started on actions that had been started before (Zenoh: since the queue
            service started; Pulsar: over the actions the state log keeps).
        """
        return await self._call({"op": "backlog"})

    async def dead_letters(self) -> list[Action]:
        """The dead-letter queue with every attempt's reason."""
        reply = await self._call({"op": "dlq", "what": "list"})
        return [action_from_dict(a) for a in reply["actions"]]

    def handle(self, action_id: str) -> ActionHandle:
        """A handle on an existing action (e.g. after a planner restart)."""
        return ActionHandle(self, action_id)


class _ResultTimeout(Exception):
    """An awaited result did not come in time (turned into :class:`TimeoutError`)."""


def _closed_error(action_id: str, why: str) -> BusClosedError:
    return BusClosedError(
        f"no result for action {action_id}: {why} before it ended (it goes on in the queue; "
        f"look it up with Planner.get from an open bus)"
    )


def _expire(fut: asyncio.Future[Action]) -> None:
    if not fut.done():
        fut.set_exception(_ResultTimeout())


class ActionHandle:
    """One submitted action: status, result, feedback, cancel."""

    def __init__(self, planner: Planner, action_id: str, *, duplicate: bool = False) -> None:
        self.planner = planner
        self.id = action_id
        #: The submit matched an earlier action with the same idempotency key.
        self.duplicate = duplicate

    async def status(self) -> ActionStatus:
        """Current status."""
        a = await self.planner.get(self.id)
        if a is None:
            raise ActionError(f"unknown action {self.id}")
        return a.status

    async def result(self, timeout_s: float | None = None) -> Action:
        """Wait until the action ends (succeeded, dead-lettered or canceled); returns it.

        Results arrive on the planner's result subscription; the planner also asks the queue
        now and then about every action still awaited (one batched request, after 1 s, then
        less and less often), so a result published before the subscription was routed, or
        while this planner was away, is never missed.

        Raises:
            TimeoutError: It did not end within ``timeout_s`` seconds.
            BusClosedError: The planner or its bus was closed first (the action goes on in the
                queue: look it up later with :meth:`Planner.get`).
        """
        p = self.planner
        if self.id in p._results:
            return p._results[self.id]
        if p._gone is not None:
            raise _closed_error(self.id, p._gone)
        await p._ensure_results_sub()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Action] = loop.create_future()
        p._waiters.setdefault(self.id, []).append(fut)
        p._ensure_poller()
        # one future, and the planner's deadline heap (no wait_for, shield or timer per wait: a
        # planner may await thousands)
        if timeout_s is not None:
            p._expire_at(loop.time() + timeout_s, fut)
        try:
            return await fut
        except _ResultTimeout:
            current = await p.get(self.id)  # one last look before giving up
            if current is not None and current.status.terminal:
                return current
            raise TimeoutError(f"action {self.id} did not end within {timeout_s:g} s") from None
        finally:
            waiters = p._waiters.get(self.id)
            if waiters is not None and fut in waiters:
                waiters.remove(fut)
                if not waiters:
                    del p._waiters[self.id]

    async def feedback(self) -> AsyncIterator[Any]:
        """Feedback messages of the running action until it ends (those sent before the
        stream began are not replayed). Raises :class:`BusClosedError` if the planner or its
        bus is closed first."""
        q: asyncio.Queue[Any] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        end = object()
        planner = self.planner
        if planner._gone is not None:
            raise BusClosedError(f"the planner receives no feedback: {planner._gone}")

        def on_fb(_topic: str, payload: Any) -> None:  # bytes (Zenoh) or parsed JSON (Pulsar)
            if isinstance(payload, bytes):
                try:
                    payload = json.loads(payload)
                except ValueError:  # not ours to crash on: an engine thread
                    return
            loop.call_soon_threadsafe(q.put_nowait, payload)

        def on_result(_topic: str, _payload: Any) -> None:
            loop.call_soon_threadsafe(q.put_nowait, end)

        pulsar_q = self.planner._pulsar
        if pulsar_q is not None:

            def on_reply(topic: str, payload: Any) -> None:
                (on_result if topic.startswith("actions/result/") else on_fb)(topic, payload)

            stop = await pulsar_q.listen_feedback(self.id, on_reply)
        else:
            subs = [
                self.planner.bus.engine.listen(f"actions/fb/{self.id}", on_fb),
                self.planner.bus.engine.listen(f"actions/result/{self.id}", on_result),
            ]

            def stop() -> None:
                for s in subs:
                    s.undeclare()

        planner._feedback_stops.add(q.put_nowait)  # an exception put here ends the stream
        try:
            while (item := await q.get()) is not end:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            planner._feedback_stops.discard(q.put_nowait)
            stop()

    async def cancel(self) -> Action | None:
        """Cancel: removed if queued, signalled if running."""
        reply = await self.planner._call({"op": "cancel", "id": self.id})
        return action_from_dict(reply["action"]) if reply["action"] else None
