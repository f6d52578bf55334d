"""Executor API: handlers per kind, a concurrency limit, leases renewed while handlers run,
feedback, checkpoints (a retry resumes from the last one), cancel, graceful shutdown, and
riding out outages of the queue.

The executor sees only the :class:`~embodied_bus.actions.queue.WorkerLink` of its bus's queue
backend. While the queue is away (the queue service or the broker restarts, the network
drops) it keeps its handlers running and keeps their outcomes; it reconnects with backoff,
renews what it holds, reports what finished meanwhile, and only then takes new work.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from embodied_bus.actions.context import ActionContext
from embodied_bus.actions.model import Action, ActionError
from embodied_bus.actions.policy import DEFAULT_RETRY, PermanentFailure, RetryPolicy
from embodied_bus.actions.queue import (
    LEASE_S,
    ActionQueue,
    ExecutorSpec,
    Lease,
    QueueOptions,
    QueueUnavailable,
    Report,
    WorkerLink,
    open_queue,
)
from embodied_bus.errors import BusClosedError
from embodied_bus.security.seal import Sealer, Trust
from embodied_bus.security.signing import ActionRejected, Verifier

if TYPE_CHECKING:
    from embodied_bus.bus import Bus

__all__ = ["ActionContext", "Executor", "Handler"]

_log = logging.getLogger("embodied_bus.actions")
#: An idle executor looks for work at least this often, seconds (a wake-up comes sooner).
IDLE_LOOK_S = 0.5
#: First and longest pause between tries to reach a queue that is away, seconds.
RECONNECT_FIRST_S = 0.2
RECONNECT_MAX_S = 2.0
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
        prefetch: Pulsar only: actions per priority level fetched ahead of a free slot (None:
            the backend's default). More moves short actions faster; a busy executor then holds
            up to this many + 1 unstarted actions per level that an idle one cannot take.
        labels: Labels matched against action selectors.
        verifier: Accept only actions signed by a key the allow-list permits for their kind;
            anything else is dead-lettered with the reason before a handler sees it (None: run
            unsigned actions too).
        policy: Retry policy where executors apply it (Pulsar; a queue service applies its own).
        connect_timeout_s: How long :meth:`run` waits for the queue to answer at start before
            it fails (None: wait until it does, saying so in the log).
        sealer: Seal this executor's queue requests and feedback with its key.
        trust: Believe only replies and pushes sealed by the queue's key.

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
        prefetch: int | None = None,
        labels: dict[str, str] | None = None,
        verifier: Verifier | None = None,
        policy: RetryPolicy = DEFAULT_RETRY,
        connect_timeout_s: float | None = None,
        sealer: Sealer | None = None,
        trust: Trust | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"executor concurrency must be >= 1, got {concurrency}")
        if prefetch is not None and prefetch < 1:
            raise ValueError(f"executor prefetch must be >= 1 (or None for the default), got {prefetch}")
        if queue is None and bus is None:
            raise ValueError("an executor needs a bus or a queue")
        self.bus = bus
        self.name = name or f"ex-{uuid.uuid4().hex[:8]}"
        #: This process's incarnation of the executor.
        self.session = uuid.uuid4().hex[:12]
        self.concurrency = concurrency
        self.prefetch = prefetch
        self.labels = labels or {}
        self.verifier = verifier
        self.connect_timeout_s = connect_timeout_s
        self.handlers: dict[str, Handler] = {}
        self._own_queue = queue is None
        options = QueueOptions(policy, sealer=sealer, trust=trust)
        self.queue = queue if queue is not None else open_queue(bus, options)  # type: ignore[arg-type]
        self._link: WorkerLink | None = None
        self.completed = 0
        self.failed = 0
        #: Outcomes the queue did not accept as the attempt's own (the lease was taken back).
        self.unreported = 0
        #: Actions the queue pushed to this executor while it was idle.
        self.pushed = 0
        #: Actions leased in the answer to a report (no separate take round trip).
        self.leased_with_ack = 0
        #: Times the queue was found away while this executor ran.
        self.outages = 0
        #: Leases refused: granted to another executor or process, or run here already.
        self.refused_leases = 0
        self._ran: OrderedDict[tuple[str, int], None] = OrderedDict()  # attempts started here
        self._sync_kinds: set[str] = set()
        self._running: dict[str, tuple[ActionContext, asyncio.Task[None]]] = {}
        self._waiting: list[Lease] = []  # leases pushed beyond the free slots
        self._pending: list[Report] = []  # outcomes not yet accepted by the queue
        self._asking = 0  # slots asked for in requests under way
        self._flushing: asyncio.Task[None] | None = None
        self._offline: str | None = None  # why the queue is away, while it is
        self._taking = False  # take work with reports (cleared when stopping)
        self._woke = False  # work may be ready (a wake-up, a delivery, a full take)
        self._wake_fut: asyncio.Future[None] | None = None  # what _await_change waits on
        self._verified: dict[str, Action] = {}  # signed actions whose success is being reported

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
            "running": len(self._running),
            "completed": self.completed,
            "failed": self.failed,
            "unreported": self.unreported,
        }

    # ------------------------------------------------------------------ what contexts call
    def queue_reachable(self) -> bool:
        """Whether the queue can be reached now (for :meth:`ActionContext.still_owner`)."""
        return self._offline is None and self._link is not None and self._link.connected()

    def send_feedback(self, lease: Lease, data: bytes) -> None:
        """Feedback of a running attempt (best effort)."""
        if self._link is not None:
            self._link.feedback(lease, data)

    async def save_checkpoint(self, ctx: ActionContext, state: Any) -> None:
        """Save a checkpoint now, or when the queue is back."""
        if self._link is None:
            return
        try:
            await self._link.checkpoint(ctx.lease, state)
        except QueueUnavailable as err:
            ctx.pending_checkpoint, ctx.has_pending_checkpoint = state, True
            self._go_offline(err)

    # ------------------------------------------------------------------ running handlers
    def _free(self) -> int:
        return self.concurrency - len(self._running) - self._asking

    def _refused(self, lease: Lease) -> str | None:
        """Why ``lease`` may not run here (None: it may)."""
        last = lease.action.attempts[-1] if lease.action.attempts else None
        if last is None or not last.open:
            return "it holds no open attempt"
        if last.executor != self.name or last.session != self.session:
            return f"it was granted to {last.executor!r} (process {last.session or '?'}), not to this one"
        if (lease.id, last.number) in self._ran:
            return f"attempt {last.number} already ran here"
        return None

    def _start(self, lease: Lease) -> None:
        if lease.id in self._running or any(x.id == lease.id for x in self._waiting):
            return  # a duplicate of what runs or waits
        why = self._refused(lease)
        if why is not None:
            self.refused_leases += 1
            _log.warning("%s: refused a lease on action %s: %s", self.name, lease.id, why)
            return
        if len(self._running) >= self.concurrency:
            self._waiting.append(lease)  # pushed beyond the free slots: runs when one frees
            return
        self._ran[(lease.id, lease.attempt)] = None
        while len(self._ran) > 100_000:
            self._ran.popitem(last=False)
        ctx = ActionContext(self, lease)
        task = asyncio.create_task(self._run_one(ctx))
        self._running[lease.id] = (ctx, task)
        task.add_done_callback(partial(self._ended, lease.id))

    def _ended(self, action_id: str, _task: asyncio.Task[None]) -> None:
        self._running.pop(action_id, None)
        while self._waiting and len(self._running) < self.concurrency:
            self._start(self._waiting.pop(0))
        if self._link is not None and not self._link.takes_with_reports:
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
        while self._link is not None and time.monotonic() < deadline:
            sent = time.monotonic()
            try:
                renewal = await self._link.renew([ctx.lease])
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
        if not ctx.still_owner() and not await self._confirmed(ctx):
            # unrun: the attempt goes back to the queue to be retried (noted only, if the queue
            # took it back already); kept until the queue is back, as any outcome
            reason = (
                f"not run by {self.name}: its lease was old when it arrived and the queue did not confirm it"
            )
            self._report(Report(action.id, lease.attempt, False, reason=reason))
            return
        if self.verifier is not None:
            try:
                self.verifier.verify(action)
            except ActionRejected as err:
                _log.warning("rejected action %s (%s): %s", action.id, action.kind, err)
                self.failed += 1
                self._report(
                    Report(
                        action.id,
                        lease.attempt,
                        False,
                        reason=f"rejected by {self.name}: {err}",
                        permanent=True,
                    )
                )
                return
        try:
            result = self.handlers[action.kind](action, ctx)
            if inspect.isawaitable(result):
                result = await result
            else:
                self._ran_synchronously(action.kind)
        except PermanentFailure as err:
            self.failed += 1
            self._report(
                Report(action.id, lease.attempt, False, reason=str(err) or "rejected", permanent=True)
            )
        except Exception as err:
            self.failed += 1
            self._report(Report(action.id, lease.attempt, False, reason=f"{type(err).__name__}: {err}"))
        else:
            self.completed += 1
            if self.verifier is not None:
                self._verified[action.id] = action
            self._report(Report(action.id, lease.attempt, True, result=result))

    # ------------------------------------------------------------------ reports
    def _report(self, report: Report) -> None:
        """Queue an outcome: outcomes that end in the same loop turn go in one request."""
        self._pending.append(report)
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.ensure_future(self._flush())

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # gather what ends in this turn
        while self._pending and self._offline is None and self._link is not None:
            batch, self._pending = self._pending, []
            take = max(0, self._free()) if self._taking and self._link.takes_with_reports else 0
            self._asking += take
            try:
                reply = await self._link.report(batch, take=take)
            except QueueUnavailable as err:
                self._pending[:0] = batch  # kept, in order, for when the queue is back
                self._go_offline(err)
                return
            finally:
                self._asking -= take
                self._nudge()  # the slots asked for are free again, or filled below
            self._settle_receipts(batch, reply.receipts)
            if take:
                if len(reply.leases) >= take:
                    self._woke = True  # a full take: more may be waiting
                self.leased_with_ack += len(reply.leases)
                for lease in reply.leases:
                    self._start(lease)

    def _settle_receipts(self, batch: Sequence[Report], receipts: Sequence[Any]) -> None:
        for report, receipt in zip(batch, receipts, strict=True):
            signed = self._verified.pop(report.action_id, None) if report.ok else None
            if receipt.accepted:
                if signed is not None and self.verifier is not None:
                    self.verifier.completed(signed)
                continue
            self.unreported += 1
            _log.warning(
                "%s: outcome of action %s (attempt %d) not recorded: %s",
                self.name,
                report.action_id,
                report.attempt,
                receipt.error,
            )

    # ------------------------------------------------------------------ outages
    def _go_offline(self, err: Exception) -> None:
        if self._offline is None:
            self.outages += 1
            self._offline = str(err)
            _log.warning(
                "%s: the action queue is away (%s); handlers keep running, their outcomes are kept "
                "and reported when it is back",
                self.name,
                err,
            )
        self._nudge()

    async def _recover(self, stop: asyncio.Event | None = None, until_mono: float | None = None) -> bool:
        """Reconnect with backoff: renew what runs, send checkpoints and outcomes kept meanwhile.
        Gives up (returns False) once ``stop`` is set or ``until_mono`` has passed."""
        assert self._link is not None
        pause = RECONNECT_FIRST_S
        reported = 0
        while True:
            try:
                await self._renew_once()
                for ctx, _ in list(self._running.values()):
                    if ctx.has_pending_checkpoint and not ctx.lost:
                        await self._link.checkpoint(ctx.lease, ctx.pending_checkpoint)
                        ctx.has_pending_checkpoint = False
                batch, self._pending = self._pending, []
                reported = len(batch)
                if batch:
                    try:
                        reply = await self._link.report(batch)
                    except QueueUnavailable:
                        self._pending[:0] = batch
                        raise
                    self._settle_receipts(batch, reply.receipts)
                break
            except QueueUnavailable as err:
                self._offline = str(err)
                if until_mono is not None and time.monotonic() + pause > until_mono:
                    return False
                if stop is not None:
                    try:
                        await asyncio.wait_for(stop.wait(), pause)
                        return False
                    except TimeoutError:
                        pass
                else:
                    await asyncio.sleep(pause)
                pause = min(RECONNECT_MAX_S, pause * 2)
        _log.warning(
            "%s: the action queue is back; %d outcome(s) kept meanwhile reported", self.name, reported
        )
        self._offline = None
        return True

    async def _renew_once(self) -> None:
        """Renew every lease held (raises :class:`QueueUnavailable`)."""
        assert self._link is not None
        contexts = [ctx for ctx, _ in self._running.values() if not ctx.lost]
        leases = [ctx.lease for ctx in contexts] + list(self._waiting)
        if not leases:
            return
        sent = time.monotonic()
        renewal = await self._link.renew(leases)
        for ctx in contexts:
            if ctx.lease.id not in self._running:
                continue  # it ended while the renewal was under way
            if ctx.lease.id in renewal.lost:
                ctx.lost = True
                ctx.cancelled.set()
                _log.warning(
                    "%s: the queue took action %s (attempt %d) back; its handler is told to stop",
                    self.name,
                    ctx.lease.id,
                    ctx.lease.attempt,
                )
                continue
            ctx.confirmed_mono = sent
            if ctx.lease.id in renewal.canceled:
                ctx.cancelled.set()
        self._waiting = [x for x in self._waiting if x.id not in renewal.lost]

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(LEASE_S / 3)
            if self._offline is not None:
                continue
            try:
                await self._renew_once()
            except QueueUnavailable as err:
                self._go_offline(err)

    # ------------------------------------------------------------------ main loop
    async def _connect(self) -> WorkerLink:
        """Open the link, waiting for the queue (with a log line) up to ``connect_timeout_s``."""
        spec = ExecutorSpec(
            self.name,
            self.session,
            tuple(sorted(self.handlers)),
            dict(self.labels),
            self.concurrency,
            self.prefetch,
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
            self._start(lease)

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
            f"{len(self._running)} action(s) it was running go back to the queue"
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Take and run actions until ``stop``; then finish what is running (graceful).

        Raises:
            BusClosedError: The executor's bus was closed while it ran (stop the executor
                first, then close its bus): it stopped taking work at once, and the actions it
                was running go back to the queue.
            QueueUnavailable: No queue answered within ``connect_timeout_s`` at start.
        """
        self._link = link = await self._connect()
        stopping = asyncio.ensure_future(stop.wait())  # wakes an idle wait at once
        stopping.add_done_callback(lambda _: self._nudge())
        renewer = asyncio.ensure_future(self._renew_loop())
        self._taking = True
        try:
            await self._serve(stop, link)
            self._taking = False
            try:  # no more pushes; one racing with this still runs below
                await link.retire()
            except (QueueUnavailable, BusClosedError, ActionError) as err:
                _log.debug("%s could not retire: %s", self.name, err)
            await self._drain(stop)
        except BusClosedError as err:  # a call on the bus found it closed
            if self.bus is not None and self.bus.closed:
                raise self._closed_under() from err
            raise
        finally:
            self._taking = False
            stopping.cancel()
            renewer.cancel()
            self._link = None
            await link.close()
            if self._own_queue:
                await self.queue.close()

    async def _serve(self, stop: asyncio.Event, link: WorkerLink) -> None:
        """Take work while slots are free and work may be ready."""
        self._woke = True  # look once at start
        while not stop.is_set():
            if self.bus is not None and self.bus.closed:  # the program closed the bus first
                raise self._closed_under()
            if self._offline is not None:
                if await self._recover(stop):
                    self._woke = True
                continue
            free = self._free()
            if free <= 0 or not self._woke:
                await self._await_change(stop)
                continue
            self._woke = False
            self._asking += free
            try:
                leases = await link.take(free)
            except QueueUnavailable as err:
                self._go_offline(err)
                continue
            finally:
                self._asking -= free
            if len(leases) >= free:
                self._woke = True  # a full take: more may be waiting
            for lease in leases:
                self._start(lease)

    async def _drain(self, stop: asyncio.Event) -> None:
        """Let running handlers finish and report their outcomes (trying for
        :data:`STOP_REPORT_S` if the queue is away)."""
        while self._running or self._waiting:
            tasks = [task for _, task in self._running.values()]
            if tasks:
                await asyncio.wait(tasks)
            else:
                await asyncio.sleep(0)
        deadline = time.monotonic() + STOP_REPORT_S
        while (self._pending or (self._flushing is not None and not self._flushing.done())) and (
            time.monotonic() < deadline
        ):
            if self._flushing is not None and not self._flushing.done():
                await self._flushing
                continue
            if self._offline is not None:
                if not await self._recover(until_mono=deadline):
                    break
                continue
            self._flushing = asyncio.ensure_future(self._flush())
        if self._pending:
            _log.warning(
                "%s stopped with %d outcome(s) the queue could not take; their actions run again",
                self.name,
                len(self._pending),
            )


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
