"""An executor's side of the queue link while handlers run: outcomes batched per loop turn
(new work taken with them), kept in order while the queue is away and sent when it is back,
feedback and checkpoints of running attempts."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from embodied_bus.actions.context import ActionContext
from embodied_bus.actions.intake import Intake
from embodied_bus.actions.model import Action
from embodied_bus.actions.queue import Lease, QueueUnavailable, Report, WorkerLink
from embodied_bus.security.signing import Verifier

__all__ = ["RECONNECT_FIRST_S", "RECONNECT_MAX_S", "Reporter"]

_log = logging.getLogger("embodied_bus.actions")
#: First and longest pause between tries to reach a queue that is away, seconds.
RECONNECT_FIRST_S = 0.2
RECONNECT_MAX_S = 2.0


class Reporter:
    """Reports outcomes of ``intake``'s attempts over ``link`` (set while the executor runs).

    It is also what an :class:`~embodied_bus.actions.context.ActionContext` talks to (a
    :class:`~embodied_bus.actions.context.ContextPort`). ``wake()`` says new work may be
    ready (a full take came with a report); ``nudge()`` that something the run loop waits on
    changed (an outage, slots asked for free again).
    """

    def __init__(
        self,
        name: str,
        intake: Intake,
        verifier: Verifier | None,
        wake: Callable[[], None],
        nudge: Callable[[], None],
    ) -> None:
        self.name = name
        self.intake = intake
        self.verifier = verifier
        self._wake = wake
        self._nudge = nudge
        self.link: WorkerLink | None = None
        #: Take work with reports (cleared when stopping).
        self.taking = False
        #: Outcomes the queue did not accept as the attempt's own (the lease was taken back).
        self.unreported = 0
        #: Actions leased in the answer to a report (no separate take round trip).
        self.leased_with_ack = 0
        #: Times the queue was found away.
        self.outages = 0
        #: Why the queue is away, while it is.
        self.offline: str | None = None
        self.pending: list[Report] = []  # outcomes not yet accepted by the queue
        self._flushing: asyncio.Task[None] | None = None
        self._verified: dict[str, Action] = {}  # signed actions whose success is being reported

    # ------------------------------------------------------------------ what contexts call
    def queue_reachable(self) -> bool:
        """Whether the queue can be reached now."""
        return self.offline is None and self.link is not None and self.link.connected()

    def send_feedback(self, lease: Lease, data: bytes) -> None:
        """Feedback of a running attempt (best effort)."""
        if self.link is not None:
            self.link.feedback(lease, data)

    async def save_checkpoint(self, ctx: ActionContext, state: Any) -> None:
        """Save a checkpoint now, or when the queue is back."""
        if self.link is None:
            return
        try:
            await self.link.checkpoint(ctx.lease, state)
        except QueueUnavailable as err:
            ctx.pending_checkpoint, ctx.has_pending_checkpoint = state, True
            self.go_offline(err)

    # ------------------------------------------------------------------ outcomes
    def report(self, report: Report, signed: Action | None = None) -> None:
        """Queue an outcome: outcomes that end in the same loop turn go in one request.
        ``signed``: the verified action of a success (the verifier marks it completed once the
        queue accepted the outcome)."""
        if signed is not None:
            self._verified[report.action_id] = signed
        self.pending.append(report)
        if not self.flushing():
            self._flushing = asyncio.ensure_future(self.flush())

    def flushing(self) -> bool:
        """Whether a flush is under way."""
        return self._flushing is not None and not self._flushing.done()

    async def wait_flushed(self) -> None:
        """Wait for the flush under way, if any."""
        if self._flushing is not None and not self._flushing.done():
            await self._flushing

    def flush_again(self) -> None:
        """Start a flush of what is pending."""
        self._flushing = asyncio.ensure_future(self.flush())

    async def flush(self) -> None:
        """Send what is pending, taking free slots' work with it while taking."""
        await asyncio.sleep(0)  # gather what ends in this turn
        intake = self.intake
        while self.pending and self.offline is None and self.link is not None:
            batch, self.pending = self.pending, []
            take = max(0, intake.free()) if self.taking and self.link.takes_with_reports else 0
            intake.asking += take
            try:
                reply = await self.link.report(batch, take=take)
            except QueueUnavailable as err:
                self.pending[:0] = batch  # kept, in order, for when the queue is back
                self.go_offline(err)
                return
            finally:
                intake.asking -= take
                self._nudge()  # the slots asked for are free again, or filled below
            self.settle(batch, reply.receipts)
            if take:
                if len(reply.leases) >= take:
                    self._wake()  # a full take: more may be waiting
                self.leased_with_ack += len(reply.leases)
                for lease in reply.leases:
                    intake.start(lease)

    def settle(self, batch: Sequence[Report], receipts: Sequence[Any]) -> None:
        """What the queue said about each outcome of ``batch``."""
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
    def go_offline(self, err: Exception) -> None:
        """The queue is away: say so once; handlers keep running, outcomes are kept."""
        if self.offline is None:
            self.outages += 1
            self.offline = str(err)
            _log.warning(
                "%s: the action queue is away (%s); handlers keep running, their outcomes are kept "
                "and reported when it is back",
                self.name,
                err,
            )
        self._nudge()

    async def recover(self, stop: asyncio.Event | None = None, until_mono: float | None = None) -> bool:
        """Reconnect with backoff: renew what runs, send checkpoints and outcomes kept meanwhile.
        Gives up (returns False) once ``stop`` is set or ``until_mono`` has passed."""
        assert self.link is not None
        pause = RECONNECT_FIRST_S
        reported = 0
        while True:
            try:
                reported = await self._catch_up(self.link)
                break
            except QueueUnavailable as err:
                self.offline = str(err)
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
        self.offline = None
        return True

    async def _catch_up(self, link: WorkerLink) -> int:
        """One try at :meth:`recover`: returns how many outcomes it reported (raises
        :class:`QueueUnavailable`)."""
        await self.intake.renew(link)
        for ctx in self.intake.contexts():
            if ctx.has_pending_checkpoint and not ctx.lost:
                await link.checkpoint(ctx.lease, ctx.pending_checkpoint)
                ctx.has_pending_checkpoint = False
        batch, self.pending = self.pending, []
        if batch:
            try:
                reply = await link.report(batch)
            except QueueUnavailable:
                self.pending[:0] = batch
                raise
            self.settle(batch, reply.receipts)
        return len(batch)
