"""The action queue as planners and executors see it: one typed interface, one backend per
engine, chosen from a registry by the bus's engine (as streams choose their :class:`Engine`).

* :class:`ActionQueue` is the planner's side (submit, look up, cancel, dead letters, backlog,
  results and feedback) and makes the executor's side, a :class:`WorkerLink` per executor
  (take leases, renew them, checkpoint, report outcomes, send feedback).
* Backends: a Zenoh queue service (:mod:`embodied_bus.actions.remote`), Apache Pulsar's own
  topics (:mod:`embodied_bus.actions.pulsar`) and an in-process queue for tests
  (:class:`embodied_bus.actions.memory.MemoryQueue`). What happens to an action is decided in
  :mod:`embodied_bus.actions.lifecycle`, which every backend calls.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from embodied_bus.actions.model import Action, ActionStatus
from embodied_bus.actions.policy import RetryPolicy
from embodied_bus.errors import BusConfigError, BusConnectionError

if TYPE_CHECKING:
    from embodied_bus.bus import Bus
    from embodied_bus.security.seal import Sealer, Trust

__all__ = [
    "EXECUTOR_GROUP",
    "LEASE_S",
    "ActionQueue",
    "Announcement",
    "BackendOptions",
    "Backlog",
    "BacklogRow",
    "ExecutorSpec",
    "Lease",
    "PulsarQueueOptions",
    "QueueOptions",
    "QueueUnavailable",
    "Receipt",
    "Renewal",
    "Report",
    "ReportReply",
    "Submitted",
    "WorkerLink",
    "ZenohQueueOptions",
    "executors_with",
    "open_queue",
    "parse_announcement",
    "register_queue",
]

#: Liveness group every executor announces itself in (value: an :class:`Announcement`).
EXECUTOR_GROUP = "actions-executors"
#: Lease length, seconds: an executor renews its leases every third of it; the queue takes an
#: action back once its lease was not renewed for this long (or its executor left the group).
LEASE_S = 3.0


class QueueUnavailable(BusConnectionError):
    """The action queue cannot be reached now (the queue service or the broker is away);
    the request may be retried once it is back."""


@dataclass(frozen=True, slots=True)
class Submitted:
    """The queue's answer to one submitted action."""

    id: str
    #: An earlier action had the same idempotency key (``id`` is that action's).
    duplicate: bool
    status: ActionStatus


@dataclass(frozen=True, slots=True)
class BacklogRow:
    """Actions of one kind and priority, per state; ``blocked``: queued steps waiting for an
    earlier step of their session (counted in ``queued`` too)."""

    queued: int = 0
    leased: int = 0
    retrying: int = 0
    dead: int = 0
    blocked: int = 0


@dataclass(frozen=True, slots=True)
class Backlog:
    """What the queue holds, for dashboards and autoscalers.

    Attributes:
        rows: Per ``kind/p<priority>``: queued, leased (running), retrying (in their backoff)
            and dead (dead letters).
        totals: How many actions the queue keeps in each status, ended ones included.
        redeliveries: Attempts started on actions that had been started before.
        pruned: Ended actions deleted beyond the queue's bound (Zenoh queue service).
    """

    rows: dict[str, BacklogRow] = field(default_factory=dict)
    totals: dict[str, int] = field(default_factory=dict)
    redeliveries: int = 0
    pruned: int = 0

    def as_dict(self) -> dict[str, Any]:
        """The JSON form (``backlog``, ``stats``, ``redeliveries``, ``pruned``)."""
        return {
            "backlog": {k: _row(r) for k, r in self.rows.items()},
            "stats": dict(self.totals),
            "redeliveries": self.redeliveries,
            "pruned": self.pruned,
        }

    def column_totals(self) -> dict[str, int]:
        """Actions queued, leased (in flight), retrying and dead, over every kind and priority."""
        return {c: sum(getattr(r, c) for r in self.rows.values()) for c in _COLUMNS}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Backlog:
        """The inverse of :meth:`as_dict`."""
        rows = {
            str(k): BacklogRow(**{c: int(v.get(c, 0)) for c in _COLUMNS})
            for k, v in (d.get("backlog") or {}).items()
        }
        totals = {str(k): int(v) for k, v in (d.get("stats") or {}).items()}
        return cls(rows, totals, int(d.get("redeliveries") or 0), int(d.get("pruned") or 0))

    @classmethod
    def count(
        cls,
        actions: Sequence[Action],
        *,
        redeliveries: int,
        pruned: int = 0,
        blocked: Collection[str] = (),
    ) -> Backlog:
        """The backlog of a set of actions (those still waiting, running or dead make rows);
        ``blocked``: ids of queued steps that wait for an earlier step of their session."""
        rows: dict[str, dict[str, int]] = {}
        totals: dict[str, int] = {}
        for a in actions:
            totals[a.status.value] = totals.get(a.status.value, 0) + 1
            state = _STATE_COLUMN.get(a.status)
            if state is None:
                continue
            row = rows.setdefault(f"{a.kind}/p{a.priority}", dict.fromkeys(_COLUMNS, 0))
            row[state] += 1
            if a.id in blocked:
                row["blocked"] += 1
        return cls({k: BacklogRow(**v) for k, v in rows.items()}, totals, redeliveries, pruned)


