"""ROS 2 actions over rmw_zenoh, no rclpy: type hashes computed from definitions, queue actions
run on the ros-z Fibonacci action server, and the ros-z Fibonacci action client served by the
queue through the bridge's action server. ros-z is an independent ROS 2 implementation; the
tests that need it skip with the reason where ros-z is not beside the repository."""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from embodied_bus import open_bus
from embodied_bus.actions import Action, Executor, Planner, QueueService, RetryPolicy
from embodied_bus.actions.model import ActionStatus
from embodied_bus.actions.policy import PermanentFailure
from embodied_bus.bus import Bus
from embodied_bus.ros.config import RobotConfigError, RosLink, load_robot_config, robot_config_from_dict
from embodied_bus.ros.rmw_bridge import RmwZenohBridge, open_rmw_session
from embodied_bus.rosmsg.interfaces import CANCEL_GOAL, InterfaceError, Interfaces
from embodied_bus.testing.ports import free_ports

from ros_z import ROS_Z

FIBONACCI = "action_tutorials_interfaces/action/Fibonacci"
SERVER = ROS_Z / "bin" / "demo_nodes_fibonacci_action_server"
CLIENT = ROS_Z / "bin" / "demo_nodes_fibonacci_action_client"


# -- hashes and values, no peer ---------------------------------------------------------------


def test_action_and_service_hashes_are_computed_from_their_definitions() -> None:
    interfaces = Interfaces("jazzy")
    fib = interfaces.action(FIBONACCI)
    # what the ros-z Fibonacci server (Jazzy interfaces) declares in its liveliness tokens
    assert fib.send_goal.hash == "RIHS01_a0603060ed69fe2dfbd1a6f3b982a1749957ef346e4a4d2b311a05e305ec37bb"
    assert fib.get_result.hash == "RIHS01_8b47e383f1e31f6d8df6417ab54957e7d5ea24dad315646ad711ac3fdea81d58"
    assert (
        fib.feedback_message_hash == "RIHS01_50fc26b9cac313652ecbeab3adf9b5414d59fd4d4d5f9058ddcc7525169927f1"
    )
    # action_msgs/srv/CancelGoal as ROS 2 installs it (share/action_msgs/srv/CancelGoal.json)
    assert (
        interfaces.service(CANCEL_GOAL).hash
        == "RIHS01_573d8b0a534451d7bc2ac8c5ffde8ac14b8593b7001175d0cd6516dcbeb8689a"
    )


def test_user_definitions_are_found_on_the_search_path_with_their_references(tmp_path: Path) -> None:
    (tmp_path / "example_interfaces" / "srv").mkdir(parents=True)
    (tmp_path / "example_interfaces" / "srv" / "AddTwoInts.srv").write_text(
        "int64 a\nint64 b\n---\nint64 sum\n"
    )
    (tmp_path / "my_nav" / "msg").mkdir(parents=True)
    (tmp_path / "my_nav" / "msg" / "Waypoint.msg").write_text(
        "geometry_msgs/PoseStamped pose\nfloat32 tolerance_m\n"
    )
    (tmp_path / "my_nav" / "action").mkdir(parents=True)
    (tmp_path / "my_nav" / "action" / "FollowWaypoints.action").write_text(
        "Waypoint[] waypoints\nstring behavior_tree\n---\nuint16 error_code\n---\nint32 current_waypoint\n"
    )
    interfaces = Interfaces("jazzy", [tmp_path])
    # rmw_zenoh's design document keys AddTwoInts with this hash
    assert (
        interfaces.hash("example_interfaces/srv/AddTwoInts")
        == "RIHS01_e118de6bf5eeb66a2491b5bda11202e7b68f198d6f67922cf30364858239c81a"
    )
    follow = interfaces.action("my_nav/action/FollowWaypoints")
    cdr = interfaces.serialize(
        follow.goal, {"waypoints": [{"pose": {"pose": {"position": {"x": 1.5}}}, "tolerance_m": 0.2}]}
    )
    goal = interfaces.deserialize(follow.goal, cdr)
    assert goal.waypoints[0].pose.pose.position.x == 1.5 and goal.behavior_tree == ""
    assert follow.send_goal.hash.startswith("RIHS01_") and len(follow.send_goal.hash) == 71


