"""The action queue of a queue service (:class:`~embodied_bus.actions.core.QueueCore`), reached
through a :class:`ServiceTransport`: request/reply plus lightweight topics. On Zenoh the
transport is the bus (the service is :class:`~embodied_bus.actions.service.QueueService`);
in-process it is :class:`~embodied_bus.actions.memory.MemoryQueue`'s.

Topics: ``actions/result/<id>`` (an ended action's envelope), ``actions/fb/<id>`` (feedback,
:mod:`~embodied_bus.actions.feedback`), ``actions/wake/<kind>`` (actions of a kind may be ready) and
``actions/assign/<executor>`` (leases pushed to an idle executor: a JSON array of envelopes).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import msgspec

from embodied_bus.actions import protocol as p
from embodied_bus.actions.feedback import HolderGate, decode_feedback, encode_feedback
from embodied_bus.actions.model import Action, ActionError, ActionStatus, decode_action
from embodied_bus.actions.queue import (
    EXECUTOR_GROUP,
    ActionQueue,
    Backlog,
    ExecutorSpec,
    Lease,
    QueueOptions,
    QueueUnavailable,
    Receipt,
    Renewal,
    Report,
    ReportReply,
    Submitted,
    WorkerLink,
    ZenohQueueOptions,
    announcement,
)
from embodied_bus.engines.capabilities import membership, notifications, request_reply
from embodied_bus.errors import BusClosedError, BusConnectionError
from embodied_bus.security.allowlist import Role
from embodied_bus.security.seal import Refused, reply_channel

if TYPE_CHECKING:
    from embodied_bus.bus import Bus
    from embodied_bus.engines.base import GroupMembership

__all__ = [
    "QUEUE_GROUP",
    "SERVICE",
    "ServiceQueue",
    "ServiceTransport",
    "ZenohTransport",
    "open_zenoh_queue",
    "warn_if_unsealed",
]

_log = logging.getLogger("embodied_bus.actions")

#: Request/reply service name of the queue service.
SERVICE = "actions"
#: Liveness group the queue service announces itself in (executors watch it: a queue that
#: cannot be seen cannot confirm their leases).
QUEUE_GROUP = "actions-queue"
R = TypeVar("R")


class ServiceTransport(Protocol):
    """How a client reaches a queue service."""

    async def request(
        self, payload: bytes, timeout_s: float, accept: Callable[[bytes], bool] | None = None
    ) -> bytes | None:
        """Ask the service; None if it did not answer within ``timeout_s`` seconds (with
        ``accept``: every server is asked, and the first answer it accepts is returned)."""

    def listen(self, topic: str, callback: Callable[[str, bytes], None]) -> Any:
        """Receive messages of ``topic`` (``*`` matches one segment) on any thread; returns a
        handle with ``undeclare()``."""

    def notify(self, topic: str, payload: bytes) -> None:
        """Send a message on a lightweight topic (best effort)."""

    async def join(self, member: str, value: str) -> GroupMembership:
        """Announce an executor in :data:`~embodied_bus.actions.queue.EXECUTOR_GROUP`."""

    async def watch_service(self) -> GroupMembership:
        """Watch the queue service's liveness (:data:`QUEUE_GROUP`: it is alive while it has a
        member)."""


class ZenohTransport:
    """A queue service reached over a Zenoh bus."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def request(
        self, payload: bytes, timeout_s: float, accept: Callable[[bytes], bool] | None = None
    ) -> bytes | None:
        return await request_reply(self.bus.engine, "the action queue service's clients").request(
            SERVICE, payload, timeout_s, accept
        )

    def listen(self, topic: str, callback: Callable[[str, bytes], None]) -> Any:
        return notifications(self.bus.engine, "the action queue service's clients").listen(topic, callback)

    def notify(self, topic: str, payload: bytes) -> None:
        notifications(self.bus.engine, "the action queue service's clients").notify(topic, payload)

    async def join(self, member: str, value: str) -> GroupMembership:
        group = await membership(self.bus.engine, "the action queue service's clients").watch_group(
            EXECUTOR_GROUP, lambda *_: None
        )
        await group.announce(member, value)
        return group

    async def watch_service(self) -> GroupMembership:
        return await membership(self.bus.engine, "the action queue service's clients").watch_group(
            QUEUE_GROUP, lambda *_: None
        )


_WARNED_UNSEALED: set[str] = set()