def _row(r: BacklogRow) -> dict[str, int]:
    return {
        "queued": r.queued,
        "leased": r.leased,
        "retrying": r.retrying,
        "dead": r.dead,
        "blocked": r.blocked,
    }


_COLUMNS = ("queued", "leased", "retrying", "dead", "blocked")
_STATE_COLUMN = {
    ActionStatus.QUEUED: "queued",
    ActionStatus.RUNNING: "leased",
    ActionStatus.RETRYING: "retrying",
    ActionStatus.DEAD: "dead",
}


@dataclass(frozen=True, slots=True)
class ExecutorSpec:
    """What an executor offers the queue.

    Attributes:
        name: Executor name (other executors retry what this one failed).
        session: This process's incarnation of the executor (random): an executor restarted
            under the same name holds none of its predecessor's attempts.
        kinds: Action kinds it runs.
        labels: Labels matched against action selectors.
        concurrency: Handlers it runs at once.
    """

    name: str
    session: str
    kinds: tuple[str, ...]
    labels: Mapping[str, str] = field(default_factory=dict)
    concurrency: int = 1


@dataclass(slots=True)
class Lease:
    """An attempt of an action granted to one executor.

    Attributes:
        action: The action as the attempt started (its last attempt is this one).
        executor: The executor it was granted to.
    """

    action: Action
    executor: str

    @property
    def attempt(self) -> int:
        """The attempt number: also the lease's fencing token (a later attempt has a larger one)."""
        return self.action.attempts[-1].number if self.action.attempts else 0

    @property
    def id(self) -> str:
        """The action's id."""
        return self.action.id


@dataclass(frozen=True, slots=True)
class Report:
    """How a handler ended: ``ok`` with ``result``, or failed with ``reason`` (``permanent``:
    dead-letter at once)."""

    action_id: str
    attempt: int
    ok: bool
    result: Any = None
    reason: str = ""
    permanent: bool = False


@dataclass(frozen=True, slots=True)
class Receipt:
    """The queue's answer to one :class:`Report`.

    Attributes:
        accepted: The outcome was recorded as the attempt's own.
        status: The action's status after it (None when not accepted).
        error: Why it was not accepted (the lease was lost: the outcome was noted in the
            history as a late report where the attempt was closed as lost).
    """

    accepted: bool
    status: ActionStatus | None = None
    error: str = ""


@dataclass(frozen=True, slots=True)
class ReportReply:
    """Receipts in the order of the reports, and leases taken with them."""

    receipts: list[Receipt]
    leases: list[Lease] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Renewal:
    """The queue's answer to a renewal: actions whose cancel was asked for, and leases the
    executor no longer holds (taken back: their attempt was closed)."""

    canceled: frozenset[str] = frozenset()
    lost: frozenset[str] = frozenset()


class Announcement(msgspec.Struct, frozen=True):
    """What an executor announces in :data:`EXECUTOR_GROUP`."""

    kinds: list[str]
    session: str = ""


_ANNOUNCEMENT = msgspec.json.Decoder(Announcement)


def parse_announcement(value: str | bytes) -> Announcement | None:
    """An executor's announcement, or None if it is malformed."""
    try:
        return _ANNOUNCEMENT.decode(value)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def announcement(spec: ExecutorSpec) -> str:
    """The group value announcing ``spec``."""
    return msgspec.json.encode(Announcement(list(spec.kinds), spec.session)).decode()


