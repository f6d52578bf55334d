"""The action work queue: planners submit actions, executors run them, through one queue
interface with a backend per engine (a Zenoh queue service, Apache Pulsar's topics, or an
in-process queue), and one lifecycle every backend calls."""

from embodied_bus.actions.client import ActionHandle, Planner
from embodied_bus.actions.context import ActionContext
from embodied_bus.actions.executor import Executor
from embodied_bus.actions.memory import MemoryQueue
from embodied_bus.actions.model import (
    Action,
    ActionError,
    ActionStatus,
    Attempt,
    Outcome,
    SessionFailure,
    decode_action,
    encode_action,
)
from embodied_bus.actions.policy import DEFAULT_RETRY, PermanentFailure, RetryPolicies, RetryPolicy
from embodied_bus.actions.queue import (
    EXECUTOR_GROUP,
    ActionQueue,
    BackendOptions,
    Backlog,
    PulsarQueueOptions,
    QueueUnavailable,
    ZenohQueueOptions,
    executors_with,
    open_queue,
)
from embodied_bus.actions.service import QueueService
from embodied_bus.actions.store import ActionStore

__all__ = [
    "DEFAULT_RETRY",
    "EXECUTOR_GROUP",
    "Action",
    "ActionContext",
    "ActionError",
    "ActionHandle",
    "ActionQueue",
    "ActionStatus",
    "ActionStore",
    "Attempt",
    "BackendOptions",
    "Backlog",
    "Executor",
    "MemoryQueue",
    "Outcome",
    "PermanentFailure",
    "Planner",
    "PulsarQueueOptions",
    "QueueService",
    "QueueUnavailable",
    "RetryPolicies",
    "RetryPolicy",
    "SessionFailure",
    "ZenohQueueOptions",
    "decode_action",
    "encode_action",
    "executors_with",
    "open_queue",
]
