"""The action work queue: actions, retry policy and the durable store (transport-free).

The planner/executor APIs over Zenoh and Pulsar build on these; see the action-queue issue.
"""

# The bus-facing parts import the bus; keep them after the pure ones.
from embodied_bus.actions.client import ActionHandle, Planner
from embodied_bus.actions.executor import ActionContext, Executor
from embodied_bus.actions.model import (
    Action,
    ActionError,
    ActionStatus,
    Attempt,
    decode_action,
    encode_action,
)
from embodied_bus.actions.policy import DEFAULT_RETRY, PermanentFailure, RetryPolicy
from embodied_bus.actions.service import QueueService
from embodied_bus.actions.store import ActionStore

__all__ = [
    "DEFAULT_RETRY",
    "Action",
    "ActionContext",
    "ActionError",
    "ActionHandle",
    "ActionStatus",
    "ActionStore",
    "Attempt",
    "Executor",
    "PermanentFailure",
    "Planner",
    "QueueService",
    "RetryPolicy",
    "decode_action",
    "encode_action",
]