def executors_with(members: Mapping[str, str], kind: str) -> list[str]:
    """Live executors that run ``kind``, from executor-group members (name → announcement)."""
    out = []
    for member, value in members.items():
        a = parse_announcement(value)
        if a is not None and kind in a.kinds:
            out.append(member)
    return out


class WorkerLink(abc.ABC):
    """One executor's end of the queue. Every method may raise :class:`QueueUnavailable`
    while the queue is away; the executor keeps its handlers running and tries again."""

    spec: ExecutorSpec
    #: Whether a report can bring the next leases in the same round trip (``take``); where it
    #: cannot save one, the executor takes on its own as soon as a slot frees.
    takes_with_reports: bool = False

    @abc.abstractmethod
    async def open(self, on_wake: Callable[[], None], on_pushed: Callable[[list[Lease]], None]) -> None:
        """Join the executor group and listen for work: ``on_wake()`` when actions may be
        ready, ``on_pushed(leases)`` for leases the queue granted unasked (both on the event
        loop)."""

    @abc.abstractmethod
    async def take(self, max_actions: int) -> list[Lease]:
        """Up to ``max_actions`` leases on ready actions, most urgent first (no waiting)."""

    @abc.abstractmethod
    async def renew(self, leases: Sequence[Lease]) -> Renewal:
        """Extend these leases (this executor is alive and still runs them)."""

    @abc.abstractmethod
    async def checkpoint(self, lease: Lease, state: Any) -> None:
        """Save resumable progress of a running attempt (the next attempt receives it)."""

    @abc.abstractmethod
    async def report(self, reports: Sequence[Report], *, take: int = 0) -> ReportReply:
        """Record outcomes; with ``take``, also lease up to that many ready actions."""

    @abc.abstractmethod
    def feedback(self, lease: Lease, data: bytes) -> None:
        """Progress of a running attempt for its planner (JSON bytes; best effort)."""

    @abc.abstractmethod
    def connected(self) -> bool:
        """Whether the queue was seen to be reachable just now (its service's liveness on
        Zenoh, this executor's own heartbeat on Pulsar)."""

    async def retire(self) -> None:
        """Take no more work (the executor is stopping); what it holds stays its own."""
        return None

    @abc.abstractmethod
    async def close(self) -> None:
        """Leave the group and release what the link opened; unreported leases go back."""


class ActionQueue(abc.ABC):
    """The planner's end of the queue, and the maker of executors' links."""

    @abc.abstractmethod
    async def submit(self, actions: Sequence[Action]) -> list[Submitted]:
        """Queue validated actions durably (persisted when this returns)."""

    @abc.abstractmethod
    async def get(self, action_id: str) -> Action | None:
        """The current state of an action."""

    @abc.abstractmethod
    async def ended(self, action_ids: Sequence[str]) -> list[Action]:
        """Those of ``action_ids`` that ended (at most 1000 ids)."""

    @abc.abstractmethod
    async def cancel(self, action_id: str) -> Action | None:
        """Cancel: a waiting action ends at once, a running one is signalled."""

    @abc.abstractmethod
    async def dead_letters(self) -> list[Action]:
        """The dead-letter queue, oldest first, with every attempt's reason."""

    @abc.abstractmethod
    async def requeue(self, action_id: str) -> Action:
        """Give a dead letter a fresh attempt budget.

        Raises:
            ActionError: It is not in the dead-letter queue.
        """

    @abc.abstractmethod
    async def purge_dead(self) -> int:
        """Delete the dead-letter queue; returns how many were removed."""

    @abc.abstractmethod
    async def backlog(self) -> Backlog:
        """Counts per kind, priority and state."""

    @abc.abstractmethod
    async def watch_results(self, on_result: Callable[[Action], None]) -> None:
        """Call ``on_result(action)`` (on the event loop) for every ended action of this queue's
        submits that the backend reports (a planner also asks with :meth:`ended`)."""

    @abc.abstractmethod
    async def watch_feedback(
        self, action_id: str, on_feedback: Callable[[Any], None], on_end: Callable[[], None]
    ) -> Callable[[], None]:
        """Feedback of one action (``on_feedback(parsed JSON)``) until it ends (``on_end()``),
        both on the event loop; returns a function that stops listening."""

    async def set_policy(self, policy: RetryPolicy, kind: str | None = None) -> None:
        """Make ``policy`` the retry policy of ``kind`` (None: of kinds without their own) for
        every executor of this queue, from the next failure on.

        Raises:
            BusConfigError: This backend takes its policies from its configuration (the Zenoh
                queue service: ``QueueService(policy=...)``, ``embodied-bus queue --retry``).
        """
        del policy, kind
        raise BusConfigError(
            "this queue's retry policies are its queue service's configuration "
            "(QueueService(bus, db, policy=RetryPolicies(...)) or embodied-bus queue --max-attempts/--retry)"
        )

    @abc.abstractmethod
    def worker(self, spec: ExecutorSpec) -> WorkerLink:
        """A link for one executor."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release what the queue opened."""


