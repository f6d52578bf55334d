"""``ros2 run embodied_bus action_bridge --ros-args -p config:=robot.yaml``

Connects the action queue and ROS 2:

* **ROS planners → queue.** JSON on ``actions.submit_topic`` (``std_msgs/String``)::

      {"kind": "navigate_to", "payload": {...}, "priority": 5, "deadline_s": 30,
       "idempotency_key": "goal-17", "request_id": "my-correlation-id"}

  Outcomes are published on ``actions.results_topic`` (``std_msgs/String``, JSON with
  ``request_id``, ``id``, ``kind``, ``status`` = queued | succeeded | dead | canceled |
  rejected, and ``result`` or ``error``).
* **Queue → ROS action servers.** An executor takes the queue actions of every routed kind and
  sends them as goals to the configured action server (e.g. nav2 ``NavigateToPose``): the JSON
  payload fills the goal's fields; feedback becomes queue feedback; SUCCEEDED acks with the
  result; ABORTED nacks (the queue retries, on another executor where one exists); a rejected
  goal or a payload that does not fit the goal dead-letters at once; a queue cancel cancels the
  goal. An unreachable server nacks, so another robot's bridge can take the action.
* **ROS action clients → queue** (``actions.offer``). A queue kind is served as a ROS 2 action
  server: each accepted goal is submitted as a queue action of that kind (the goal id is its
  idempotency key), queue feedback is published as action feedback, and the outcome maps back
  as SUCCEEDED (with the result's fields), CANCELED (a client's cancel cancels the queue
  action) or ABORTED (dead-lettered).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from typing import Any

from embodied_bus.actions.client import ActionHandle, Planner
from embodied_bus.actions.executor import ActionContext, Executor
from embodied_bus.actions.model import Action, ActionStatus
from embodied_bus.actions.policy import PermanentFailure
from embodied_bus.bus import Bus, open_bus
from embodied_bus.ros.bridge_core import (
    GoalOutcome,
    goal_outcome,
    outcome_json,
    parse_submission,
    resolve_routes,
    string_cdr,
    string_from_cdr,
)
from embodied_bus.ros.config import ActionRoute
from embodied_bus.ros.nodes.runtime import NodeParams, run_node, to_asyncio
from embodied_bus.ros.sealing import bridge_credentials, bridge_planner

__all__ = ["main"]

NODE_NAME = "action_bridge"
#: How long to wait for an action server before handing the action back, seconds.
SERVER_WAIT_S = 5.0
#: How often an offered goal's execution checks for a client's cancel request, seconds.
CANCEL_POLL_S = 0.05


def _to_dict(msg: Any) -> Any:
    from rosidl_runtime_py.convert import message_to_ordereddict

    return json.loads(json.dumps(message_to_ordereddict(msg), default=str))


def _route_handler(node: Any, route: ActionRoute) -> Any:
    from rclpy.action import ActionClient
    from rosidl_runtime_py.set_message import set_message_fields
    from rosidl_runtime_py.utilities import get_action

    action_cls = get_action(route.action_type)
    client = ActionClient(node, action_cls, route.action)

    async def handle(action: Action, ctx: ActionContext) -> Any:
        loop = asyncio.get_running_loop()
        if not await asyncio.to_thread(client.wait_for_server, timeout_sec=SERVER_WAIT_S):
            raise RuntimeError(f"action server {route.action} is not available")
        goal = action_cls.Goal()
        try:
            set_message_fields(goal, action.payload or {})
        except (AttributeError, TypeError, ValueError) as err:
            raise PermanentFailure(f"payload does not fit {route.action_type} goal: {err}") from err

        def on_feedback(fb: Any) -> None:
            loop.call_soon_threadsafe(ctx.feedback, _to_dict(fb.feedback))

        # the action client is driven from the executor's thread only (rclpy's ActionClient keeps
        # its pending requests in plain dicts the executor reads)
        async def send() -> Any:
            return await client.send_goal_async(goal, feedback_callback=on_feedback)

        goal_handle = await to_asyncio(loop, node.executor.create_task(send))
        if not goal_handle.accepted:
            raise PermanentFailure(f"{route.action} rejected the goal")

        async def result() -> Any:
            return await goal_handle.get_result_async()

        async def cancel() -> Any:
            return await goal_handle.cancel_goal_async()

        result_fut = to_asyncio(loop, node.executor.create_task(result))
        cancel_wait = asyncio.ensure_future(ctx.cancelled.wait())
        done, _ = await asyncio.wait(
            {result_fut, cancel_wait}, timeout=route.timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if result_fut not in done:
            await to_asyncio(loop, node.executor.create_task(cancel))
            cancel_wait.cancel()
            reason = (
                "canceled by the queue" if cancel_wait in done else f"timed out after {route.timeout_s} s"
            )
            raise RuntimeError(f"{route.action}: {reason}")
        cancel_wait.cancel()
        res = result_fut.result()
        outcome = goal_outcome(int(res.status))
        if outcome is GoalOutcome.OK:
            return _to_dict(res.result)
        raise RuntimeError(f"{route.action} ended with goal status {int(res.status)} ({outcome.value})")

    return handle


class _OfferedGoal:
    """One goal of an offered kind, executed on an rclpy executor thread: submitted to the
    queue, its feedback forwarded, its outcome mapped back."""

    def __init__(
        self, route: ActionRoute, action_cls: Any, planner: Planner, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.route, self.action_cls, self.planner, self.loop = route, action_cls, planner, loop

    def _call(self, coro: Any) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def execute(self, goal_handle: Any) -> Any:
        from rosidl_runtime_py.set_message import set_message_fields

        result = self.action_cls.Result()
        goal_id = bytes(goal_handle.goal_id.uuid).hex()
        try:
            handle: ActionHandle = self._call(
                self.planner.submit(
                    self.route.kind, _to_dict(goal_handle.request), idempotency_key=f"ros2-goal-{goal_id}"
                )
            ).result(timeout=30)
        except Exception:  # the queue refused it: the client sees the goal aborted
            goal_handle.abort()
            return result
        feedback = self._call(self._forward_feedback(handle, goal_handle))
        final_f = self._call(handle.result())
        cancel_sent = False
        while True:
            try:
                final: Action = final_f.result(timeout=CANCEL_POLL_S)
                break
            except concurrent.futures.TimeoutError:
                if goal_handle.is_cancel_requested and not cancel_sent:
                    cancel_sent = True
                    self._call(handle.cancel())
        feedback.cancel()
        if final.status is ActionStatus.SUCCEEDED:
            try:
                set_message_fields(result, final.result if isinstance(final.result, dict) else {})
            except (AttributeError, TypeError, ValueError):
                goal_handle.abort()
                return self.action_cls.Result()
            goal_handle.succeed()
        elif final.status is ActionStatus.CANCELED and goal_handle.is_cancel_requested:
            goal_handle.canceled()
        else:
            goal_handle.abort()
        return result

    async def _forward_feedback(self, handle: ActionHandle, goal_handle: Any) -> None:
        from rosidl_runtime_py.set_message import set_message_fields

        async for data in handle.feedback():
            fb = self.action_cls.Feedback()
            try:
                set_message_fields(fb, data if isinstance(data, dict) else {})
            except (AttributeError, TypeError, ValueError):
                continue
            goal_handle.publish_feedback(fb)


def _offer(node: Any, route: ActionRoute, planner: Planner, loop: asyncio.AbstractEventLoop) -> Any:
    """Serve the queue kind ``route.kind`` as the ROS 2 action server ``route.action``."""
    from rclpy.action import ActionServer, CancelResponse, GoalResponse
    from rosidl_runtime_py.utilities import get_action

    action_cls = get_action(route.action_type)
    goal = _OfferedGoal(route, action_cls, planner, loop)
    return ActionServer(
        node,
        action_cls,
        route.action,
        execute_callback=goal.execute,
        goal_callback=lambda _request: GoalResponse.ACCEPT,
        cancel_callback=lambda _goal_handle: CancelResponse.ACCEPT,
    )


async def _submissions(node: Any, bus: Bus, params: NodeParams, stop: asyncio.Event) -> None:
    from std_msgs.msg import String

    cfg = params.config
    planner = bridge_planner(bus, bridge_credentials(cfg.security))
    loop = asyncio.get_running_loop()
    results = node.create_publisher(String, cfg.results_topic, 10)
    tasks: set[asyncio.Task[None]] = set()

    async def submit(raw: bytes) -> None:
        request_id = None
        try:
            req = parse_submission(string_from_cdr(raw))
            request_id = req.request_id
            handle = await planner.submit(
                req.kind,
                req.payload,
                priority=req.priority,
                deadline_s=req.deadline_s,
                idempotency_key=req.idempotency_key,
            )
        except Exception as err:  # answered, never fatal
            results.publish(string_cdr(outcome_json(request_id=request_id, error=str(err))))
            return
        results.publish(
            string_cdr(
                outcome_json(request_id=request_id, action=await planner.get(handle.id), status="queued")
            )
        )
        final = await handle.result()
        results.publish(string_cdr(outcome_json(request_id=request_id, action=final)))

    def on_submit(raw: bytes) -> None:
        def spawn() -> None:
            t = asyncio.create_task(submit(raw))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

        loop.call_soon_threadsafe(spawn)

    node.create_subscription(String, cfg.submit_topic, on_submit, 10, raw=True)
    await stop.wait()
    for t in list(tasks):
        t.cancel()


async def serve(node: Any, params: NodeParams, stop: asyncio.Event) -> None:
    """Accept submissions and execute routed actions until ``stop`` is set."""
    cfg = params.config
    async with open_bus(params.bus, namespace=params.bus_namespace) as bus:
        jobs = [asyncio.create_task(_submissions(node, bus, params, stop))]
        offers = []
        creds = bridge_credentials(cfg.security)
        if cfg.offers:
            planner = bridge_planner(bus, creds)
            for route in cfg.offers:
                offers.append(_offer(node, route, planner, asyncio.get_running_loop()))
                node.get_logger().info(
                    f"ROS action {route.action} ({route.action_type}) -> queue '{route.kind}'"
                )
        routes, problems = resolve_routes(cfg.actions, lambda route: _route_handler(node, route))
        for problem in problems:
            node.get_logger().error(problem)
        if routes:
            executor = Executor(
                bus,
                f"ros-{node.get_name()}",
                concurrency=len(routes),
                backend=creds.executor_options(),
            )
            for route, handler in routes:
                executor.handler(route.kind)(handler)
                node.get_logger().info(
                    f"queue actions '{route.kind}' -> {route.action} ({route.action_type})"
                )
            jobs.append(asyncio.create_task(executor.run(stop)))
        await stop.wait()
        await asyncio.gather(*jobs, return_exceptions=True)
        for server in offers:
            server.destroy()


def main(args: list[str] | None = None) -> int:
    """Run the node (needs rclpy)."""
    return run_node(NODE_NAME, args, serve, blocking_callbacks=True)


if __name__ == "__main__":
    raise SystemExit(main())
