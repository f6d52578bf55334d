"""The queue service's logic, transport-free: an :class:`ActionStore` answering typed requests
(:mod:`embodied_bus.actions.protocol`), watching executor liveness and pushing work to idle
executors. The Zenoh :class:`~embodied_bus.actions.service.QueueService` serves it on a bus;
the in-memory backend calls it in-process.

Dispatch is pull with a push fast path: an executor takes what is ready (:class:`Take`); when
that leaves it free slots it is recorded as idle, and a later submit leases new actions to idle
executors at once and pushes them (no wake-up and take round trip). An executor's next take is
reduced by what was pushed to it since its previous one, so its concurrency limit holds even
when a push and a take cross. A lease is taken back when its executor leaves the executor group
(the process died, or its session's liveness expired) or when it was not renewed for its
length; a queue that starts gives the leases on its disk a grace period first, so executors
that ran on through its absence renew them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from embodied_bus.actions import protocol as p
from embodied_bus.actions.model import MAX_PAYLOAD_BYTES, Action, ActionError, ActionStatus
from embodied_bus.actions.queue import LEASE_S, Backlog, BacklogRow, parse_announcement
from embodied_bus.actions.store import ActionStore, Settled
from embodied_bus.model.limits import DEFAULT_LIMITS
from embodied_bus.security.allowlist import AllowedKey, Role
from embodied_bus.security.seal import Refused, RefuseReason, Sealer, Trust, reply_channel

__all__ = ["RESTART_GRACE_S", "QueueCore", "QueueEvents"]

#: Who may send requests at all; which requests are whose is checked per request.
_REQUEST_ROLES = frozenset({Role.PLANNER, Role.EXECUTOR})
#: The requests of executors (each names the executor it is made for).
_EXECUTOR_REQUESTS = (p.Take, p.Renew, p.Checkpoint, p.Reports, p.Retire)

#: Leases on disk when a queue starts last at least this long, seconds: executors that ran
#: through the queue's absence reconnect and renew them in that time.
RESTART_GRACE_S = 10.0


class QueueEvents(Protocol):
    """What the core tells the world (called with the core's lock held: do not block long).
    Payloads are sealed for their topic where the core has a sealer."""

    def result(self, action_id: str, payload: bytes) -> None:
        """An action ended: its envelope, for its planner (``actions/result/<id>``)."""

    def wake(self, kind: str) -> None:
        """Actions of ``kind`` may be ready."""

    def push(self, executor: str, payload: bytes) -> None:
        """Leases granted to an idle executor, for it to run: a JSON array of envelopes
        (``actions/assign/<executor>``)."""


@dataclass(slots=True)
class _Idle:
    """An executor with free slots that asked to be pushed work."""

    take: p.Take
    free: int


class QueueCore:
    """The queue service's state and rules.

    Args:
        store: The durable queue.
        events: Where results, wake-ups and pushes go.
        lease_s: Lease length, seconds.
        loss_grace_s: Delay between an executor leaving the group and its leases going back
            (released by :meth:`sweep`), seconds; 0: at once.
        sealer: Seal replies, results and pushes (the queue's key).
        trust: Answer only requests sealed by a key whose role allows them (planner requests
            by planners, an executor's by a key that may act as that executor), and count the
            executors of the group only once they proved who they are.
    """

    def __init__(
        self,
        store: ActionStore,
        events: QueueEvents,
        *,
        lease_s: float = LEASE_S,
        loss_grace_s: float = 0.0,
        sealer: Sealer | None = None,
        trust: Trust | None = None,
    ) -> None:
        self.store = store
        self.events = events
        self.sealer = sealer
        self.trust = trust
        self._started_ns = 0  # when serving began (UTC ns): requests sealed before may be replays
        #: Executor processes that proved who they are (sealed requests): name -> session.
        self.authenticated: dict[str, str] = {}
        self._tokens: dict[str, str] = {}  # executor group members seen: name -> session
        #: Requests and group changes refused because their sender is not trusted.
        self.refused = 0
        self.lease_s = lease_s
        #: An executor that leaves the group gives its leases back this long after (seconds):
        #: the process of an executor cut off from the network learns it lost the queue in
        #: that time, before another run starts.
        self.loss_grace_s = loss_grace_s
        self._leaving: dict[str, tuple[str, float]] = {}  # member -> (session, release at)
        self.lock = threading.Lock()
        #: Live executors: name -> session.
        self.live: dict[str, str] = {}
        #: The kinds each live executor runs (from its announcement).
        self.live_kinds: dict[str, frozenset[str]] = {}
        self._idle: dict[str, _Idle] = {}
        self._pushed_since: dict[str, int] = {}
        self.closed = False
        #: Requests answered with an error (malformed, invalid or oversized).
        self.bad_requests = 0
        #: Actions handed to idle executors on submit (no take round trip).
        self.pushed = 0
        self._handlers: dict[type, Callable[[Any, int], p.Reply]] = {
            p.Submit: self._submit,
            p.Get: self._get,
            p.Ended: self._ended,
            p.Cancel: self._cancel,
            p.DeadLetters: self._dead_letters,
            p.Requeue: self._requeue,
            p.Purge: self._purge,
            p.GetBacklog: self._backlog,
            p.Take: self._take,
            p.Renew: self._renew,
            p.Checkpoint: self._checkpoint,
            p.Reports: self._reports,
            p.Retire: self._retire,
        }

    # ------------------------------------------------------------------ entry points
    def start(self, now_ns: int | None = None) -> None:
        """Give the leases on disk :data:`RESTART_GRACE_S` to be renewed."""
        now = now_ns if now_ns is not None else time.time_ns()
        self._started_ns = now
        with self.lock:
            self.store.hold_leases(now + int(RESTART_GRACE_S * 1e9))

    def handle_bytes(self, raw: bytes) -> bytes:
        """One request as (sealed) JSON bytes → its (sealed) reply (called on transport
        threads). A bad or refused request is answered with the reason and counted in
        :attr:`bad_requests` or :attr:`refused`."""
        body, sender = raw, None
        if self.trust is not None:
            try:
                opened = self.trust.open(
                    "request", raw, _REQUEST_ROLES, once=True, not_before_ns=self._started_ns
                )
            except Refused as err:
                self.refused += 1
                # a request sealed before this service started may be a genuine one in flight:
                # its sender seals it afresh when told to try again
                again = err.reason is RefuseReason.REPLAYED
                return self._reply(raw, p.Failed(f"refused: {err}", unavailable=again))
            body, sender = opened.body, opened.sender
        try:
            request = p.decode_request(body)
        except ActionError as err:
            self.bad_requests += 1
            return self._reply(raw, p.Failed(str(err)))
        if sender is not None:
            why = self._not_allowed(request, sender)
            if why is not None:
                self.refused += 1
                return self._reply(raw, p.Failed(f"refused: {why}"))
        return self._reply(raw, self.handle(request, len(body)))

    def _reply(self, request: bytes, reply: p.Reply) -> bytes:
        return self._seal(reply_channel(request), p.encode(reply))

    def _seal(self, channel: str, body: bytes) -> bytes:
        return body if self.sealer is None else self.sealer.seal(channel, body)

    def _not_allowed(self, request: p.Request, sender: AllowedKey) -> str | None:
        """Why ``sender`` may not make ``request`` (None: it may); an executor that may is
        recorded as authenticated."""
        if isinstance(request, _EXECUTOR_REQUESTS):
            name, session = request.executor.name, request.executor.session
            if not sender.acts_as(name):
                return f"key {sender.name} may not act as executor {name!r}"
            with self.lock:
                if self.authenticated.get(name) != session:
                    self.authenticated[name] = session
                    if self._tokens.get(name) == session:
                        self._joined(name, session)
            return None
        if Role.PLANNER not in sender.roles:
            return f"key {sender.name} may not make planner requests"
        return None

    def handle(self, request: p.Request, size: int = 0) -> p.Reply:
        """Answer one typed request (``size``: its encoded length, bytes; 0 if unknown)."""
        try:
            with self.lock:
                if self.closed:
                    return p.Failed("the action queue service is shutting down", unavailable=True)
                try:
                    return self._handlers[type(request)](request, size)
                finally:
                    self._publish_ended_on_the_way()
        except ActionError as err:
            self.bad_requests += 1
            return p.Failed(str(err))

    def executor_changed(self, member: str, value: str, joined: bool) -> None:
        """An executor joined or left the executor group (transport threads). Where requests
        must be sealed, a member counts only once it proved who it is (a liveliness token says
        nothing about who declared it)."""
        ann = parse_announcement(value)
        session = ann.session if ann is not None else ""
        with self.lock:
            if self.closed:
                return
            if joined:
                self._tokens[member] = session
            elif self._tokens.get(member) == session:
                del self._tokens[member]
            if self.trust is not None and self.authenticated.get(member) != session:
                self.refused += 1
                return
            if joined:
                self.live_kinds[member] = frozenset(ann.kinds) if ann is not None else frozenset()
                self._joined(member, session)
                return
            if self.live.get(member) == session:
                del self.live[member]
                self.live_kinds.pop(member, None)
            self._idle.pop(member, None)
            self._pushed_since.pop(member, None)
            if self.loss_grace_s > 0:  # released by the sweep, unless it comes back
                self._leaving[member] = (session, time.monotonic() + self.loss_grace_s)
                return
            for a in self.store.release_lost(executor=member, session=session):
                self._after_change(a)

    def _joined(self, member: str, session: str) -> None:
        """``member`` (process ``session``) is in the group (under the lock): a new process under
        that name means its predecessor's leases are lost."""
        self.live[member] = session
        for a in self.store.release_lost(executor=member, keep_session=session):
            self._after_change(a)

    def _release_departed(self) -> None:
        """Leases of executors that left the group :attr:`loss_grace_s` ago and did not come
        back (under the lock)."""
        now = time.monotonic()
        for member, (session, due) in list(self._leaving.items()):
            if due > now:
                continue
            del self._leaving[member]
            if self.live.get(member) == session:
                continue  # back (a brief loss of the link)
            for a in self.store.release_lost(executor=member, session=session):
                self._after_change(a)

    def sweep(self, now_ns: int | None = None) -> None:
        """Take back leases that were not renewed in time; dead-letter actions whose deadline
        passed while they waited."""
        now = now_ns if now_ns is not None else time.time_ns()
        with self.lock:
            if self.closed:
                return
            self._release_departed()
            for a in self.store.release_lost(now_ns=now):
                self._after_change(a)
            self.store.expire_deadlines(now)
            self._publish_ended_on_the_way()

    def prune(self) -> int:
        """Delete ended actions beyond the store's bound; returns how many."""
        with self.lock:
            return 0 if self.closed else self.store.prune()

    def backlog(self) -> Backlog:
        """The backlog, from any thread (empty once closed)."""
        with self.lock:
            return Backlog() if self.closed else self._count()

    def idle_executors(self) -> dict[str, int]:
        """Executors waiting for work that new actions are pushed to: name -> free slots."""
        with self.lock:
            return {name: idle.free for name, idle in self._idle.items()}

    def close(self) -> None:
        """Stop answering and close the store (an answer in flight finishes first)."""
        with self.lock:
            self.closed = True
            self.store.close()

    # ------------------------------------------------------------------ events
    def _publish(self, a: Action) -> None:
        self.events.result(a.id, self._seal(f"actions/result/{a.id}", self.store.encoded(a)))

    def _after_change(self, a: Action) -> None:
        """An action left a lease: publish its result if it ended, else wake its executors."""
        if a.status.terminal:
            self._publish(a)
        else:
            self.events.wake(a.kind)

    def _publish_ended_on_the_way(self) -> None:
        for a in self.store.take_expired():
            self._publish(a)
        for kind in self.store.sessions.take_unblocked():  # a session's next step may start
            self.events.wake(kind)

    def _wake_after(self, kind: str, delay_s: float) -> None:
        timer = threading.Timer(max(0.0, delay_s) + 0.01, self._wake_unless_closed, (kind,))
        timer.daemon = True  # a pending wake-up never holds the process open
        timer.start()

    def _wake_unless_closed(self, kind: str) -> None:
        if not self.closed:
            self.events.wake(kind)

    # ------------------------------------------------------------------ planner requests
    def _submit(self, req: p.Submit, size: int) -> p.Reply:
        # an envelope no larger than the payload limit cannot hold an oversized payload
        big = size == 0 or size > MAX_PAYLOAD_BYTES
        if size > DEFAULT_LIMITS.max_action_bytes and any(
            len(msgspec.json.encode(a)) > DEFAULT_LIMITS.max_action_bytes for a in req.actions
        ):
            raise ActionError(
                f"an action envelope exceeds max_action_bytes {DEFAULT_LIMITS.max_action_bytes}"
            )
        for a in req.actions:
            a.validate(check_payload=big)
        stored = self.store.submit_many(req.actions)
        new_kinds = {a.kind for a, new in stored if new}
        if new_kinds:
            # an action with a selector may be hidden from the idle executors: wake the rest
            plain = new_kinds - {a.kind for a, new in stored if new and a.selector}
            for kind in new_kinds - (self._push_to_idle(new_kinds) & plain):
                self.events.wake(kind)
        return p.SubmitReply([p.SubmittedItem(a.id, not new, a.status.value) for a, new in stored])

    def _get(self, req: p.Get, _size: int) -> p.Reply:
        found = self.store.get(req.id)
        return p.ActionReply.of(self.store.encoded(found) if found else None)

    def _ended(self, req: p.Ended, _size: int) -> p.Reply:
        return p.ActionsReply(
            [msgspec.Raw(self.store.encoded(a)) for a in self.store.terminal_among(req.ids)]
        )

    def _cancel(self, req: p.Cancel, _size: int) -> p.Reply:
        a = self.store.cancel(req.id)
        if a is not None and a.status.terminal:
            self._publish(a)
        return p.ActionReply.of(self.store.encoded(a) if a else None)

    def _dead_letters(self, _req: p.DeadLetters, _size: int) -> p.Reply:
        return p.ActionsReply([msgspec.Raw(self.store.encoded(a)) for a in self.store.dead_letters()])

    def _requeue(self, req: p.Requeue, _size: int) -> p.Reply:
        a = self.store.requeue(req.id)
        self.events.wake(a.kind)
        return p.ActionReply.of(self.store.encoded(a))

    def _purge(self, _req: p.Purge, _size: int) -> p.Reply:
        return p.Done(self.store.purge_dead())

    def _count(self) -> Backlog:
        s = self.store
        rows = {k: BacklogRow(**v) for k, v in s.backlog().items()}
        return Backlog(rows, s.stats(), s.redeliveries, s.pruned)

    def _backlog(self, _req: p.GetBacklog, _size: int) -> p.Reply:
        b = self._count()
        return p.BacklogReply(b.as_dict()["backlog"], b.totals, b.redeliveries, b.pruned)

    # ------------------------------------------------------------------ executor requests
    def _lease(self, req: p.Take) -> list[bytes]:
        """Lease up to ``req.max`` ready actions to the executor, less what was pushed to it
        since its last take; record it as idle if it asked for pushes and has slots left."""
        name = req.executor.name
        free = req.max - self._pushed_since.pop(name, 0)
        leased = (
            self.store.lease_many(
                name,
                req.kinds,
                free,
                session=req.executor.session,
                labels=req.labels,
                lease_s=self.lease_s,
                live_executors=self.live_kinds,
            )
            if free > 0
            else []
        )
        if free - len(leased) > 0 and req.push:
            self._idle[name] = _Idle(req, free - len(leased))
        else:
            self._idle.pop(name, None)
        self._publish_ended_on_the_way()
        return [self.store.encoded(a) for a in leased]

    def _take(self, req: p.Take, _size: int) -> p.Reply:
        return p.LeasesReply([msgspec.Raw(b) for b in self._lease(req)])

    def _push_to_idle(self, kinds: set[str]) -> set[str]:
        """Lease newly submitted actions of ``kinds`` to idle executors and push them. Returns
        the kinds whose ready actions were all handed out (no wake needed)."""
        done: set[str] = set()
        for name, idle in list(self._idle.items()):
            wanted = [k for k in idle.take.kinds if k in kinds and k not in done]
            if not wanted:
                continue
            leased = self.store.lease_many(
                name,
                wanted,
                idle.free,
                session=idle.take.executor.session,
                labels=idle.take.labels,
                lease_s=self.lease_s,
                live_executors=self.live_kinds,
            )
            if len(leased) < idle.free:
                done.update(wanted)  # it took all it could see: nothing of these kinds is left
            if not leased:
                continue
            body = b"[" + b",".join(self.store.encoded(a) for a in leased) + b"]"
            self.events.push(name, self._seal(f"actions/assign/{name}", body))
            self.pushed += len(leased)
            self._pushed_since[name] = self._pushed_since.get(name, 0) + len(leased)
            idle.free -= len(leased)
            if idle.free <= 0:
                del self._idle[name]
        self._publish_ended_on_the_way()
        return done

    def _renew(self, req: p.Renew, _size: int) -> p.Reply:
        canceled, lost = self.store.renew(
            req.executor.name,
            [(x.id, x.attempt) for x in req.leases],
            session=req.executor.session,
            lease_s=self.lease_s,
        )
        return p.RenewReply(canceled, lost)

    def _checkpoint(self, req: p.Checkpoint, _size: int) -> p.Reply:
        self.store.checkpoint(
            req.lease.id,
            req.executor.name,
            req.state,
            attempt=req.lease.attempt,
            session=req.executor.session,
        )
        return p.Done()

    def _reports(self, req: p.Reports, _size: int) -> p.Reply:
        settled = self.store.settle_many(
            req.executor.name,
            [(r.id, r.attempt, r.ok, r.result, r.reason, r.permanent) for r in req.reports],
            session=req.executor.session,
        )
        receipts = [self._receipt(s) for s in settled]
        more = self._lease(req.take) if req.take is not None else []
        return p.ReportsReply(receipts, [msgspec.Raw(b) for b in more])

    def _receipt(self, s: Settled | ActionError) -> p.ReceiptItem:
        if isinstance(s, ActionError):
            return p.ReceiptItem(False, None, str(s))
        a = s.action
        if a.status.terminal:
            self._publish(a)
        elif a.status is ActionStatus.RETRYING:
            self._wake_after(a.kind, s.retry_after_s)
        return p.ReceiptItem(True, a.status.value)

    def _retire(self, req: p.Retire, _size: int) -> p.Reply:
        self._idle.pop(req.executor.name, None)
        return p.Done()
