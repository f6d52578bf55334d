"""Executor API: handlers per kind, a concurrency limit, leases renewed while handlers run,
feedback, checkpoints (a retry resumes from the last one), cancel, graceful shutdown, and
riding out outages of the queue.

The executor sees only the :class:`~embodied_bus.actions.queue.WorkerLink` of its bus's queue
backend. While the queue is away (the queue service or the broker restarts, the network
drops) it keeps its handlers running and keeps their outcomes; it reconnects with backoff,
renews what it holds, reports what finished meanwhile, and only then takes new work.

This module is the facade: the handler registry, the run loop and one attempt's run. Which
leases run and wait is :mod:`~embodied_bus.actions.intake`; outcomes, outages and what a
context asks of the queue are :mod:`~embodied_bus.actions.reporting`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from embodied_bus.actions.context import ActionContext
from embodied_bus.actions.intake import Intake
from embodied_bus.actions.model import Action, ActionError
from embodied_bus.actions.policy import PermanentFailure
from embodied_bus.actions.queue import (
    LEASE_S,
    ActionQueue,
    BackendOptions,
    ExecutorSpec,
    Lease,
    QueueOptions,
    QueueUnavailable,
    Report,
    WorkerLink,
    open_queue,
)
from embodied_bus.actions.reporting import RECONNECT_FIRST_S, RECONNECT_MAX_S, Reporter
from embodied_bus.errors import BusClosedError
from embodied_bus.security.signing import ActionRejected, Verifier

if TYPE_CHECKING:
    from embodied_bus.bus import Bus

__all__ = ["ActionContext", "Executor", "Handler"]

_log = logging.getLogger("embodied_bus.actions")
#: An idle executor looks for work at least this often, seconds (a wake-up comes sooner).
IDLE_LOOK_S = 0.5
#: How long a stopping executor keeps trying to report what it finished, seconds.
STOP_REPORT_S = 10.0

#: A handler: ``async def handler(action, ctx) -> result`` (a plain function that returns its
#: result also works, but blocks the event loop while it runs: a warning says so).
Handler = Callable[[Action, ActionContext], Awaitable[Any] | Any]


class Executor:
    """Runs handlers for the actions of the kinds it registered.

    Args:
        bus: The bus whose action queue to serve (or give ``queue``).
        name: Executor name (default random); other executors retry what this one failed.
        queue: The action queue (default: the bus's backend).
        concurrency: Handlers running at once.
        labels: Labels matched against action selectors.
        verifier: Accept only actions signed by a key the allow-list permits for their kind;
            anything else is dead-lettered with the reason before a handler sees it (None: run
            unsigned actions too).
        connect_timeout_s: How long :meth:`run` waits for the queue to answer at start before
            it fails (None: wait until it does, saying so in the log).
        backend: Options of the bus's queue backend:
            :class:`~embodied_bus.actions.queue.ZenohQueueOptions` (seal this executor's requests
            and feedback, trust only the queue's key) or
            :class:`~embodied_bus.actions.queue.PulsarQueueOptions` (prefetch); another backend
            refuses them by name.

    Whatever arrives, a lease runs only if it was granted to this executor's process, for an
    attempt it has not run yet, within the concurrency limit; anything else is refused and
    counted (:attr:`refused_leases`).
    """

    def __init__(
        self,
        bus: Bus | None = None,
        name: str | None = None,
        *,
        queue: ActionQueue | None = None,
        concurrency: int = 1,
        labels: dict[str, str] | None = None,
        verifier: Verifier | None = None,
        connect_timeout_s: float | None = None,
        backend: BackendOptions | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"executor concurrency must be >= 1, got {concurrency}")
        if queue is None and bus is None:
            raise ValueError("an executor needs a bus or a queue")
        self.bus = bus
        self.name = name or f"ex-{uuid.uuid4().hex[:8]}"
        #: This process's incarnation of the executor.
        self.session = uuid.uuid4().hex[:12]
        self.concurrency = concurrency
        self.labels = labels or {}
        self.verifier = verifier
        self.connect_timeout_s = connect_timeout_s
        self.handlers: dict[str, Handler] = {}
        self._own_queue = queue is None
        options = QueueOptions(backend=backend)
        self.queue = queue if queue is not None else open_queue(bus, options)  # type: ignore[arg-type]
        self.completed = 0
        self.failed = 0
        #: Actions the queue pushed to this executor while it was idle.
        self.pushed = 0
        self._sync_kinds: set[str] = set()
        self._woke = False  # work may be ready (a wake-up, a delivery, a full take)
        self._wake_fut: asyncio.Future[None] | None = None  # what _await_change waits on
        self._intake = Intake(
            self.name, self.session, concurrency, self._context, self._run_one, self._slot_freed
        )
        self._reporter = Reporter(self.name, self._intake, verifier, self._mark_woke, self._nudge)

    def _context(self, lease: Lease) -> ActionContext:
        return ActionContext(self._reporter, self.name, lease)

    # ------------------------------------------------------------------ registration and stats
    def handler(self, kind: str) -> Callable[[Handler], Handler]:
        """Decorator registering a handler ``async def (action, ctx) -> result`` for a kind (a
        plain function works too, but blocks the event loop while it runs: it is warned about)."""

        def register(fn: Handler) -> Handler:
            self.handlers[kind] = fn
            return fn

        return register

    def stats(self) -> dict[str, Any]:
        """Counters of this executor (for dashboards): handlers that returned (``completed``)
        or raised (``failed``), outcomes the queue did not accept (``unreported``), actions
        running now and the concurrency limit."""
        return {
            "executor": self.name,
            "concurrency": self.concurrency,
            "running": len(self._intake.running),
            "completed": self.completed,
            "failed": self.failed,
            "unreported": self.unreported,
        }

    @property
    def unreported(self) -> int:
        """Outcomes the queue did not accept as the attempt's own (the lease was taken back)."""
        return self._reporter.unreported

    @property
    def leased_with_ack(self) -> int:
        """Actions leased in the answer to a report (no separate take round trip)."""
        return self._reporter.leased_with_ack

    @property
    def outages(self) -> int:
        """Times the queue was found away while this executor ran."""
        return self._reporter.outages

    @property
    def refused_leases(self) -> int:
        """Leases refused: granted to another executor or process, or run here already."""
        return self._intake.refused_leases

    def queue_reachable(self) -> bool:
        """Whether the queue can be reached now."""
        return self._reporter.queue_reachable()

    # ------------------------------------------------------------------ running one attempt
    def _slot_freed(self) -> None:
        if self._reporter.link is not None and not self._reporter.link.takes_with_reports:
            self._woke = True  # no report brings the next: look for it now
        self._nudge()

    def _ran_synchronously(self, kind: str) -> None:
        """A handler returned its result instead of an awaitable: it is a plain function. Its
        result counts; it is said once per kind that it blocked the event loop meanwhile."""
        if kind not in self._sync_kinds:
            self._sync_kinds.add(kind)
            _log.warning(
                "%s: the handler for %r is not async: it ran on the event loop and blocked it "
                "(lease renewals, feedback and other actions waited); make it `async def` and "
                "run blocking work with `await asyncio.to_thread(...)`",
                self.name,
                kind,
            )

    async def _confirmed(self, ctx: ActionContext) -> bool:
        """Whether a lease that arrived old may run: the queue confirms it still holds (else it
        is not run, and its attempt is reported back unrun)."""
        deadline = time.monotonic() + 2 * LEASE_S
        while self._reporter.link is not None and time.monotonic() < deadline:
            sent = time.monotonic()
            try:
                renewal = await self._reporter.link.renew([ctx.lease])
            except QueueUnavailable:
                await asyncio.sleep(RECONNECT_FIRST_S)
                continue
            if ctx.lease.id in renewal.lost:
                break
            ctx.confirmed_mono = sent
            return True
        _log.warning(
            "%s: did not run action %s (attempt %d): its lease was old when it arrived and the "
            "queue did not confirm it",
            self.name,
            ctx.lease.id,
            ctx.lease.attempt,
        )
        return False

    async def _run_one(self, ctx: ActionContext) -> None:
        action = ctx.action
        lease = ctx.lease
        report = self._reporter.report
        if not ctx.still_owner() and not await self._confirmed(ctx):
            # unrun: the attempt goes back to the queue to be retried (noted only, if the queue
            # took it back already); kept until the queue is back, as any outcome
            reason = (
                f"not run by {self.name}: its lease was old when it arrived and the queue did not confirm it"
            )
            report(Report(action.id, lease.attempt, False, reason=reason))
            return
        if self.verifier is not None:
            try:
                self.verifier.verify(action)
            except ActionRejected as err:
                _log.warning("rejected action %s (%s): %s", action.id, action.kind, err)
                self.failed += 1
                reason = f"rejected by {self.name}: {err}"
                report(Report(action.id, lease.attempt, False, reason=reason, permanent=True))
                return
        try:
            result = self.handlers[action.kind](action, ctx)
            if inspect.isawaitable(result):
                result = await result
            else:
                self._ran_synchronously(action.kind)
        except PermanentFailure as err:
            self.failed += 1
            report(Report(action.id, lease.attempt, False, reason=str(err) or "rejected", permanent=True))
        except Exception as err:
            self.failed += 1
            report(Report(action.id, lease.attempt, False, reason=f"{type(err).__name__}: {err}"))
        else:
            self.completed += 1
            signed = action if self.verifier is not None else None
            report(Report(action.id, lease.attempt, True, result=result), signed)

    # ------------------------------------------------------------------ main loop
    async def _renew_loop(self) -> None:
        reporter = self._reporter
        while True:
            await asyncio.sleep(LEASE_S / 3)
            if reporter.offline is not None or reporter.link is None:
                continue
            try:
                await self._intake.renew(reporter.link)
            except QueueUnavailable as err:
                reporter.go_offline(err)

    async def _connect(self) -> WorkerLink:
        """Open the link, waiting for the queue (with a log line) up to ``connect_timeout_s``."""
        spec = ExecutorSpec(
            self.name,
            self.session,
            tuple(sorted(self.handlers)),
            dict(self.labels),
            self.concurrency,
        )
        link = self.queue.worker(spec)
        deadline = None if self.connect_timeout_s is None else time.monotonic() + self.connect_timeout_s
        pause = RECONNECT_FIRST_S
        said = False
        while True:
            try:
                await link.open(self._woken, self._accept_pushed)
                return link
            except QueueUnavailable as err:
                if deadline is not None and time.monotonic() >= deadline:
                    await link.close()
                    raise QueueUnavailable(
                        f"executor {self.name}: no action queue within {self.connect_timeout_s:g} s: {err}"
                    ) from err
                if not said:
                    said = True
                    _log.warning("%s: waiting for the action queue: %s", self.name, err)
                await asyncio.sleep(pause)
                pause = min(RECONNECT_MAX_S, pause * 2)

    def _mark_woke(self) -> None:
        self._woke = True

    def _woken(self) -> None:
        """Work may be ready (loop thread)."""
        self._woke = True
        self._nudge()

    def _nudge(self) -> None:
        """Something changed that the main loop looks at: a slot, a take, an outage, stop."""
        fut = self._wake_fut
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _accept_pushed(self, leases: list[Lease]) -> None:
        self.pushed += len(leases)
        for lease in leases:
            self._intake.start(lease)

    async def _await_change(self, stop: asyncio.Event) -> None:
        """Wait for a nudge, ``stop`` or :data:`IDLE_LOOK_S` (then look for work anyway), one
        future and no task per wait."""
        if stop.is_set():
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._wake_fut = fut
        timer = loop.call_later(IDLE_LOOK_S, self._look_again, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self._wake_fut = None

    def _look_again(self, fut: asyncio.Future[None]) -> None:
        self._woke = True
        _settle(fut)

    def _closed_under(self) -> BusClosedError:
        return BusClosedError(
            f"executor {self.name!r}: its bus was closed while it ran; it stopped, and the "
            f"{len(self._intake.running)} action(s) it was running go back to the queue"
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Take and run actions until ``stop``; then finish what is running (graceful).

        Raises:
            BusClosedError: The executor's bus was closed while it ran (stop the executor
                first, then close its bus): it stopped taking work at once, and the actions it
                was running go back to the queue.
            QueueUnavailable: No queue answered within ``connect_timeout_s`` at start.
        """
        reporter = self._reporter
        reporter.link = link = await self._connect()
        stopping = asyncio.ensure_future(stop.wait())  # wakes an idle wait at once
        stopping.add_done_callback(lambda _: self._nudge())
        renewer = asyncio.ensure_future(self._renew_loop())
        reporter.taking = True
        try:
            await self._serve(stop, link)
            reporter.taking = False
            try:  # no more pushes; one racing with this still runs below
                await link.retire()
            except (QueueUnavailable, BusClosedError, ActionError) as err:
                _log.debug("%s could not retire: %s", self.name, err)
            await self._drain()
        except BusClosedError as err:  # a call on the bus found it closed
            if self.bus is not None and self.bus.closed:
                raise self._closed_under() from err
            raise
        finally:
            reporter.taking = False
            stopping.cancel()
            renewer.cancel()
            reporter.link = None
            await link.close()
            if self._own_queue:
                await self.queue.close()

    async def _serve(self, stop: asyncio.Event, link: WorkerLink) -> None:
        """Take work while slots are free and work may be ready."""
        intake, reporter = self._intake, self._reporter
        self._woke = True  # look once at start
        while not stop.is_set():
            if self.bus is not None and self.bus.closed:  # the program closed the bus first
                raise self._closed_under()
            if reporter.offline is not None:
                if await reporter.recover(stop):
                    self._woke = True
                continue
            free = intake.free()
            if free <= 0 or not self._woke:
                await self._await_change(stop)
                continue
            self._woke = False
            intake.asking += free
            try:
                leases = await link.take(free)
            except QueueUnavailable as err:
                reporter.go_offline(err)
                continue
            finally:
                intake.asking -= free
            if len(leases) >= free:
                self._woke = True  # a full take: more may be waiting
            for lease in leases:
                intake.start(lease)

    async def _drain(self) -> None:
        """Let running handlers finish and report their outcomes (trying for
        :data:`STOP_REPORT_S` if the queue is away)."""
        intake, reporter = self._intake, self._reporter
        while intake.busy():
            tasks = intake.tasks()
            if tasks:
                await asyncio.wait(tasks)
            else:
                await asyncio.sleep(0)
        deadline = time.monotonic() + STOP_REPORT_S
        while (reporter.pending or reporter.flushing()) and time.monotonic() < deadline:
            if reporter.flushing():
                await reporter.wait_flushed()
                continue
            if reporter.offline is not None:
                if not await reporter.recover(until_mono=deadline):
                    break
                continue
            reporter.flush_again()
        if reporter.pending:
            _log.warning(
                "%s stopped with %d outcome(s) the queue could not take; their actions run again",
                self.name,
                len(reporter.pending),
            )


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