def test_missing_definitions_and_payloads_that_do_not_fit_are_named(tmp_path: Path) -> None:
    interfaces = Interfaces("jazzy", [tmp_path])
    with pytest.raises(InterfaceError, match="no definition of nav2_msgs/action/NavigateToPose"):
        interfaces.action("nav2_msgs/action/NavigateToPose")
    goal = interfaces.action(FIBONACCI).goal
    with pytest.raises(InterfaceError, match=r"has no field\(s\) \['ordr'\]"):
        interfaces.build(goal, {"ordr": 3})
    with pytest.raises(InterfaceError, match=r"Fibonacci_Goal.order: expected a number"):
        interfaces.build(goal, {"order": "six"})
    with pytest.raises(InterfaceError, match="outside int32"):
        interfaces.build(goal, {"order": 2**40})
    (tmp_path / "bad" / "action").mkdir(parents=True)
    (tmp_path / "bad" / "action" / "Broken.action").write_text("int32 a\n---\nint32 b\n")
    with pytest.raises(InterfaceError, match="goal, a result and a feedback"):
        interfaces.action("bad/action/Broken")


# -- against ros-z ------------------------------------------------------------------------------


def _need_binaries() -> None:
    if not SERVER.exists() or not CLIENT.exists():
        pytest.skip(f"ros-z's action binaries are not beside the repository ({SERVER.parent})")


@dataclass
class Rig:
    endpoint: str
    bus: Bus
    planner: Planner
    stop: asyncio.Event


@contextlib.asynccontextmanager
async def rig(tmp_path: Path, namespace: str) -> AsyncIterator[Rig]:
    """A Zenoh router for the ROS side, a bus with its queue service, and a planner."""
    router_port, bus_port = free_ports(2)
    endpoint = f"tcp/127.0.0.1:{router_port}"
    router = await open_rmw_session(RosLink(host_router=endpoint))
    stop = asyncio.Event()
    try:
        async with open_bus(f"zenoh:?listen=tcp/127.0.0.1:{bus_port}", namespace=namespace) as bus:
            ready = asyncio.Event()
            policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.05, max_backoff_s=0.2)
            service = asyncio.create_task(QueueService(bus, tmp_path / "q.db", policy).run(stop, ready))
            await ready.wait()
            async with Planner(bus) as planner:
                yield Rig(endpoint, bus, planner, stop)
            stop.set()
            await asyncio.gather(service, return_exceptions=True)
    finally:
        await asyncio.to_thread(router.close)


class Peer:
    """A ros-z binary whose output lines are collected."""

    def __init__(self, *argv: str) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = asyncio.get_running_loop().run_in_executor(None, self._read)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    async def wait_line(self, pattern: str, timeout_s: float = 20.0) -> str:
        async with asyncio.timeout(timeout_s):
            while True:
                hit = next((ln for ln in self.lines if re.search(pattern, ln)), None)
                if hit is not None:
                    return hit
                await asyncio.sleep(0.05)

    async def finish(self, timeout_s: float = 30.0) -> int:
        code = await asyncio.wait_for(asyncio.to_thread(self.proc.wait), timeout_s)
        await self._reader
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _route_config(endpoint: str, timeout_s: float = 60) -> Any:
    return robot_config_from_dict(
        {
            "ros": {"connect": [endpoint], "node_name": "queue_executor"},
            "actions": {
                "routes": {"fibonacci": {"action": "/fibonacci", "type": FIBONACCI, "timeout_s": timeout_s}}
            },
        }
    )


async def _feedback(planner: Planner, action_id: str, into: list[Any]) -> None:
    async for item in planner.handle(action_id).feedback():
        into.append(item)


