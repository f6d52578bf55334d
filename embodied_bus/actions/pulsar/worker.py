"""An executor's end of the action queue on Pulsar.

* **Priorities.** Each level is a topic per kind; an executor consumes, with one multi-topic
  consumer per level, the kinds it runs, and a free slot takes the highest level it holds
  first. Consumers prefetch little (``receiver_queue_size`` = the executor's prefetch), so a
  backlog stays with the broker, which hands it to whichever executor asks next.
* **One live run.** Starting an attempt is a claim written to the state log and read back
  before the handler runs: of two executors that claim the same attempt (a message delivered
  twice), the first claim written stands and the other executor does not run. A delivery of an
  action whose open attempt belongs to a live executor (the broker redelivers what it held
  when it restarts) is parked, not started: it is settled when that attempt ends, or taken
  over once its executor is surely gone (absent from the executor group while this view of
  the group is up to date).
* **Attempts** are counted in the action itself (Pulsar's redelivery counter misses crashed
  consumers and resets on a broker restart). Retries are republished with ``deliver_after`` the
  policy's backoff, before the retry is recorded, so an action the log shows waiting always
  has a message in its queue.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import pulsar

from embodied_bus.actions import lifecycle
from embodied_bus.actions.lifecycle import Admission
from embodied_bus.actions.model import Action, ActionError, ActionStatus, decode_action, encode_action
from embodied_bus.actions.pulsar.claims import DoubtfulClaims
from embodied_bus.actions.pulsar.records import Event
from embodied_bus.actions.pulsar.sending import LoopInbox, send, unavailable
from embodied_bus.actions.pulsar.sessions import StrandedSteps, advance, advance_after, waits_in_session
from embodied_bus.actions.pulsar.topics import EXECUTOR_SUBSCRIPTION, PRIORITY_LEVELS
from embodied_bus.actions.queue import (
    EXECUTOR_GROUP,
    ExecutorSpec,
    Lease,
    QueueUnavailable,
    Receipt,
    Renewal,
    Report,
    ReportReply,
    WorkerLink,
    announcement,
    executors_with,
    parse_announcement,
)
from embodied_bus.engines.base import GroupMembership
from embodied_bus.engines.pulsar import close_handle
from embodied_bus.engines.pulsar.native import receive_async

if TYPE_CHECKING:
    from embodied_bus.actions.pulsar.connection import QueueConnection

__all__ = [
    "MAX_HANDBACKS",
    "NACK_REDELIVERY_MS",
    "PARK_CHECK_S",
    "RECEIVER_QUEUE_SIZE",
    "SYNC_AFTER_S",
    "PulsarWorker",
]

_log = logging.getLogger("embodied_bus.actions.pulsar")

#: Messages a consumer prefetches per priority level: small, so a busy executor does not hoard
#: work an idle one could run (it holds at most this + 1 unstarted actions per level); 2, not
#: 1, so the next message is on its way while the executor takes the last one.
RECEIVER_QUEUE_SIZE = 2
#: Delay before an action given back with a negative ack is offered again, milliseconds.
NACK_REDELIVERY_MS = 50
#: How often an executor gives an action back so another executor retries it, at most.
MAX_HANDBACKS = 20
#: A message older than this is checked against the state log before it starts, seconds (a
#: younger one was published moments ago; the log is followed continuously anyway).
SYNC_AFTER_S = 1.0
#: A level whose receive failed is asked again after this long, seconds.
REARM_AFTER_S = 0.2
#: Parked deliveries are looked at again this often, seconds.
PARK_CHECK_S = 0.25


@dataclass(slots=True)
class _Delivery:
    """A message received from a priority level."""

    consumer: Any
    msg: Any
    received_mono: float


@dataclass(slots=True)
class _Holding:
    """A lease this executor holds: the message it came with, and duplicates of it."""

    action: Action
    delivery: _Delivery
    reply_to: str
    #: How far the action's history had come when the claim stood (a message that is not
    #: newer than this duplicates the one held; a newer one is a retry written since).
    claimed: lifecycle.Version = field(default_factory=lambda: lifecycle.Version(0, 0, False))
    extra: list[_Delivery] = field(default_factory=list)


class PulsarWorker(WorkerLink):
    """One executor's consumers, leases and reports on Pulsar."""

    def __init__(self, conn: QueueConnection, spec: ExecutorSpec, *, prefetch: int | None = None) -> None:
        self.conn = conn
        self.spec = spec
        self.prefetch = prefetch or RECEIVER_QUEUE_SIZE
        self._consumers: dict[int, Any] = {}
        self._ready: list[tuple[int, int, _Delivery]] = []  # (-priority, seq, delivery)
        self._ready_lock = threading.Lock()
        self._seq = 0
        self._held: dict[str, _Holding] = {}
        self._parked: dict[str, list[_Delivery]] = {}
        self._handbacks: dict[str, int] = {}
        self._group: GroupMembership | None = None
        self._inbox: LoopInbox | None = None
        self._stop = threading.Event()
        self._on_wake: Callable[[], None] = lambda: None
        self._on_pushed: Callable[[list[Lease]], None] = lambda _leases: None
        self._watcher: asyncio.Task[None] | None = None
        self._claiming = 0  # deliveries whose claim is under way
        self._admitting: set[str] = set()  # actions with a delivery being admitted
        self._settled: OrderedDict[tuple[str, int], None] = OrderedDict()  # reported here, lately
        self._unavailable: QueueUnavailable | None = None  # a claim found the broker away
        self._tasks: set[asyncio.Future[None]] = set()
        self._stranded = StrandedSteps()
        self._doubtful = DoubtfulClaims(spec.session)

    # ------------------------------------------------------------------ set-up
    async def open(self, on_wake: Callable[[], None], on_pushed: Callable[[list[Lease]], None]) -> None:
        self._on_wake, self._on_pushed = on_wake, on_pushed
        self._inbox = LoopInbox.of(asyncio.get_running_loop())
        await self.conn.start()
        try:
            self._group = await self.conn.engine.watch_group(EXECUTOR_GROUP, lambda *_: None)
            await self._group.announce(self.spec.name, announcement(self.spec))
        except pulsar.PulsarException as err:
            raise unavailable("joining the executor group", err) from err
        for kind in self.spec.kinds:
            await self.conn.ensure_kind(kind)
        await self._open_consumers()
        self._watcher = asyncio.ensure_future(self._watch_parked())

    async def _open_consumers(self) -> None:
        kinds = sorted(self.spec.kinds)
        if not kinds:
            return

        def subscribe(priority: int) -> Any:
            return self.conn.engine.client.subscribe(
                [self.conn.topics.queue(priority, k) for k in kinds],
                EXECUTOR_SUBSCRIPTION,
                consumer_type=pulsar.ConsumerType.Shared,
                receiver_queue_size=self.prefetch,
                negative_ack_redelivery_delay_ms=NACK_REDELIVERY_MS,
                initial_position=pulsar.InitialPosition.Earliest,
                consumer_name=f"{self.spec.name}-{self.spec.session}",
            )

        try:
            for p in sorted(PRIORITY_LEVELS, reverse=True):
                self._consumers[p] = await asyncio.to_thread(subscribe, p)
        except pulsar.PulsarException as err:
            raise unavailable("subscribing to the priority topics", err) from err
        for priority in self._consumers:
            self._arm(priority)

    def _arm(self, priority: int) -> None:
        """Ask a level's consumer for one message. A level has at most one message received and
        not yet taken, plus those the client prefetched; the next one is asked for when
        :meth:`take` takes this one."""
        if self._stop.is_set():
            return
        consumer = self._consumers[priority]

        def got(result: Any, msg: Any) -> None:  # a client thread (or this one)
            if result != pulsar.Result.Ok:
                if self._stop.is_set() or self.conn.engine.closed:
                    return
                _log.warning("receive from priority %d failed: %s", priority, result)
                if self._inbox is not None:
                    self._inbox.post(self._rearm_later, priority)
                return
            with self._ready_lock:
                self._seq += 1
                heapq.heappush(
                    self._ready, (-priority, self._seq, _Delivery(consumer, msg, time.monotonic()))
                )
            if self._inbox is not None:
                self._inbox.post(self._on_wake)

        try:
            receive_async(consumer, got)
        except pulsar.PulsarException as err:  # closed meanwhile
            if not self._stop.is_set():
                _log.warning("receive from priority %d failed: %s", priority, err)
                if self._inbox is not None:
                    self._inbox.post(self._rearm_later, priority)

    def _rearm_later(self, priority: int) -> None:
        asyncio.get_running_loop().call_later(REARM_AFTER_S, self._arm, priority)

    # ------------------------------------------------------------------ taking work
    async def take(self, max_actions: int) -> list[Lease]:
        """Start claiming up to ``max_actions`` received deliveries, highest priority first, and
        return at once: a claim waits for the state log, and the leases that stand come through
        ``on_pushed`` (deliveries being claimed count against ``max_actions``)."""
        if self._unavailable is not None:
            err, self._unavailable = self._unavailable, None
            raise err
        taken: list[_Delivery] = []
        levels: list[int] = []
        with self._ready_lock:
            while self._ready and len(taken) < max_actions - self._claiming:
                neg_priority, _, item = heapq.heappop(self._ready)
                levels.append(-neg_priority)
                taken.append(item)
        for priority in levels:  # outside the lock: a prefetched message comes back at once
            self._arm(priority)
        if taken:
            self._claiming += len(taken)
            task = asyncio.ensure_future(self._claim_all(taken))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return []

    async def _claim_all(self, taken: list[_Delivery]) -> None:
        try:
            if len(taken) == 1:  # no gather (and its task) for the common case
                try:
                    started: list[Lease | BaseException | None] = [await self._begin(taken[0])]
                except Exception as err:
                    started = [err]
            else:
                started = await asyncio.gather(*(self._begin(d) for d in taken), return_exceptions=True)
        finally:
            self._claiming -= len(taken)
        leases = [got for got in started if isinstance(got, Lease)]
        for got in started:
            if isinstance(got, QueueUnavailable):
                self._unavailable = got  # told at the next take
            elif isinstance(got, BaseException):
                _log.error("%s could not start an action (handed back)", self.spec.name, exc_info=got)
        if leases:
            self._on_pushed(leases)
        if self._ready or self._unavailable is not None:
            self._on_wake()  # what waited behind these claims, or the news of an outage

    async def _begin(self, d: _Delivery) -> Lease | None:
        """Start an attempt on a delivery, or settle, park or hand it back; if Pulsar fails
        meanwhile the message is handed back (negative ack) for a later delivery."""
        try:
            return await self._admit(d)
        except BaseException:  # incl. cancellation of a stopping executor
            self._nack(d)
            raise

    def _nack(self, d: _Delivery) -> None:
        try:
            d.consumer.negative_acknowledge(d.msg)
        except pulsar.PulsarException as err:  # the consumer is gone: Pulsar redelivers
            _log.debug("hand-back failed: %s", err)

    def _ack(self, *deliveries: _Delivery) -> None:
        for d in deliveries:
            try:
                d.consumer.acknowledge(d.msg)
            except pulsar.PulsarException as err:  # redelivered later, then found settled
                _log.debug("ack failed: %s", err)

    def _current(self, env: Action) -> Action:
        """The newest known state of an action: the view's, or the message's own if it is newer."""
        with self.conn.state.peek(env.id) as view:
            if view is None or lifecycle.is_newer(env, view):
                if view is not None and view.budget_from == env.budget_from:
                    env.cancel_requested = env.cancel_requested or view.cancel_requested
                return env
            return view.copy()

    def _holder_gone(self, attempt: Any) -> bool:
        """Whether the executor of an open attempt is surely gone: absent from the executor group
        (silent for ``GROUP_EXPIRY_S``) while this view of the group is up to date. A holder
        that was cut off, not dead, stopped believing it holds the action half that time after
        its own heartbeats stopped coming back (its ``still_owner()`` needs them), so a takeover
        never overlaps its run."""
        if attempt.session == self.spec.session or self._group is None:
            return False  # this process: an outcome still on its way
        ann = parse_announcement(self._group.members().get(attempt.executor, ""))
        if ann is not None and ann.session == attempt.session:
            return False
        return self._group.settled()

    def _others_fresh(self, a: Action) -> bool:
        if self._handbacks.get(a.id, 0) >= MAX_HANDBACKS or self._group is None:
            return False
        live = set(executors_with(self._group.members(), a.kind))
        return bool(live - a.executors_tried() - {self.spec.name})

    async def _admit(self, d: _Delivery) -> Lease | None:
        msg = d.msg
        try:
            env = decode_action(msg.data())
        except ActionError as err:
            _log.warning("dead-lettered an unreadable queue message: %s", err)
            await send(
                await self.conn.producers.get(self.conn.topics.dlq),
                msg.data(),
                properties={"eb-error": str(err)},
            )
            self._ack(d)
            return None
        age_s = time.time() - msg.publish_timestamp() / 1000
        if msg.redelivery_count() > 0 or age_s > SYNC_AFTER_S:
            # an earlier delivery may have started it: read the log up to this receipt first
            await self.conn.state.caught_up(d.received_mono)
        held = self._held.get(env.id)
        if held is not None and lifecycle.version(env) <= held.claimed:
            held.extra.append(d)  # a duplicate of what this executor runs: settled with it
            return None
        if env.id in self._admitting:  # another delivery of it is being admitted here: after it
            self._parked.setdefault(env.id, []).append(d)
            return None
        self._admitting.add(env.id)
        try:
            return await self._decide(env, d)
        finally:
            self._admitting.discard(env.id)

    async def _decide(self, env: Action, d: _Delivery) -> Lease | None:
        msg = d.msg
        a = self._current(env)
        if a.session is not None and not a.status.terminal and waits_in_session(self.conn.state, a):
            self._nack(d)  # an earlier step of its session has not ended: it comes back later
            return None
        reply_to = msg.properties().get("eb-reply-to", "")
        now = time.time_ns()
        verdict = lifecycle.admit(
            a,
            self.spec.name,
            kinds=self.spec.kinds,
            labels=self.spec.labels,
            policy=self.conn.policy_for(a),
            holder_gone=self._holder_gone,
            others_fresh=self._others_fresh,
            now=now,
        )
        if verdict is Admission.ENDED:
            self._ack(d)
        elif verdict is Admission.HELD:
            self._parked.setdefault(a.id, []).append(d)
        elif verdict is Admission.NOT_FOR_ME:
            self._nack(d)  # another executor serves this kind or selector
        elif verdict is Admission.ELSEWHERE:
            if len(self._handbacks) > 10_000:  # actions handed back and then run elsewhere
                self._handbacks.clear()
            self._handbacks[a.id] = self._handbacks.get(a.id, 0) + 1
            self._nack(d)  # a live executor that has not failed it retries it
        elif verdict is Admission.START:
            self._handbacks.pop(a.id, None)
            return await self._claim(a, d, reply_to)
        else:  # expired, canceled or exhausted on the way: ended here
            await self.settle(a, [d], reply_to)
        return None

    async def _claim(self, a: Action, d: _Delivery, reply_to: str) -> Lease | None:
        """Start the attempt: write the claim, read it back, run only if it stood."""
        wait_s = (int(d.msg.properties().get("eb-not-before-ns", "0") or 0) - time.time_ns()) / 1e9
        if wait_s > 0:  # the rest of a retry backoff the broker rounded away
            await asyncio.sleep(wait_s)
        attempt = lifecycle.start(a, self.spec.name, self.spec.session, time.time_ns())
        try:
            await self.conn.state.read_back(await self.conn.state.publish(a))
        except BaseException:
            self._doubtful.add(a, reply_to)  # on the log maybe, and run by nobody
            raise
        with self.conn.state.peek(a.id) as view:
            current = view.open_attempt if view is not None else None
            stood = (
                current is not None
                and current.session == attempt.session
                and current.number == attempt.number
            )
            ended = view is not None and view.status.terminal
        if not stood:
            if ended:
                self._ack(d)
            else:  # another executor's claim stood: it runs; this delivery waits beside it
                self._parked.setdefault(a.id, []).append(d)
            return None
        self._held[a.id] = _Holding(a, d, reply_to, lifecycle.version(a))
        return Lease(a.copy(), self.spec.name)

    async def _watch_parked(self) -> None:
        """Settle parked deliveries whose action moved on; take over those whose holder is gone."""
        while not self._stop.is_set():
            await asyncio.sleep(PARK_CHECK_S)
            for action_id, deliveries in list(self._parked.items()):
                try:
                    await self._recheck(action_id, deliveries)
                except QueueUnavailable as err:
                    _log.debug("parked %s: %s", action_id, err)
                    break
            try:
                await self._stranded.check(self.conn)
                await self._doubtful.resolve(self.conn, self._busy, self.settle)
            except QueueUnavailable as err:
                _log.debug("stranded steps or doubtful claims: %s", err)

    def _busy(self, action_id: str) -> bool:
        return action_id in self._held or action_id in self._admitting

    async def _recheck(self, action_id: str, deliveries: list[_Delivery]) -> None:
        view = self.conn.state.get(action_id)
        if view is None:
            return
        if view.status.terminal:
            self._ack(*deliveries)
            del self._parked[action_id]
            return
        held = view.open_attempt
        if held is not None and not self._holder_gone(held):
            return
        del self._parked[action_id]
        if held is None:
            # waiting: a message newer than the parked ones carries it (a retry or a requeue is
            # published before it is recorded), unless a parked one is that message
            carriers = [d for d in deliveries if not lifecycle.is_newer(view, _envelope(d))]
            self._ack(*(d for d in deliveries if d not in carriers))
            deliveries = carriers
        if deliveries:
            first, rest = deliveries[0], deliveries[1:]
            if rest:
                self._parked[action_id] = rest
            lease = await self._begin(first)
            if lease is not None:
                self._on_pushed([lease])

    # ------------------------------------------------------------------ running
    def _holding(self, action_id: str, attempt: int) -> _Holding | None:
        h = self._held.get(action_id)
        if h is None or not h.action.attempts or h.action.attempts[-1].number != attempt:
            return None
        return h

    def _taken_back(self, h: _Holding) -> bool:
        """Whether the log shows this executor's attempt closed by someone else, or passed."""
        n = h.action.attempts[-1].number
        with self.conn.state.peek(h.action.id) as view:
            if view is None or view.budget_from != h.action.budget_from:
                return view is not None
            if len(view.attempts) > n:
                return True
            if len(view.attempts) == n:
                mine = view.attempts[n - 1]
                return mine.session != self.spec.session or (not mine.open and mine.outcome == "lost")
        return False

    async def renew(self, leases: Sequence[Lease]) -> Renewal:
        if not self.connected():
            raise QueueUnavailable(
                f"{self.spec.name}: its heartbeats do not come back from the Pulsar broker"
            )
        # a lease is confirmed only against a view that holds everything written until now (one
        # that missed a takeover while this executor was cut off would confirm a lost lease)
        await self.conn.state.caught_up(time.monotonic())
        canceled, lost = set(), set()
        for lease in leases:
            h = self._holding(lease.id, lease.attempt)
            if h is None and (lease.id, lease.attempt) in self._settled:
                continue  # its outcome was recorded while this renewal waited
            if h is None or self._taken_back(h):
                lost.add(lease.id)
            elif self.conn.state.cancel_requested(lease.id):
                canceled.add(lease.id)
        return Renewal(frozenset(canceled), frozenset(lost))

    async def checkpoint(self, lease: Lease, state: Any) -> None:
        h = self._holding(lease.id, lease.attempt)
        if h is None:
            raise ActionError(f"{self.spec.name} does not hold action {lease.id}")
        h.action.checkpoint = state
        await self.conn.state.publish(h.action)

    def feedback(self, lease: Lease, data: bytes) -> None:
        h = self._held.get(lease.id)
        if h is not None:
            self.conn.replies.add(h.reply_to, lease.id, Event.FEEDBACK, data)

    def connected(self) -> bool:
        return self._group is not None and self._group.healthy()

    # ------------------------------------------------------------------ outcomes
    async def settle(self, a: Action, deliveries: Sequence[_Delivery], reply_to: str) -> None:
        """A terminal state: dead-letter topic (if dead), state log, reply, then ack."""
        data = encode_action(a)
        if a.status is ActionStatus.DEAD:
            dlq = await self.conn.producers.get(self.conn.topics.dlq)
            await send(dlq, data, partition_key=a.id, properties={"eb-attempts": str(a.attempt_count)})
        logged = await self.conn.state.publish(a, encoded=data)
        self.conn.replies.add(reply_to, a.id, Event.RESULT, data)
        self._ack(*deliveries)
        if a.session is not None:  # its session's next step may go
            await self.conn.state.read_back(logged)
            await advance(self.conn, a.session, reply_to, died=a if a.status is ActionStatus.DEAD else None)

    async def report(self, reports: Sequence[Report], *, take: int = 0) -> ReportReply:
        receipts: list[Receipt | None] = [None] * len(reports)
        successes: list[tuple[int, _Holding, bytes]] = []
        failures: list[tuple[int, Report, _Holding]] = []
        now = time.time_ns()
        for i, r in enumerate(reports):
            h = self._holding(r.action_id, r.attempt)
            if h is None or self._taken_back(h):
                receipts[i] = await self._late(r, h)
                continue
            if r.ok:
                h.action.cancel_requested = h.action.cancel_requested or self.conn.state.cancel_requested(
                    h.action.id
                )
                lifecycle.succeed(h.action, r.result, now)
                successes.append((i, h, encode_action(h.action)))
            else:
                failures.append((i, r, h))
        if successes:  # their records go out together; each is acknowledged once persisted
            logged = await self.conn.state.enqueue(
                [(h.action.id, Event.SNAPSHOT, data) for _, h, data in successes]
            )
            for i, h, data in successes:
                self._release(h)
                self.conn.replies.add(h.reply_to, h.action.id, Event.RESULT, data)
                self._ack(h.delivery, *h.extra)
                receipts[i] = Receipt(True, h.action.status)
            sessions = {h.action.session: h.reply_to for _, h, _ in successes if h.action.session is not None}
            if sessions:  # their sessions' next steps may go: released beside the reply, not before it
                task = asyncio.ensure_future(advance_after(self.conn, logged, sessions))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        for i, r, h in failures:
            receipts[i] = await self._fail(r, h, now)
        return ReportReply([x if x is not None else Receipt(False, None, "not reported") for x in receipts])

    def _release(self, h: _Holding) -> None:
        if self._held.get(h.action.id) is h:  # not a later attempt's claim made meanwhile
            del self._held[h.action.id]
        self._settled[(h.action.id, h.action.attempts[-1].number)] = None
        while len(self._settled) > 10_000:
            self._settled.popitem(last=False)

    async def _late(self, r: Report, h: _Holding | None) -> Receipt:
        """An outcome of an attempt the log shows taken back: noted in the history; its message
        is not acknowledged (the run that took over may hold the same message)."""
        if h is not None:
            self._release(h)
        data = msgspec.json.encode([r.attempt, r.ok, r.reason])
        await self.conn.state.enqueue([(r.action_id, Event.LATE, data)])
        return Receipt(
            False, None, f"{self.spec.name} no longer holds action {r.action_id} (attempt {r.attempt})"
        )

    async def _fail(self, r: Report, h: _Holding, now: int) -> Receipt:
        a = h.action
        a.cancel_requested = a.cancel_requested or self.conn.state.cancel_requested(a.id)
        decision = lifecycle.fail(a, r.reason, self.conn.policy_for(a), now, permanent=r.permanent)
        try:
            if decision.status is ActionStatus.RETRYING:
                # the retry message first: a retry on the log always has a message to run it
                await self.conn.enqueue(a, h.reply_to, decision.retry_after_s)
                await self.conn.state.publish(a)
                self._ack(h.delivery, *h.extra)
            else:
                await self.settle(a, [h.delivery, *h.extra], h.reply_to)
        finally:
            self._release(h)
        return Receipt(True, a.status)

    # ------------------------------------------------------------------ closing
    async def close(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.cancel()
        for c in self._consumers.values():
            await close_handle(c, self.conn.engine)  # what it held goes back to the others
        self._consumers.clear()
        if self._group is not None:
            group, self._group = self._group, None
            await group.leave()


def _envelope(d: _Delivery) -> Action:
    try:
        return decode_action(d.msg.data())
    except ActionError:
        return Action("unknown")
