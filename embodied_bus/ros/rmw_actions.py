"""ROS 2 actions over rmw_zenoh, no rclpy: queue actions executed by ROS 2 action servers, and
queue kinds offered to ROS 2 action clients as action servers.

An action ``/a`` of type ``pkg/action/A`` is three services (``/a/_action/send_goal``,
``get_result``, ``cancel_goal``) and two topics (``/a/_action/feedback``, ``status``), keyed by
the hashes :class:`~embodied_bus.rosmsg.interfaces.Interfaces` computes from ``A.action``.

Queue → ROS (:func:`route_handler`): the JSON payload fills the goal; feedback goes to
``ctx.feedback``; SUCCEEDED acks with the result; ABORTED nacks (the queue retries, on another
executor where one exists); a rejected goal or a payload that does not fit dead-letters; a
queue cancel, a deadline or the route's timeout cancels the goal; a server that does not answer
or is lost nacks.

ROS → queue (:class:`QueueActionServer`): each accepted goal is submitted as a queue action of
the offered kind (the goal id is its idempotency key); queue feedback is published as action
feedback; the result maps back as SUCCEEDED (result), ABORTED (dead-lettered) or CANCELED.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import zenoh

from embodied_bus.actions.client import ActionHandle, Planner
from embodied_bus.actions.context import ActionContext
from embodied_bus.actions.model import Action, ActionStatus
from embodied_bus.actions.policy import PermanentFailure
from embodied_bus.ros.bridge_core import GoalOutcome, goal_outcome
from embodied_bus.ros.config import ActionRoute
from embodied_bus.ros.rmw_node import RmwNode, ServiceUnavailable, reply
from embodied_bus.rosmsg.interfaces import (
    CANCEL_GOAL,
    GOAL_STATUS_ARRAY,
    ActionTypes,
    InterfaceError,
    to_plain,
)
from embodied_bus.rosmsg.rmw_zenoh import ADMIN_SPACE, DEFAULT_QOS, RmwZenohError, mangle

__all__ = ["GoalRejected", "GoalResult", "QueueActionServer", "RosActionClient", "RosGoal", "route_handler"]

_log = logging.getLogger("embodied_bus.ros")
#: How long to wait for an action server to answer a goal or a cancel, seconds.
SERVER_WAIT_S = 5.0
_SUCCEEDED, _CANCELED, _ABORTED, _ACCEPTED, _EXECUTING, _UNKNOWN = 4, 5, 6, 1, 2, 0
_CANCEL_OK, _CANCEL_UNKNOWN, _CANCEL_TERMINATED = 0, 2, 3


class GoalRejected(RmwZenohError):
    """The action server rejected the goal."""


@dataclass(frozen=True, slots=True)
class GoalResult:
    """How a goal ended: its ``action_msgs/GoalStatus`` value and its result as plain values."""

    status: int
    result: Any


def _time(stamp_ns: int) -> dict[str, int]:
    return {"sec": stamp_ns // 1_000_000_000, "nanosec": stamp_ns % 1_000_000_000}


class RosActionClient:
    """A client of one ROS 2 action server (see the module docstring)."""

    def __init__(self, node: RmwNode, action: str, types: ActionTypes) -> None:
        self.node = node
        self.action = action
        self.types = types
        self._loop = asyncio.get_running_loop()
        base = f"{action}/_action/"
        self._send = node.client(base + "send_goal", types.send_goal.name, types.send_goal.hash)
        self._result = node.client(base + "get_result", types.get_result.name, types.get_result.hash)
        cancel = node.interfaces.service(CANCEL_GOAL)
        self._cancel = node.client(base + "cancel_goal", CANCEL_GOAL, cancel.hash, any_hash=True)
        self._feedback: dict[bytes, Callable[[Any], None]] = {}
        self._ended: dict[bytes, asyncio.Event] = {}
        self._servers: set[str] = set()
        self._server_gone = asyncio.Event()
        node.subscribe(base + "feedback", types.feedback_message, DEFAULT_QOS, self._on_feedback)
        node.subscribe(base + "status", GOAL_STATUS_ARRAY, DEFAULT_QOS, self._on_status)
        servers = f"{ADMIN_SPACE}/{node.link.domain_id}/*/*/*/SS/*/*/*/{mangle(base + 'send_goal')}/**"
        node.keep(node.session.liveliness().declare_subscriber(servers, self._on_server, history=True))

    def _on_server(self, sample: zenoh.Sample) -> None:
        alive = sample.kind == zenoh.SampleKind.PUT
        self._loop.call_soon_threadsafe(self._server_seen, str(sample.key_expr), alive)

    def _server_seen(self, key: str, alive: bool) -> None:
        if alive:
            self._servers.add(key)
            self._server_gone.clear()
        else:
            self._servers.discard(key)
            if not self._servers:
                self._server_gone.set()

    def _on_status(self, sample: zenoh.Sample) -> None:
        try:
            msg = self.node.interfaces.deserialize(GOAL_STATUS_ARRAY, sample.payload.to_bytes())
        except InterfaceError as err:
            _log.warning("%s: dropped a status message: %s", self.action, err)
            return
        ended = [bytes(s.goal_info.goal_id.uuid) for s in msg.status_list if int(s.status) >= _SUCCEEDED]
        if ended:
            self._loop.call_soon_threadsafe(self._goals_ended, ended)

    def _goals_ended(self, goal_ids: list[bytes]) -> None:
        for goal_id in goal_ids:
            event = self._ended.get(goal_id)
            if event is not None:
                event.set()

    def _on_feedback(self, sample: zenoh.Sample) -> None:
        try:
            msg = self.node.interfaces.deserialize(self.types.feedback_message, sample.payload.to_bytes())
        except InterfaceError as err:
            _log.warning("%s: dropped feedback: %s", self.action, err)
            return
        callback = self._feedback.get(bytes(msg.goal_id.uuid))
        if callback is not None:
            self._loop.call_soon_threadsafe(callback, to_plain(msg.feedback))

    async def send_goal(
        self, goal: Mapping[str, Any], *, on_feedback: Callable[[Any], None], timeout_s: float = SERVER_WAIT_S
    ) -> RosGoal:
        """Send a goal; its handle once accepted.

        Raises:
            InterfaceError: ``goal`` does not fit the goal type.
            ServiceUnavailable: No server answered within ``timeout_s``.
            GoalRejected: The server rejected it.
        """
        goal_id = os.urandom(16)
        request = self.node.interfaces.serialize(
            self.types.send_goal.request, {"goal_id": {"uuid": list(goal_id)}, "goal": dict(goal)}
        )
        self._feedback[goal_id] = on_feedback
        self._ended[goal_id] = asyncio.Event()
        try:
            raw = await self._send.call(request, timeout_s)
            response = self.node.interfaces.deserialize(self.types.send_goal.response, raw)
            if not response.accepted:
                raise GoalRejected(f"{self.action} rejected the goal")
        except BaseException:
            self._forget(goal_id)
            raise
        return RosGoal(self, goal_id)

    def _forget(self, goal_id: bytes) -> None:
        self._feedback.pop(goal_id, None)
        self._ended.pop(goal_id, None)


@dataclass
class RosGoal:
    """An accepted goal of a :class:`RosActionClient`."""

    client: RosActionClient
    goal_id: bytes

    async def result(self, timeout_s: float) -> GoalResult:
        """Wait for the goal to end, then fetch its result.

        The result is requested once the status topic says the goal ended (some servers
        answer nothing else while a result request waits), so a cancel always gets through.

        Raises:
            ServiceUnavailable: No end within ``timeout_s``, or every server of the action went
                away (its liveliness tokens were withdrawn).
        """
        c = self.client
        ended = c._ended.get(self.goal_id) or asyncio.Event()
        waits = {asyncio.ensure_future(ended.wait()), asyncio.ensure_future(c._server_gone.wait())}
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if not ended.is_set():
            why = "lost the server" if c._server_gone.is_set() else f"no result within {timeout_s:g} s"
            raise ServiceUnavailable(f"{c.action}: {why}")
        request = c.node.interfaces.serialize(
            c.types.get_result.request, {"goal_id": {"uuid": list(self.goal_id)}}
        )
        try:
            raw = await c._result.call(request, SERVER_WAIT_S)
        finally:
            c._forget(self.goal_id)
        response = c.node.interfaces.deserialize(c.types.get_result.response, raw)
        return GoalResult(int(response.status), to_plain(response.result))

    async def cancel(self, timeout_s: float = SERVER_WAIT_S) -> int:
        """Ask the server to cancel the goal; its ``CancelGoal`` return code."""
        c = self.client
        request = c.node.interfaces.serialize(
            CANCEL_GOAL + "_Request", {"goal_info": {"goal_id": {"uuid": list(self.goal_id)}}}
        )
        raw = await c._cancel.call(request, timeout_s)
        return int(c.node.interfaces.deserialize(CANCEL_GOAL + "_Response", raw).return_code)


Handler = Callable[[Action, ActionContext], Awaitable[Any]]


def route_handler(client: RosActionClient, route: ActionRoute) -> Handler:
    """An executor handler that runs queue actions of ``route.kind`` on the ROS 2 server."""

    async def handle(action: Action, ctx: ActionContext) -> Any:
        payload = action.payload if action.payload is not None else {}
        try:
            client.node.interfaces.build(client.types.goal, payload)
        except InterfaceError as err:
            raise PermanentFailure(f"payload does not fit the {route.action_type} goal: {err}") from err
        try:
            goal = await client.send_goal(payload, on_feedback=ctx.feedback)
        except ServiceUnavailable as err:
            raise RuntimeError(f"action server {route.action} is not available: {err}") from err
        except GoalRejected as err:
            raise PermanentFailure(str(err)) from err
        return await _await_goal(goal, route, ctx)

    return handle


async def _await_goal(goal: RosGoal, route: ActionRoute, ctx: ActionContext) -> Any:
    result = asyncio.ensure_future(goal.result(route.timeout_s))
    cancelled = asyncio.ensure_future(ctx.cancelled.wait())
    try:
        done, _ = await asyncio.wait({result, cancelled}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # a deadline or the executor stopping: the goal stops too
        result.cancel()
        await asyncio.shield(_cancel_quietly(goal))
        raise
    finally:
        cancelled.cancel()
    if result not in done:
        result.cancel()
        await _cancel_quietly(goal)
        raise RuntimeError(f"{route.action}: canceled by the queue")
    try:
        end = result.result()
    except ServiceUnavailable as err:
        await _cancel_quietly(goal)
        raise RuntimeError(str(err)) from err
    outcome = goal_outcome(end.status)
    if outcome is GoalOutcome.OK:
        return end.result
    raise RuntimeError(f"{route.action} ended with goal status {end.status} ({outcome.value})")


async def _cancel_quietly(goal: RosGoal) -> None:
    """Cancel the goal on its server; a server that cannot be reached is logged."""
    try:
        code = await goal.cancel()
    except (RmwZenohError, InterfaceError) as err:
        _log.warning("%s: goal %s not canceled: %s", goal.client.action, goal.goal_id.hex(), err)
        return
    if code != _CANCEL_OK:
        _log.info("%s: cancel of goal %s answered %d", goal.client.action, goal.goal_id.hex(), code)


@dataclass
class _Goal:
    goal_id: bytes
    handle: ActionHandle
    accepted_ns: int
    status: int = _ACCEPTED
    final: Action | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)


class QueueActionServer:
    """Offers the queue kind ``offer.kind`` to ROS 2 as the action server ``offer.action``.

    Args:
        node: The ROS node that serves it.
        offer: Kind, action name and action type.
        planner: Submits, watches and cancels the queue actions.
    """

    #: Ended goals kept for late ``get_result`` requests.
    KEEP_ENDED = 256

    def __init__(self, node: RmwNode, offer: ActionRoute, planner: Planner) -> None:
        self.node = node
        self.offer = offer
        self.planner = planner
        self.types = node.interfaces.action(offer.action_type)
        self._loop = asyncio.get_running_loop()
        self._goals: dict[bytes, _Goal] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        types, base = self.types, f"{offer.action}/_action/"
        cancel = node.interfaces.service(CANCEL_GOAL)
        self._feedback = node.publisher(base + "feedback", types.feedback_message)
        self._status = node.publisher(base + "status", GOAL_STATUS_ARRAY)
        node.serve(
            base + "send_goal", types.send_goal.name, types.send_goal.hash, self._query(self._send_goal)
        )
        node.serve(
            base + "get_result", types.get_result.name, types.get_result.hash, self._query(self._get_result)
        )
        node.serve(base + "cancel_goal", CANCEL_GOAL, cancel.hash, self._query(self._cancel), any_hash=True)

    def _query(self, serve: Callable[[zenoh.Query], Awaitable[None]]) -> Callable[[zenoh.Query], None]:
        def on_query(query: zenoh.Query) -> None:
            self._loop.call_soon_threadsafe(self._spawn, serve(query))

        return on_query

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _request(self, query: zenoh.Query, ros_type: str) -> Any:
        return self.node.interfaces.deserialize(ros_type, query.payload.to_bytes() if query.payload else b"")

    async def _send_goal(self, query: zenoh.Query) -> None:
        interfaces, types = self.node.interfaces, self.types
        accepted = False
        try:
            req = self._request(query, types.send_goal.request)
            goal_id = bytes(req.goal_id.uuid)
            if goal_id in self._goals:
                accepted = True  # a repeated request: the goal is already in the queue
            else:
                handle = await self.planner.submit(
                    self.offer.kind, to_plain(req.goal), idempotency_key=f"ros2-goal-{goal_id.hex()}"
                )
                self._goals[goal_id] = _Goal(goal_id, handle, time.time_ns())
                self._spawn(self._follow(self._goals[goal_id]))
                accepted = True
        except Exception as err:  # answered (rejected), never fatal
            _log.warning("%s: goal rejected: %s", self.offer.action, err)
        stamp = _time(time.time_ns())
        reply(query, interfaces.serialize(types.send_goal.response, {"accepted": accepted, "stamp": stamp}))
        self._publish_status()

    async def _follow(self, goal: _Goal) -> None:
        """Queue feedback → action feedback until the action ends; then its status."""
        feed = asyncio.ensure_future(self._forward_feedback(goal))
        try:
            goal.final = await goal.handle.result()
        except Exception as err:
            _log.warning("%s: lost track of goal %s: %s", self.offer.action, goal.goal_id.hex(), err)
        finally:
            feed.cancel()
        final = goal.final
        goal.status = (
            _SUCCEEDED
            if final is not None and final.status is ActionStatus.SUCCEEDED
            else _CANCELED
            if final is not None and final.status is ActionStatus.CANCELED
            else _ABORTED
        )
        goal.ended.set()
        self._publish_status()
        self._forget_old()

    async def _forward_feedback(self, goal: _Goal) -> None:
        warned = False
        async for data in goal.handle.feedback():
            if goal.status == _ACCEPTED:
                goal.status = _EXECUTING
                self._publish_status()
            try:
                cdr = self.node.interfaces.serialize(
                    self.types.feedback_message, {"goal_id": {"uuid": list(goal.goal_id)}, "feedback": data}
                )
            except InterfaceError as err:
                if not warned:
                    warned = True
                    _log.warning("%s: feedback not published: %s", self.offer.action, err)
                continue
            self._feedback.put(cdr)

    async def _get_result(self, query: zenoh.Query) -> None:
        interfaces, types = self.node.interfaces, self.types
        try:
            goal = self._goals.get(bytes(self._request(query, types.get_result.request).goal_id.uuid))
        except InterfaceError as err:
            _log.warning("%s: bad get_result request: %s", self.offer.action, err)
            goal = None
        if goal is None:
            reply(query, interfaces.serialize(types.get_result.response, {"status": _UNKNOWN}))
            return
        await goal.ended.wait()
        status, result = goal.status, goal.final.result if goal.final is not None else None
        try:
            cdr = interfaces.serialize(
                types.get_result.response,
                {"status": status, "result": result if isinstance(result, Mapping) else {}},
            )
        except InterfaceError as err:
            _log.warning("%s: the result does not fit %s: %s", self.offer.action, types.result, err)
            cdr = interfaces.serialize(types.get_result.response, {"status": _ABORTED})
        reply(query, cdr)

    async def _cancel(self, query: zenoh.Query) -> None:
        interfaces = self.node.interfaces
        try:
            info = self._request(query, CANCEL_GOAL + "_Request").goal_info
            wanted = bytes(info.goal_id.uuid)
        except InterfaceError as err:
            _log.warning("%s: bad cancel request: %s", self.offer.action, err)
            wanted = b""
        everyone = wanted == bytes(16)
        targets = [g for g in self._goals.values() if everyone or g.goal_id == wanted]
        live = [g for g in targets if not g.ended.is_set()]
        for g in live:
            await g.handle.cancel()
        code = _CANCEL_OK if live else (_CANCEL_TERMINATED if targets else _CANCEL_UNKNOWN)
        canceling = [{"goal_id": {"uuid": list(g.goal_id)}, "stamp": _time(g.accepted_ns)} for g in live]
        reply(
            query,
            interfaces.serialize(
                CANCEL_GOAL + "_Response", {"return_code": code, "goals_canceling": canceling}
            ),
        )

    def _publish_status(self) -> None:
        statuses = [
            {
                "goal_info": {"goal_id": {"uuid": list(g.goal_id)}, "stamp": _time(g.accepted_ns)},
                "status": g.status,
            }
            for g in self._goals.values()
        ]
        self._status.put(self.node.interfaces.serialize(GOAL_STATUS_ARRAY, {"status_list": statuses}))

    def _forget_old(self) -> None:
        ended = [k for k, g in self._goals.items() if g.ended.is_set()]
        for k in ended[: max(0, len(ended) - self.KEEP_ENDED)]:
            del self._goals[k]

    async def close(self) -> None:
        """Stop serving (queue actions already submitted go on)."""
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