def warn_if_unsealed(bus: Bus, sealed: bool, who: str) -> None:
    """Say once, loudly, that ``who`` runs the action queue unsealed on a bus other hosts can
    reach, and how to seal it."""
    if sealed or who in _WARNED_UNSEALED or not getattr(bus.settings, "reaches_other_hosts", False):
        return
    _WARNED_UNSEALED.add(who)
    _log.warning(
        "%s: the action queue's messages on %s are NOT SEALED, and other hosts can reach this bus: "
        "anyone on the network can forge leases, results and feedback. Run 'embodied-bus keys init "
        "KEYS_DIR' and give every process the flags (or the robot YAML 'security:' section) it "
        "prints; see docs/security.md",
        who,
        bus.url,
    )


def open_zenoh_queue(bus: Bus, options: QueueOptions) -> ActionQueue:
    """The action queue of a Zenoh bus: its queue service (``embodied-bus queue``)."""
    queue = ServiceQueue(ZenohTransport(bus), options)
    sealed = queue.sealing.sealer is not None and queue.sealing.trust is not None
    warn_if_unsealed(bus, sealed, "this process")
    return queue


#: Who may send the queue's own messages (replies, results, pushes), and feedback.
QUEUE_ROLES = frozenset({Role.QUEUE})
EXECUTOR_ROLES = frozenset({Role.EXECUTOR})


def _actions(raws: Sequence[msgspec.Raw]) -> list[Action]:
    return [decode_action(bytes(r)) for r in raws]


