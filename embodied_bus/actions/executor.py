"""Executor API: handlers per kind, a concurrency limit, leases extended while a handler runs,
feedback, checkpoints (a retry resumes from the last one), cancel signal, graceful shutdown."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from embodied_bus.actions.model import Action, ActionError, action_from_dict, executors_with
from embodied_bus.actions.policy import DEFAULT_RETRY, PermanentFailure, RetryPolicy
from embodied_bus.actions.service import EXECUTOR_GROUP, SERVICE
from embodied_bus.bus import Bus
from embodied_bus.engines._blocking import resolve_none
from embodied_bus.errors import BusClosedError, BusConnectionError
from embodied_bus.security.signing import ActionRejected, Verifier

if TYPE_CHECKING:  # pulsar-client is optional: imported when a Pulsar bus is used
    from embodied_bus.actions.pulsar_queue import PulsarActionQueue

__all__ = ["ActionContext", "Executor", "Handler"]

_log = logging.getLogger("embodied_bus.actions")
#: Lease length, seconds; extended every third of it while a handler runs.
LEASE_S = 3.0
#: How long a stopping executor waits for the queue service to stop pushing to it, seconds.
RETIRE_TIMEOUT_S = 0.5
#: An idle executor looks for work at least this often, seconds (a wake-up comes sooner).
IDLE_LOOK_S = 0.5


class ActionContext:
    """What a handler gets besides the action."""

    def __init__(self, executor: Executor, action: Action) -> None:
        self._executor = executor
        self.action = action
        #: 1 for the first try.
        self.attempt = action.attempt_count
        #: The last checkpoint of an earlier attempt (None on a fresh start).
        self.previous_checkpoint = action.checkpoint
        #: Set when the planner cancels the action.
        self.cancelled = asyncio.Event()

    def feedback(self, data: Any) -> None:
        """Send progress to the planner (JSON-compatible; best effort, never blocks)."""
        payload = json.dumps(data).encode()
        link = self._executor._pulsar
        if link is None:
            self._executor.bus.engine.notify(f"actions/fb/{self.action.id}", payload)
            return
        task = asyncio.ensure_future(link.feedback(self.action.id, payload))
        self._executor._background.add(task)
        task.add_done_callback(self._executor._background.discard)

    async def checkpoint(self, state: Any) -> None:
        """Save resumable progress durably; a retry elsewhere starts from it."""
        await self._executor._call(
            {"op": "checkpoint", "id": self.action.id, "executor": self._executor.name, "state": state}
        )


#: A handler: ``async def handler(action, ctx) -> result`` (a plain function that returns its
#: result also works, but blocks the event loop while it runs: a warning says so).
Handler = Callable[[Action, ActionContext], Awaitable[Any] | Any]


class Executor:
    """Runs handlers for the actions of the kinds it registered.

    Args:
        bus: The bus with a queue service.
        name: Executor id (default random); other executors retry what this one failed.
        concurrency: Handlers running at once.
        prefetch: Pulsar only: actions per priority level the client fetches ahead of a free
            slot (its ``receiver_queue_size``; None: ``pulsar_queue.RECEIVER_QUEUE_SIZE``, 2).
            A busy executor holds at most this many + 1 unstarted actions per level, which an
            idle executor cannot take meanwhile; more prefetch moves short actions faster (8
            instead of 2: about 1.9 times the actions/s with a no-op handler, see the README).
            On Zenoh the queue service hands an executor only as many actions as it has free
            slots, so there is nothing to prefetch and this is ignored.
        labels: Labels matched against action selectors.
        verifier: Accept only actions signed by a key the allow-list permits for their kind;
            anything else is dead-lettered with the reason before a handler sees it (None: run
            unsigned actions too).
        policy: Retry policy on Pulsar, where executors apply it (on Zenoh the queue
            service's policy applies).
    """

    def __init__(
        self,
        bus: Bus,
        name: str | None = None,
        *,
        concurrency: int = 1,
        prefetch: int | None = None,
        labels: dict[str, str] | None = None,
        verifier: Verifier | None = None,
        policy: RetryPolicy = DEFAULT_RETRY,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"executor concurrency must be >= 1, got {concurrency}")
        if prefetch is not None and prefetch < 1:
            raise ValueError(f"executor prefetch must be >= 1 (or None for the default), got {prefetch}")
        self.verifier = verifier
        self._pulsar: PulsarActionQueue | None = None
        self._background: set[asyncio.Future[None]] = set()
        self._sync_kinds: set[str] = set()  # kinds whose handler turned out not to be async
        self._acks: list[tuple[dict[str, Any], Callable[[str | None], None]]] = []
        if bus.engine.name == "pulsar":
            from embodied_bus.actions.pulsar_queue import PulsarActionQueue

            self._pulsar = PulsarActionQueue(bus.engine, policy, prefetch=prefetch)  # type: ignore[arg-type]
        #: Outcomes the queue did not accept (lease lost or service unreachable).
        self.unreported = 0
        self.bus = bus
        self.name = name or f"ex-{uuid.uuid4().hex[:8]}"
        self.concurrency = concurrency
        self.labels = labels or {}
        self.handlers: dict[str, Handler] = {}
        self._wake = asyncio.Event()
        self.completed = 0
        self.failed = 0
        #: Actions the queue service pushed to this executor while it was idle (Zenoh).
        self.pushed = 0
        #: Actions leased in the answer to an ack (Zenoh): no separate lease round trip.
        self.leased_with_ack = 0
        # the fields of this executor's lease request while it takes work (Zenoh), else None
        self._lease_fields: dict[str, Any] | None = None
        self._idle_known = False  # the last ack's lease found the queue empty
        self._running: set[asyncio.Task[None]] = set()
        self._reports: set[asyncio.Future[None]] = set()  # ack requests under way
        self._contexts: dict[str, ActionContext] = {}  # running actions (Pulsar)
        self._wake_fut: asyncio.Future[None] | None = None  # what _await_work waits on
        self._wake_posted = False  # a wake-up is on its way to the loop

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

    def _ran_synchronously(self, kind: str) -> None:
        """A handler returned its result instead of an awaitable: it is a plain function. Its
        result counts; it is said once per kind that it blocked the event loop meanwhile."""
        if kind not in self._sync_kinds:
            self._sync_kinds.add(kind)
            _log.warning(
                "%s: the handler for %r is not async: it ran on the event loop and blocked it "
                "(lease extensions, feedback and other actions waited); make it `async def` and "
                "run blocking work with `await asyncio.to_thread(...)`",
                self.name,
                kind,
            )

    async def _call(self, req: dict[str, Any], timeout_s: float = 5.0) -> dict[str, Any]:
        if self._pulsar is not None:
            try:
                out: dict[str, Any] = await self._pulsar.call(req)
            except BusConnectionError as err:
                raise ConnectionError(str(err)) from err
            except (ActionError, KeyError) as err:
                raise RuntimeError(str(err)) from err
            return out
        raw = await self.bus.engine.request(SERVICE, json.dumps(req).encode(), timeout_s)
        if raw is None:
            raise ConnectionError("no action queue service answered")
        reply: dict[str, Any] = json.loads(raw)
        if not reply.get("ok"):
            raise RuntimeError(str(reply.get("error")))
        return reply

    async def _report(self, req: dict[str, Any]) -> bool:
        """Send an outcome (ack / nack); if the queue refuses it (the lease was lost, the service
        is unreachable) log it and go on: the queue redelivers the action, at least once."""
        try:
            if req["op"] == "ack":
                await self._ack_batched(req)
            else:
                await self._call(req)
        except (ConnectionError, RuntimeError, BusClosedError) as err:
            self.unreported += 1
            _log.warning("%s of action %s not recorded: %s", req["op"], req["id"], err)
            return False
        return True

    def _acked(self, action: Action, error: str | None) -> None:
        """The queue's answer to a posted ack (Pulsar)."""
        if error is not None:
            self.unreported += 1
            _log.warning("ack of action %s not recorded: %s", action.id, error)
        elif self.verifier is not None:
            self.verifier.completed(action)

    async def _ack_batched(self, req: dict[str, Any]) -> None:
        """Send an ack with the others of this loop turn and wait for its answer."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def answered(error: str | None) -> None:
            if fut.done():
                return
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(RuntimeError(error))

        self._queue_ack(req, answered)
        await fut

    def _queue_ack(self, req: dict[str, Any], answered: Callable[[str | None], None]) -> None:
        """Acks that finish in the same loop turn travel in one ``ack_many`` request (each gets
        its own answer, passed to ``answered``: None or the error): fewer round trips when many
        short actions end together. A stopping executor waits for the request."""
        self._acks.append((req, answered))
        if len(self._acks) == 1:  # its first step runs after this turn, with what gathered
            flush = asyncio.ensure_future(self._flush_acks())
            self._reports.add(flush)
            flush.add_done_callback(self._reports.discard)

    async def _flush_acks(self) -> None:
        batch, self._acks = self._acks, []
        if not batch:
            return
        # Under a backlog the slots these acks free are filled from the answer (the service
        # leases as for a lease request): one round trip per batch instead of two.
        extra: dict[str, Any] = {}
        if self._lease_fields is not None:
            free = self.concurrency - len(self._running) + len(batch)
            if free > 0:
                extra["lease"] = {**self._lease_fields, "max": min(free, 256)}
        try:
            if len(batch) == 1:
                reply = await self._call({**batch[0][0], **extra})
                answers: list[dict[str, Any]] = [{"ok": True}]
            else:
                reply = await self._call({"op": "ack_many", "acks": [r for r, _ in batch], **extra})
                answers = reply["answers"]
        except (ConnectionError, RuntimeError, BusClosedError) as err:  # every waiter is answered
            for _, answered in batch:
                answered(str(err))
            return
        if "lease" in extra:
            # fewer than asked: the queue is empty and the service has us down as idle (it
            # pushes what comes next), so the run loop need not ask again
            self._idle_known = len(reply.get("actions") or ()) < extra["lease"]["max"]
        self.leased_with_ack += self._start_many(reply.get("actions") or (), "leased with an ack")
        for (_, answered), answer in zip(batch, answers, strict=True):
            answered(None if answer.get("ok") else str(answer.get("error")))

    async def _run_one(self, action: Action) -> None:
        if self.verifier is not None:
            try:
                self.verifier.verify(action)
            except ActionRejected as err:
                _log.warning("rejected action %s (%s): %s", action.id, action.kind, err)
                self.failed += 1
                await self._report(
                    {
                        "op": "nack",
                        "id": action.id,
                        "executor": self.name,
                        "reason": f"rejected by {self.name}: {err}",
                        "permanent": True,
                    }
                )
                return
        ctx = ActionContext(self, action)

        async def keep_lease() -> None:
            while True:
                try:
                    r = await self._call(
                        {"op": "extend", "id": action.id, "executor": self.name, "lease_s": LEASE_S}
                    )
                except (ConnectionError, RuntimeError, BusClosedError) as err:
                    _log.warning("lease on %s lost: %s", action.id, err)
                    return
                if r.get("cancel_requested"):
                    ctx.cancelled.set()
                await asyncio.sleep(LEASE_S / 3)

        # Zenoh: most actions end before their first extension is due: a timer, not a task, until
        # then. Pulsar holds the message while the consumer lives: one watcher per executor
        # looks for cancels of what runs (_watch_cancels).
        extender: list[asyncio.Task[None]] = []
        loop = asyncio.get_running_loop()
        timer = None
        if self._pulsar is None:
            timer = loop.call_later(LEASE_S / 3, lambda: extender.append(loop.create_task(keep_lease())))
        else:
            self._contexts[action.id] = ctx
        try:
            result = self.handlers[action.kind](action, ctx)
            if inspect.isawaitable(result):
                result = await result
            else:
                self._ran_synchronously(action.kind)
        except PermanentFailure as err:
            self.failed += 1
            await self._report(
                {
                    "op": "nack",
                    "id": action.id,
                    "executor": self.name,
                    "reason": str(err) or "rejected",
                    "permanent": True,
                }
            )
        except Exception as err:
            self.failed += 1
            await self._report(
                {
                    "op": "nack",
                    "id": action.id,
                    "executor": self.name,
                    "reason": f"{type(err).__name__}: {err}",
                }
            )
        else:
            self.completed += 1
            ack = {"op": "ack", "id": action.id, "executor": self.name, "result": result}
            if self._pulsar is None:  # the slot stays taken: the service fills it from the ack
                if await self._report(ack) and self.verifier is not None:
                    self.verifier.completed(action)
            else:
                # answered after the slot is freed: the next action need not wait for Pulsar to
                # persist this one's outcome (a stopping executor waits for the answers)
                self._queue_ack(ack, partial(self._acked, action))
        finally:
            if timer is not None:
                timer.cancel()
            for task in extender:
                task.cancel()
            self._contexts.pop(action.id, None)

    async def _watch_cancels(self) -> None:
        """Pulsar: signal the handlers whose actions were canceled (every third of
        :data:`LEASE_S`, as the lease extensions on Zenoh)."""
        pulsar = self._pulsar
        assert pulsar is not None
        while True:
            await asyncio.sleep(LEASE_S / 3)
            for action_id, ctx in list(self._contexts.items()):
                if pulsar.state.cancel_requested(action_id):
                    ctx.cancelled.set()

    def _start(self, env: dict[str, Any]) -> None:
        self._track(asyncio.create_task(self._run_one(action_from_dict(env, check_payload=False))))

    def _track(self, task: asyncio.Task[None]) -> None:
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _begin_and_run(self, item: tuple[Any, Any, float], kinds: list[str]) -> None:
        """Pulsar: record the attempt of a taken message, then run it."""
        assert self._pulsar is not None
        try:
            action = await self._pulsar.begin(item, self.name, set(kinds), self.labels)
        except BusConnectionError as err:
            _log.warning("%s could not start an action (handed back): %s", self.name, err)
            return
        if action is not None:
            await self._run_one(action)

    def _accept_pushed(self, payload: bytes) -> None:
        """Actions the queue service leased to this idle executor on submit (loop thread). A
        malformed one is logged and left to its lease expiry (then retried elsewhere)."""
        try:
            envs = json.loads(payload)
            if not isinstance(envs, list):
                raise TypeError(f"expected a list of actions, got {type(envs).__name__}")
        except (ValueError, TypeError) as err:
            _log.warning("bad push to %s: %s", self.name, err)
            return
        self.pushed += self._start_many(envs, "pushed")

    def _start_many(self, envs: Any, how: str) -> int:
        """Start every well-formed action of ``envs``; a malformed one is logged and left to
        its lease expiry (then retried elsewhere). Returns how many started."""
        started = 0
        for env in envs:
            try:
                self._start(env)
            except ActionError as err:
                _log.warning("bad action %s to %s: %s", how, self.name, err)
            else:
                started += 1
        return started

    def _woken(self) -> None:
        """Work may be waiting (loop thread)."""
        self._wake_posted = False  # first: a wake-up posted from now on is posted again
        self._wake.set()
        fut = self._wake_fut
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def _await_work(self, stop: asyncio.Event) -> None:
        """Wait for a wake-up, ``stop`` or :data:`IDLE_LOOK_S`, whichever comes first (one
        future, no tasks: an idle executor on a busy queue waits once per action)."""
        if self._wake.is_set() or stop.is_set():
            return
        loop = asyncio.get_running_loop()
        fut = self._wake_fut = loop.create_future()
        timer = loop.call_later(IDLE_LOOK_S, resolve_none, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self._wake_fut = None

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
                was running go back to the queue (redelivered to another executor).
        """
        kinds = sorted(self.handlers)
        loop = asyncio.get_running_loop()

        def woken(_topic: str, _payload: bytes) -> None:  # engine thread
            if not self._wake_posted:  # one wake-up per burst of received work
                self._wake_posted = True
                try:
                    loop.call_soon_threadsafe(self._woken)
                except RuntimeError:  # the loop is closed
                    pass

        def pushed(_topic: str, payload: bytes) -> None:
            loop.call_soon_threadsafe(self._accept_pushed, payload)

        group = await self.bus.engine.watch_group(EXECUTOR_GROUP, lambda *_: None)
        if self._pulsar is not None:
            subs = []
            self._pulsar.live_executors = lambda kind: executors_with(group.members(), kind)
            await self._pulsar.listen_wake(lambda: woken("", b""), kinds)
        else:
            subs = [self.bus.engine.listen(f"actions/wake/{k}", woken) for k in kinds]
            subs.append(self.bus.engine.listen(f"actions/assign/{self.name}", pushed))
        await group.announce(self.name, json.dumps({"kinds": kinds}))
        stopping = asyncio.ensure_future(stop.wait())  # wakes an idle wait at once
        stopping.add_done_callback(lambda _: self._woken())
        watcher = asyncio.ensure_future(self._watch_cancels()) if self._pulsar is not None else None
        running = self._running
        if self._pulsar is None:
            self._lease_fields = {
                "executor": self.name,
                "kinds": kinds,
                "labels": self.labels,
                "lease_s": LEASE_S,
                "push": True,
            }
        try:
            while not stop.is_set():
                if self.bus.closed:  # the program closed the bus first: no more work, no acks
                    raise self._closed_under()
                if len(running) >= self.concurrency:
                    await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                    continue
                if self._idle_known:  # registered idle by an ack: wait for a push or a wake
                    self._idle_known = False
                    await self._await_work(stop)
                    continue
                self._wake.clear()
                if self._pulsar is not None:
                    # received messages start concurrently: recording one attempt (a state-log
                    # write) does not hold up taking the next
                    taken = self._pulsar.take(self.concurrency - len(running))
                    if not taken:
                        await self._await_work(stop)
                    for item in taken:
                        self._track(asyncio.create_task(self._begin_and_run(item, kinds)))
                    continue
                reply = await self._call(
                    {
                        "op": "lease",
                        "executor": self.name,
                        "kinds": kinds,
                        "labels": self.labels,
                        "lease_s": LEASE_S,
                        "max": self.concurrency - len(running),
                        "push": self._pulsar is None,
                    }
                )
                leased = reply.get("actions") or ([reply["action"]] if reply.get("action") else [])
                if not leased:
                    await self._await_work(stop)
                    continue
                for env in leased:
                    self._start(env)
            self._lease_fields = None  # acks stop asking for more
            if self._pulsar is None:
                try:  # no more pushes; one racing with this still runs below
                    await self._call({"op": "retire", "executor": self.name}, RETIRE_TIMEOUT_S)
                except (ConnectionError, RuntimeError, BusClosedError) as err:  # e.g. the service stopped
                    _log.debug("%s could not retire from the queue service: %s", self.name, err)
            while running or self._reports:
                await asyncio.wait(set(running) | self._reports)
        except BusClosedError as err:  # a call on the bus found it closed
            if self.bus.closed:
                raise self._closed_under() from err
            raise
        finally:
            stopping.cancel()
            if watcher is not None:
                watcher.cancel()
            self._lease_fields = None
            for s in subs:
                s.undeclare()
            await group.leave()
            if self._pulsar is not None:
                await self._pulsar.close()  # prefetched actions go back to the others
