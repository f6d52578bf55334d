"""An action queue in this process, no transport: the queue service's logic
(:class:`~embodied_bus.actions.core.QueueCore`) called directly, for fast tests of planners,
executors and handlers, and for programs that keep their actions to themselves.

Planners and executors take it instead of a bus::

    queue = MemoryQueue()
    ex = Executor(queue=queue, name="arm")
    planner = Planner(queue=queue)
"""

from __future__ import annotations

import asyncio
import fnmatch
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from embodied_bus.actions.core import QueueCore
from embodied_bus.actions.policy import RetryPolicies, RetryPolicy
from embodied_bus.actions.queue import QueueOptions
from embodied_bus.actions.remote import ServiceQueue
from embodied_bus.actions.store import DEFAULT_KEEP_ENDED, ActionStore
from embodied_bus.engines.base import GroupMembership

__all__ = ["MemoryQueue"]


class _Subscription:
    def __init__(self, hub: _Hub, pattern: str, callback: Callable[[str, bytes], None]) -> None:
        self.hub, self.pattern, self.callback = hub, pattern, callback

    def undeclare(self) -> None:
        with self.hub.lock:
            if self in self.hub.subs:
                self.hub.subs.remove(self)


class _Hub:
    """Topics within the process: a message goes to every matching subscription, each called
    on the thread that sent it (as an engine calls back from its own threads)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.subs: list[_Subscription] = []

    def listen(self, pattern: str, callback: Callable[[str, bytes], None]) -> _Subscription:
        sub = _Subscription(self, pattern, callback)
        with self.lock:
            self.subs.append(sub)
        return sub

    def send(self, topic: str, payload: bytes) -> None:
        with self.lock:
            subs = [s for s in self.subs if fnmatch.fnmatchcase(topic, s.pattern)]
        for s in subs:
            s.callback(topic, payload)


class _Events:
    def __init__(self, hub: _Hub) -> None:
        self.hub = hub

    def result(self, action_id: str, payload: bytes) -> None:
        self.hub.send(f"actions/result/{action_id}", payload)

    def wake(self, kind: str) -> None:
        self.hub.send(f"actions/wake/{kind}", b"")

    def push(self, executor: str, payload: bytes) -> None:
        self.hub.send(f"actions/assign/{executor}", payload)


class _Member(GroupMembership):
    """An executor in the in-process group (or the queue's own, always present)."""

    def __init__(self, core: QueueCore | None, member: str = "", value: str = "") -> None:
        self._core, self._member, self._value = core, member, value

    def members(self) -> dict[str, str]:
        return {"queue": "serving"} if self._core is None else {self._member: self._value}

    async def announce(self, member: str, value: str) -> None:
        self._member, self._value = member, value
        if self._core is not None:
            self._core.executor_changed(member, value, True)

    async def leave(self) -> None:
        if self._core is not None and self._member:
            self._core.executor_changed(self._member, self._value, False)
            self._member = ""


class _LocalTransport:
    def __init__(self, core: QueueCore, hub: _Hub) -> None:
        self.core, self.hub = core, hub

    async def request(
        self, payload: bytes, timeout_s: float, accept: Callable[[bytes], bool] | None = None
    ) -> bytes | None:
        del timeout_s
        await asyncio.sleep(0)  # a request is a suspension point, as on a wire
        answer = self.core.handle_bytes(payload)
        return answer if accept is None or accept(answer) else None

    def listen(self, topic: str, callback: Callable[[str, bytes], None]) -> Any:
        return self.hub.listen(topic, callback)

    def notify(self, topic: str, payload: bytes) -> None:
        self.hub.send(topic, payload)

    async def join(self, member: str, value: str) -> GroupMembership:
        group = _Member(self.core)
        await group.announce(member, value)
        return group

    async def watch_service(self) -> GroupMembership:
        return _Member(None)


class MemoryQueue(ServiceQueue):
    """A queue service's logic in this process.

    Args:
        policy: Retry policy (one for every kind, or per kind).
        path: SQLite file, or ``:memory:`` (nothing on disk).
        keep_ended: Ended actions kept (see :class:`~embodied_bus.actions.store.ActionStore`).
    """

    def __init__(
        self,
        policy: RetryPolicy | RetryPolicies | None = None,
        *,
        path: str | Path = ":memory:",
        keep_ended: int = DEFAULT_KEEP_ENDED,
    ) -> None:
        hub = _Hub()
        self.core = QueueCore(ActionStore(path, policy, keep_ended=keep_ended), _Events(hub))
        super().__init__(_LocalTransport(self.core, hub), QueueOptions())

    async def set_policy(self, policy: RetryPolicy, kind: str | None = None) -> None:
        self.core.store.policies = self.core.store.policies.with_policy(policy, kind)

    def sweep(self) -> None:
        """Take back leases that were not renewed in time and expire deadlines (a queue
        service does this every fraction of a second; call it where a test needs it)."""
        self.core.sweep()