class ServiceQueue(ActionQueue):
    """The planner's end of a queue service.

    Args:
        transport: How the service is reached.
        options: ``request_timeout_s`` bounds each request.
    """

    def __init__(self, transport: ServiceTransport, options: QueueOptions | None = None) -> None:
        self.transport = transport
        self.options = options or QueueOptions()
        #: Sealing and trust of this party's queue messages.
        self.sealing = self.options.backend_options(ZenohQueueOptions, "Zenoh")
        self._subs: list[Any] = []

    async def call(self, request: p.Request, expected: type[R], timeout_s: float | None = None) -> R:
        """One request and its typed reply.

        Raises:
            QueueUnavailable: No queue service answered in time.
            ActionError: The service refused the request (its reason).
        """
        wait_s = self.options.request_timeout_s if timeout_s is None else timeout_s
        payload = self.seal("request", p.encode(request))
        trust = self.sealing.trust
        if trust is None:
            raw = await self.transport.request(payload, wait_s)
            if raw is None:
                raise QueueUnavailable(f"no action queue service answered within {wait_s:g} s")
            return p.decode_reply(raw, expected)
        channel = reply_channel(payload)
        opened: list[bytes] = []
        refused: list[str] = []

        def the_queues(raw: bytes) -> bool:  # any transport thread
            try:
                opened.append(trust.open(channel, raw, QUEUE_ROLES).body)
            except Refused as err:  # a stand-in's answer: the real queue's may still come
                refused.append(str(err))
                return False
            return True

        if await self.transport.request(payload, wait_s, the_queues) is None or not opened:
            if refused:
                _log.warning("refused %d reply(s) not sealed by the queue: %s", len(refused), refused[0])
            raise QueueUnavailable(f"no action queue service answered within {wait_s:g} s")
        return p.decode_reply(opened[0], expected)

    def seal(self, channel: str, body: bytes) -> bytes:
        """``body`` sealed for ``channel`` (as it is when this party has no sealer)."""
        sealer = self.sealing.sealer
        return body if sealer is None else sealer.seal(channel, body)

    def opened(self, channel: str, data: bytes, roles: frozenset[Role]) -> bytes:
        """What a message received on ``channel`` says, if its sender may say it (every
        message is believed when this party has no trust configured).

        Raises:
            Refused: It is not sealed by a key of the allow-list with one of ``roles``.
        """
        trust = self.sealing.trust
        return data if trust is None else trust.open(channel, data, roles).body

    async def submit(self, actions: Sequence[Action]) -> list[Submitted]:
        reply = await self.call(p.Submit(list(actions)), p.SubmitReply)
        return [Submitted(s.id, s.duplicate, ActionStatus(s.status)) for s in reply.actions]

    async def get(self, action_id: str) -> Action | None:
        envelope = (await self.call(p.Get(action_id), p.ActionReply)).envelope()
        return decode_action(envelope) if envelope is not None else None

    async def ended(self, action_ids: Sequence[str]) -> list[Action]:
        return _actions((await self.call(p.Ended(list(action_ids)), p.ActionsReply)).actions)

    async def cancel(self, action_id: str) -> Action | None:
        envelope = (await self.call(p.Cancel(action_id), p.ActionReply)).envelope()
        return decode_action(envelope) if envelope is not None else None

    async def dead_letters(self) -> list[Action]:
        return _actions((await self.call(p.DeadLetters(), p.ActionsReply)).actions)

    async def requeue(self, action_id: str) -> Action:
        envelope = (await self.call(p.Requeue(action_id), p.ActionReply)).envelope()
        if envelope is None:
            raise ActionError(f"action {action_id} is not in the dead-letter queue")
        return decode_action(envelope)

    async def purge_dead(self) -> int:
        return (await self.call(p.Purge(), p.Done)).count

    async def backlog(self) -> Backlog:
        reply = await self.call(p.GetBacklog(), p.BacklogReply)
        return Backlog.from_dict(msgspec.structs.asdict(reply))

    async def watch_results(self, on_result: Callable[[Action], None]) -> None:
        loop = asyncio.get_running_loop()

        def arrived(topic: str, payload: bytes) -> None:  # transport thread
            try:
                action = decode_action(self.opened(topic, payload, QUEUE_ROLES))
            except (ActionError, Refused) as err:
                _log.warning("ignored a result on %s: %s", topic, err)
                return
            if topic != f"actions/result/{action.id}":
                _log.warning("ignored a result of action %s on %s", action.id, topic)
                return
            loop.call_soon_threadsafe(on_result, action)

        self._subs.append(self.transport.listen("actions/result/*", arrived))

    async def watch_feedback(
        self, action_id: str, on_feedback: Callable[[Any], None], on_end: Callable[[], None]
    ) -> Callable[[], None]:
        loop = asyncio.get_running_loop()
        trust = self.sealing.trust
        gate = HolderGate(action_id, self.get, on_feedback) if trust is not None else None

        def feedback(topic: str, payload: bytes) -> None:  # transport thread
            try:
                if trust is None:
                    data = msgspec.json.decode(decode_feedback(payload).data)
                    loop.call_soon_threadsafe(on_feedback, data)
                    return
                opened = trust.open(topic, payload, EXECUTOR_ROLES)
                envelope = decode_feedback(opened.body)
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, Refused) as err:
                _log.debug("ignored feedback on %s: %r", topic, err)
                return
            if gate is not None:
                loop.call_soon_threadsafe(gate.offer, envelope, opened.sender)

        def ended(topic: str, payload: bytes) -> None:
            try:
                self.opened(topic, payload, QUEUE_ROLES)
            except Refused:
                return
            loop.call_soon_threadsafe(on_end)

        subs = [
            self.transport.listen(f"actions/fb/{action_id}", feedback),
            self.transport.listen(f"actions/result/{action_id}", ended),
        ]

        def stop() -> None:
            for s in subs:
                s.undeclare()
            if gate is not None:
                gate.close()

        return stop

    def worker(self, spec: ExecutorSpec) -> WorkerLink:
        return ServiceWorker(self, spec)

    async def close(self) -> None:
        subs, self._subs = self._subs, []
        for s in subs:
            try:
                s.undeclare()
            except Exception as err:  # the session is gone already
                _log.debug("undeclare on close: %s", err)


