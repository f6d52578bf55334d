"""Planner API: submit actions, await results, stream feedback, cancel, look up by id."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from embodied_bus.actions.model import Action, ActionError, ActionStatus, SessionFailure
from embodied_bus.actions.policy import RetryPolicy
from embodied_bus.actions.queue import (
    ActionQueue,
    BackendOptions,
    Backlog,
    QueueOptions,
    QueueUnavailable,
    open_queue,
)
from embodied_bus.errors import BusClosedError, BusConnectionError
from embodied_bus.security.signing import Signer

if TYPE_CHECKING:
    from embodied_bus.bus import Bus

__all__ = ["ActionHandle", "Planner"]

_log = logging.getLogger("embodied_bus.actions")
T = TypeVar("T")

#: How long one request waits for the queue, seconds.
REQUEST_TIMEOUT_S = 5.0
#: How long a planner keeps trying while the queue is away, seconds.
CONNECT_TIMEOUT_S = 30.0
#: First and longest pause between such tries, seconds.
RETRY_FIRST_S = 0.2
RETRY_MAX_S = 2.0
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
    (:mod:`embodied_bus.actions.pulsar`), with no service to run; a
    :class:`~embodied_bus.actions.memory.MemoryQueue` keeps it in this process.

    Args:
        bus: The bus (or give ``queue``).
        queue: The action queue (default: the bus's backend).
        timeout_s: How long one request waits for the queue, seconds.
        signer: Sign every submitted action (executors with a verifier run only signed ones); a
            signer without an audience signs for this bus's namespace.
        connect_timeout_s: While the queue is away (a restart, a network drop), requests are
            tried again with backoff for up to this long before they fail with
            :class:`~embodied_bus.actions.queue.QueueUnavailable` (0: fail at once).
        backend: Options of the bus's queue backend, e.g.
            :class:`~embodied_bus.actions.queue.ZenohQueueOptions` (seal this planner's requests
            with its key; believe only replies and results sealed by the queue's key, and
            feedback sealed by an executor's); another backend refuses them by name.

    Use it as an async context manager, or call :meth:`close`, to release its result channel.
    """

    def __init__(
        self,
        bus: Bus | None = None,
        *,
        queue: ActionQueue | None = None,
        timeout_s: float = REQUEST_TIMEOUT_S,
        signer: Signer | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        backend: BackendOptions | None = None,
    ) -> None:
        if queue is None and bus is None:
            raise ValueError("a planner needs a bus or a queue")
        self.bus = bus
        self.timeout_s = timeout_s
        if signer is not None and signer.audience is None and bus is not None:
            signer = replace(signer, audience=bus.namespace)  # for this robot, not for any
        self.signer = signer
        self.connect_timeout_s = connect_timeout_s
        self._own_queue = queue is None
        options = QueueOptions(timeout_s, backend)
        self.queue = queue if queue is not None else open_queue(bus, options)  # type: ignore[arg-type]
        # One subscription for every result (not one per action), opened before the first
        # submit so results that arrive before anyone awaits them are kept (bounded).
        self._results: OrderedDict[str, Action] = OrderedDict()
        self._waiters: dict[str, list[asyncio.Future[Action]]] = {}
        self._watching = False
        self._poller: asyncio.Task[None] | None = None
        # result waits with a timeout: (loop time, seq, future), earliest first
        self._deadlines: list[tuple[float, int, asyncio.Future[Action]]] = []
        self._deadline_seq = itertools.count()
        self._deadline_timer: asyncio.TimerHandle | None = None
        # feedback streams running: each ends with an error when the planner or its bus closes
        self._feedback_stops: set[Callable[[BaseException], None]] = set()
        self._gone: str | None = None  # why results can no longer come (closed)
        if bus is not None:
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

    @property
    def awaited(self) -> frozenset[str]:
        """Ids of the actions whose results are being awaited (for monitoring and tests)."""
        return frozenset(self._waiters)

    @property
    def feedback_streams(self) -> int:
        """Feedback streams open (for monitoring and tests)."""
        return len(self._feedback_stops)

    async def close(self) -> None:
        """Stop listening for results (and release what the queue backend opened). Results
        still awaited fail with :class:`BusClosedError`."""
        if self.bus is not None:
            self.bus.remove_close_callback(self._bus_closed)
        self._fail_waiters("the planner was closed")
        if self._poller is not None:
            self._poller.cancel()
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        if self._own_queue:
            await self.queue.close()

    async def _retrying(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """``call()``, tried again with backoff while the queue is away, for up to
        ``connect_timeout_s``."""
        deadline = time.monotonic() + self.connect_timeout_s
        pause = RETRY_FIRST_S
        said = False
        while True:
            try:
                return await call()
            except QueueUnavailable as err:
                if time.monotonic() + pause > deadline:
                    raise QueueUnavailable(f"{what}: {err}") from err
                if not said:
                    said = True
                    _log.warning("%s: the action queue is away (%s); trying again", what, err)
            await asyncio.sleep(pause)
            pause = min(RETRY_MAX_S, pause * 2)

    async def _ensure_results(self) -> None:
        if not self._watching:
            self._watching = True
            try:
                await self.queue.watch_results(self._settle)
            except BaseException:
                self._watching = False
                raise

    def _settle(self, action: Action) -> None:
        """A result arrived (loop thread)."""
        self._results[action.id] = action
        while len(self._results) > RESULT_CACHE:
            self._results.popitem(last=False)
        for fut in self._waiters.pop(action.id, []):
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
                    ended = await self.queue.ended(ids[i : i + POLL_BATCH])
                except (ActionError, BusConnectionError, BusClosedError):
                    break
                for action in ended:
                    self._settle(action)
                    found += 1
            interval_s = POLL_FIRST_S if found else min(interval_s * 2, POLL_MAX_S)

    async def submit(
        self,
        kind: str,
        payload: Any = None,
        *,
        priority: int = 0,
        deadline_s: float | None = None,
        idempotency_key: str | None = None,
        selector: dict[str, str] | None = None,
        session: str | None = None,
        on_failure: SessionFailure | str = SessionFailure.CANCEL,
        retry: RetryPolicy | None = None,
    ) -> ActionHandle:
        """Submit one action; returns once it is durably queued.

        Args:
            deadline_s: Never start it after this many seconds from now.
            retry: This action's own retry policy (None: the queue's policy of its kind).
            session: Make it the next step of this ordered session: it starts after every step
                submitted to the session before it has ended, and never beside one.
            on_failure: If this step is dead-lettered, the later steps of its session end
                canceled (``cancel``), wait until it is requeued or purged (``hold``), or run
                on (``continue``).

        Raises:
            ActionError: Invalid action (the queue says why).
            QueueUnavailable: No queue answered within ``connect_timeout_s``.
        """
        action = Action(
            kind,
            payload,
            priority=priority,
            idempotency_key=idempotency_key,
            selector=selector or {},
            deadline_ns=time.time_ns() + int(deadline_s * 1e9) if deadline_s else 0,
            session=session,
            on_failure=on_failure,  # type: ignore[arg-type]  # validate() takes its text too
            retry=retry,
        ).validate()
        return (await self.submit_many([action]))[0]

    async def submit_many(self, actions: Sequence[Action]) -> list[ActionHandle]:
        """Submit a batch in one request (on Zenoh stored atomically: all or none; on Pulsar each
        action is persisted before this returns). Submitting an action again (the same id, e.g.
        after an outage) answers with the stored one."""
        await self._ensure_results()
        signed = [self.signer.sign(a.validate()) if self.signer else a.validate() for a in actions]
        # copies (own lists and dicts): a backend may change its own
        copies = [a.copy() for a in signed]
        reply = await self._retrying("submit", lambda: self.queue.submit(copies))
        return [ActionHandle(self, r.id, duplicate=r.duplicate) for r in reply]

    async def get(self, action_id: str) -> Action | None:
        """The current state of an action (results of a planner that was away included)."""
        return await self._retrying("get", lambda: self.queue.get(action_id))

    async def cancel(self, action_id: str) -> Action | None:
        """Cancel an action: removed if queued, signalled if running."""
        return await self._retrying("cancel", lambda: self.queue.cancel(action_id))

    async def backlog(self) -> Backlog:
        """The queue's backlog, for dashboards and autoscalers (``.as_dict()`` for JSON)."""
        return await self._retrying("backlog", self.queue.backlog)

    async def dead_letters(self) -> list[Action]:
        """The dead-letter queue with every attempt's reason."""
        return await self._retrying("dead letters", self.queue.dead_letters)

    async def requeue(self, action_id: str) -> Action:
        """Give a dead-lettered action a fresh attempt budget (its history stays).

        Raises:
            ActionError: It is not in the dead-letter queue.
        """
        self._results.pop(action_id, None)  # it runs again: forget the old outcome
        return await self._retrying("requeue", lambda: self.queue.requeue(action_id))

    async def purge_dead(self) -> int:
        """Delete the dead-letter queue; returns how many were removed."""
        return await self._retrying("purge", self.queue.purge_dead)

    async def set_policy(self, policy: RetryPolicy, kind: str | None = None) -> None:
        """Make ``policy`` the queue's retry policy of ``kind`` (None: of kinds without one of
        their own), for every executor (see :meth:`ActionQueue.set_policy`).

        Raises:
            BusConfigError: The queue takes its policies from its configuration (Zenoh: the
                queue service's).
        """
        await self._retrying("set policy", lambda: self.queue.set_policy(policy, kind))

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
        await p._ensure_results()
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
        end = object()
        planner = self.planner
        if planner._gone is not None:
            raise BusClosedError(f"the planner receives no feedback: {planner._gone}")
        stop = await planner.queue.watch_feedback(self.id, q.put_nowait, lambda: q.put_nowait(end))
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
        return await self.planner.cancel(self.id)