@dataclass(frozen=True, slots=True)
class BackendOptions:
    """Options only one queue backend understands; the others refuse them by name
    (:meth:`QueueOptions.backend_options`)."""


@dataclass(frozen=True, slots=True)
class ZenohQueueOptions(BackendOptions):
    """Options of the Zenoh queue service's clients (also the in-process queue).

    Attributes:
        sealer: Seal every queue message this party sends with its key (a service that trusts
            only known parties answers sealed requests only).
        trust: Believe only queue messages sealed by a key of this allow-list with the role the
            message needs (the queue's replies, results and pushes; executors' feedback).
    """

    sealer: Sealer | None = None
    trust: Trust | None = None


@dataclass(frozen=True, slots=True)
class PulsarQueueOptions(BackendOptions):
    """Options of the Pulsar queue (on Pulsar the broker authenticates each party; queue
    messages are not sealed).

    Attributes:
        prefetch: An executor's actions per priority level fetched ahead of a free slot (None:
            2). More moves short actions faster; a busy executor then holds up to this many + 1
            unstarted actions per level that an idle one cannot take.
    """

    prefetch: int | None = None

    def __post_init__(self) -> None:
        if self.prefetch is not None and self.prefetch < 1:
            raise BusConfigError(f"prefetch must be >= 1 (or None for the default), got {self.prefetch}")


B = TypeVar("B", bound=BackendOptions)


@dataclass(frozen=True, slots=True)
class QueueOptions:
    """What a party hands the action queue it opens.

    Attributes:
        request_timeout_s: How long one request waits for the queue, seconds (every backend).
        backend: Options of one backend (:class:`ZenohQueueOptions`, :class:`PulsarQueueOptions`);
            another backend refuses them.
    """

    request_timeout_s: float = 5.0
    backend: BackendOptions | None = None

    def backend_options(self, kind: type[B], engine: str) -> B:
        """The options of the queue backend of ``engine``, which takes ``kind`` (its defaults
        when none were given).

        Raises:
            BusConfigError: Options of another backend were given.
        """
        if self.backend is None:
            return kind()
        if not isinstance(self.backend, kind):
            raise BusConfigError(
                f"{type(self.backend).__name__} do not apply to the action queue of a {engine} bus "
                f"(it takes {kind.__name__})"
            )
        return self.backend


#: A backend: makes the queue of a bus.
QueueFactory = Callable[["Bus", QueueOptions], ActionQueue]
#: Backends by engine name: ``module:function`` (imported on first use, so an engine's client
#: library is only needed where it is used) or the factory itself.
_BACKENDS: dict[str, str | QueueFactory] = {
    "zenoh": "embodied_bus.actions.remote:open_zenoh_queue",
    "pulsar": "embodied_bus.actions.pulsar:open_pulsar_queue",
}


def register_queue(engine: str, factory: str | QueueFactory) -> None:
    """Make ``factory`` the action queue of buses on ``engine``."""
    _BACKENDS[engine] = factory


def open_queue(bus: Bus, options: QueueOptions | None = None) -> ActionQueue:
    """The action queue of ``bus``'s engine.

    Raises:
        BusConfigError: No backend serves that engine.
    """
    entry = _BACKENDS.get(bus.engine.name)
    if entry is None:
        raise BusConfigError(f"no action queue backend for the {bus.engine.name!r} engine")
    if isinstance(entry, str):
        module, _, name = entry.partition(":")
        entry = _BACKENDS[bus.engine.name] = getattr(importlib.import_module(module), name)
    return entry(bus, options or QueueOptions())