async def test_queue_actions_run_on_the_ros_z_action_server_with_feedback_cancel_and_bad_goals(
    tmp_path: Path,
) -> None:
    _need_binaries()
    async with rig(tmp_path, "act1") as r:
        server = Peer(str(SERVER), r.endpoint)
        try:
            await server.wait_line("action server started")
            async with RmwZenohBridge(r.bus, _route_config(r.endpoint), planner=r.planner) as bridge:
                assert bridge.problems == []
                # goal, feedback per step, result
                handle = await r.planner.submit("fibonacci", {"order": 6})
                feedback: list[Any] = []
                watching = asyncio.create_task(_feedback(r.planner, handle.id, feedback))
                done = await handle.result(timeout_s=30)
                watching.cancel()
                assert done.status is ActionStatus.SUCCEEDED, done.attempts[-1].reason
                assert done.result == {"sequence": [0, 1, 1, 2, 3, 5, 8]}
                assert {"partial_sequence": [0, 1, 1, 2, 3, 5, 8]} in feedback
                assert feedback[0]["partial_sequence"][:3] == [0, 1, 1]
                # a queue cancel cancels the goal on the server
                long = await r.planner.submit("fibonacci", {"order": 40})
                first: list[Any] = []
                watching = asyncio.create_task(_feedback(r.planner, long.id, first))
                async with asyncio.timeout(15):
                    while not first:
                        await asyncio.sleep(0.05)
                await long.cancel()
                ended = await long.result(timeout_s=20)
                watching.cancel()
                assert ended.status is ActionStatus.CANCELED
                await server.wait_line("Goal canceled!", 10)
                # a payload that does not fit the goal dead-letters at once, naming the field
                bad = await (await r.planner.submit("fibonacci", {"ordr": 3})).result(timeout_s=15)
                assert bad.status is ActionStatus.DEAD and len(bad.attempts) == 1
                assert "has no field(s) ['ordr']" in (bad.attempts[-1].reason or "")
        finally:
            server.kill()


async def test_a_lost_action_server_nacks_and_the_retry_runs_on_the_server_that_took_over(
    tmp_path: Path,
) -> None:
    _need_binaries()
    async with rig(tmp_path, "act2") as r:
        first = Peer(str(SERVER), r.endpoint)
        second: Peer | None = None
        try:
            await first.wait_line("action server started")
            async with RmwZenohBridge(r.bus, _route_config(r.endpoint), planner=r.planner):
                handle = await r.planner.submit("fibonacci", {"order": 12})
                feedback: list[Any] = []
                watching = asyncio.create_task(_feedback(r.planner, handle.id, feedback))
                async with asyncio.timeout(15):
                    while not feedback:
                        await asyncio.sleep(0.05)
                first.kill()  # SIGKILL mid-goal
                second = Peer(str(SERVER), r.endpoint)
                done = await handle.result(timeout_s=60)
                watching.cancel()
                assert done.status is ActionStatus.SUCCEEDED, [a.reason for a in done.attempts]
                assert len(done.attempts) >= 2
                assert done.result["sequence"][-1] == 144
                reasons = " ".join(a.reason or "" for a in done.attempts[:-1])
                assert "lost the server" in reasons or "not available" in reasons, reasons
                await second.wait_line("Goal succeeded!", 10)
        finally:
            first.kill()
            if second is not None:
                second.kill()


def _offer_config(endpoint: str) -> Any:
    return robot_config_from_dict(
        {
            "ros": {"connect": [endpoint], "node_name": "queue_actions"},
            "actions": {"offer": {"fibonacci": {"action": "/fibonacci", "type": FIBONACCI}}},
        }
    )