class ServiceWorker(WorkerLink):
    """One executor's end of a queue service."""

    takes_with_reports = True

    def __init__(self, queue: ServiceQueue, spec: ExecutorSpec) -> None:
        self.queue = queue
        self.spec = spec
        self.ref = p.ExecutorRef(spec.name, spec.session)
        self._subs: list[Any] = []
        self._group: GroupMembership | None = None
        self._service: GroupMembership | None = None

    def _take_request(self, n: int) -> p.Take:
        return p.Take(self.ref, list(self.spec.kinds), dict(self.spec.labels), min(n, p.MAX_LEASES), True)

    def _leases(self, raws: Sequence[msgspec.Raw]) -> list[Lease]:
        return [Lease(a, self.spec.name) for a in _actions(raws)]

    async def open(self, on_wake: Callable[[], None], on_pushed: Callable[[list[Lease]], None]) -> None:
        loop = asyncio.get_running_loop()
        transport = self.queue.transport
        posted = [False]

        def woken(_topic: str, _payload: bytes) -> None:  # transport thread
            if not posted[0]:  # one wake-up per burst of work
                posted[0] = True
                try:
                    loop.call_soon_threadsafe(wake_now)
                except RuntimeError:  # the loop is closed
                    pass

        def wake_now() -> None:
            posted[0] = False
            on_wake()

        def pushed(_topic: str, payload: bytes) -> None:  # transport thread
            loop.call_soon_threadsafe(self._accept, payload, on_pushed)

        try:
            self._service = await transport.watch_service()
            self._subs = [transport.listen(f"actions/wake/{k}", woken) for k in self.spec.kinds]
            self._subs.append(transport.listen(f"actions/assign/{self.spec.name}", pushed))
            self._group = await transport.join(self.spec.name, announcement(self.spec))
        except BusConnectionError as err:
            raise QueueUnavailable(str(err)) from err

    def _accept(self, payload: bytes, on_pushed: Callable[[list[Lease]], None]) -> None:
        """Leases the service pushed (loop thread); malformed or refused ones are logged and left
        to their lease expiry (then retried elsewhere)."""
        channel = f"actions/assign/{self.spec.name}"
        try:
            body = self.queue.opened(channel, payload, QUEUE_ROLES)
            raws = msgspec.json.decode(body, type=list[msgspec.Raw])
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, Refused) as err:
            _log.warning("bad push to %s: %r", self.spec.name, err)
            return
        leases = []
        for raw in raws:
            try:
                leases.append(Lease(decode_action(bytes(raw)), self.spec.name))
            except ActionError as err:
                _log.warning("bad action pushed to %s: %s", self.spec.name, err)
        if leases:
            on_pushed(leases)

    async def _call(self, request: p.Request, expected: type[R], timeout_s: float | None = None) -> R:
        try:
            return await self.queue.call(request, expected, timeout_s)
        except BusClosedError:
            raise
        except BusConnectionError as err:
            raise QueueUnavailable(str(err)) from err

    async def take(self, max_actions: int) -> list[Lease]:
        reply = await self._call(self._take_request(max_actions), p.LeasesReply)
        return self._leases(reply.actions)

    async def renew(self, leases: Sequence[Lease]) -> Renewal:
        refs = [p.LeaseRef(x.id, x.attempt) for x in leases]
        canceled: set[str] = set()
        lost: set[str] = set()
        for i in range(0, len(refs), p.MAX_LEASES):
            reply = await self._call(p.Renew(self.ref, refs[i : i + p.MAX_LEASES]), p.RenewReply)
            canceled.update(reply.canceled)
            lost.update(reply.lost)
        return Renewal(frozenset(canceled), frozenset(lost))

    async def checkpoint(self, lease: Lease, state: Any) -> None:
        await self._call(p.Checkpoint(self.ref, p.LeaseRef(lease.id, lease.attempt), state), p.Done)

    async def report(self, reports: Sequence[Report], *, take: int = 0) -> ReportReply:
        items = [p.ReportItem(r.action_id, r.attempt, r.ok, r.result, r.reason, r.permanent) for r in reports]
        receipts: list[Receipt] = []
        leases: list[Lease] = []
        for i in range(0, len(items), p.MAX_LEASES):
            last = i + p.MAX_LEASES >= len(items)
            more = self._take_request(take) if last and take > 0 else None
            reply = await self._call(p.Reports(self.ref, items[i : i + p.MAX_LEASES], more), p.ReportsReply)
            receipts.extend(
                Receipt(r.accepted, ActionStatus(r.status) if r.status else None, r.error)
                for r in reply.receipts
            )
            leases.extend(self._leases(reply.actions))
        return ReportReply(receipts, leases)

    def feedback(self, lease: Lease, data: bytes) -> None:
        try:
            topic = f"actions/fb/{lease.id}"
            body = encode_feedback(self.spec.name, lease.attempt, data)
            self.queue.transport.notify(topic, self.queue.seal(topic, body))
        except BusConnectionError as err:  # best effort
            _log.debug("feedback of %s not sent: %s", lease.id, err)

    def connected(self) -> bool:
        return self._service is not None and bool(self._service.members())

    async def retire(self) -> None:
        await self._call(p.Retire(self.ref), p.Done, timeout_s=0.5)

    async def close(self) -> None:
        subs, self._subs = self._subs, []
        for s in subs:
            try:
                s.undeclare()
            except Exception as err:  # the session is gone already
                _log.debug("undeclare on close: %s", err)
        for group in (self._group, self._service):
            if group is not None:
                await group.leave()
        self._group = self._service = None