async def test_the_ros_z_action_client_is_served_by_the_queue_through_the_bridge(tmp_path: Path) -> None:
    _need_binaries()
    async with rig(tmp_path, "act3") as r:

        async def fibonacci(action: Action, ctx: Any) -> Any:
            order = action.payload["order"]
            if order > 30:
                raise PermanentFailure("too long")
            seq = [0, 1]
            for _ in range(2, order + 1):
                seq.append(seq[-1] + seq[-2])
                ctx.feedback({"partial_sequence": list(seq)})
                await asyncio.sleep(0.05)
            return {"sequence": seq}

        executor = Executor(r.bus, "fib-executor")
        executor.handler("fibonacci")(fibonacci)
        running = asyncio.create_task(executor.run(r.stop))
        async with RmwZenohBridge(r.bus, _offer_config(r.endpoint), planner=r.planner) as bridge:
            assert bridge.problems == []
            client = Peer(str(CLIENT), "-o", "7", "-e", r.endpoint)
            try:
                assert await client.finish(30) == 0, client.lines
            finally:
                client.kill()
            assert "Final result: [0, 1, 1, 2, 3, 5, 8, 13]" in client.lines, client.lines
            fed = [ln for ln in client.lines if ln.startswith("Feedback: ")]
            assert fed and fed[-1] == "Feedback: [0, 1, 1, 2, 3, 5, 8, 13]", client.lines
            assert len(fed) >= 3  # per step, not only the last
        r.stop.set()
        await asyncio.gather(running, return_exceptions=True)


def test_offers_and_interface_directories_come_from_the_robot_yaml(tmp_path: Path) -> None:
    (tmp_path / "robot.yaml").write_text(
        "ros: {interfaces: [msgs]}\n"
        "actions:\n"
        "  offer: {patrol: {action: /patrol, type: my_msgs/action/Patrol}}\n"
        "  routes: {fib: {action: /fibonacci, type: " + FIBONACCI + ", timeout_s: 9}}\n"
    )
    cfg = load_robot_config(tmp_path / "robot.yaml")
    assert cfg.ros.interfaces == (str(tmp_path / "msgs"),)
    assert [(o.kind, o.action, o.action_type) for o in cfg.offers] == [
        ("patrol", "/patrol", "my_msgs/action/Patrol")
    ]
    assert cfg.actions[0].timeout_s == 9
    with pytest.raises(RobotConfigError, match=r"actions.offer.patrol.type: .* is not an action type"):
        robot_config_from_dict({"actions": {"offer": {"patrol": {"action": "/p", "type": "a/msg/B"}}}})


async def test_a_goal_past_the_routes_timeout_is_canceled_on_the_ros_z_server_and_retried(
    tmp_path: Path,
) -> None:
    _need_binaries()
    async with rig(tmp_path, "act4") as r:
        server = Peer(str(SERVER), r.endpoint)
        try:
            await server.wait_line("action server started")
            async with RmwZenohBridge(r.bus, _route_config(r.endpoint, timeout_s=1.5), planner=r.planner):
                done = await (await r.planner.submit("fibonacci", {"order": 40})).result(timeout_s=40)
            assert done.status is ActionStatus.DEAD and len(done.attempts) == 3
            assert all("no result within 1.5 s" in (a.reason or "") for a in done.attempts)
            await server.wait_line("Goal canceled!", 10)
        finally:
            server.kill()


async def test_an_aborted_goal_nacks_and_is_retried_until_the_queue_gives_up(tmp_path: Path) -> None:
    """The route's server here is the bridge's own offer of another kind (a peer speaking the
    same wire format): its goals abort, as ros-z's demo server's never do."""
    async with rig(tmp_path, "act5") as r:

        async def refuse(action: Action, ctx: Any) -> Any:
            raise PermanentFailure(f"cannot reach order {action.payload['order']}")

        executor = Executor(r.bus, "inner-executor")
        executor.handler("inner")(refuse)
        running = asyncio.create_task(executor.run(r.stop))
        cfg = robot_config_from_dict(
            {
                "ros": {"connect": [r.endpoint], "node_name": "both_ways"},
                "actions": {
                    "offer": {"inner": {"action": "/inner", "type": FIBONACCI}},
                    "routes": {"outer": {"action": "/inner", "type": FIBONACCI, "timeout_s": 20}},
                },
            }
        )
        async with RmwZenohBridge(r.bus, cfg, planner=r.planner) as bridge:
            assert bridge.problems == []
            done = await (await r.planner.submit("outer", {"order": 5})).result(timeout_s=40)
        r.stop.set()
        await asyncio.gather(running, return_exceptions=True)
    assert done.status is ActionStatus.DEAD and len(done.attempts) == 3  # nacked, retried, given up
    assert all("goal status 6 (retry)" in (a.reason or "") for a in done.attempts), done.attempts
