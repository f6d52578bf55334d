"""The action work queue: actions, retry policy and the durable store (transport-free).

The planner/executor APIs over Zenoh and Pulsar build on these; see the action-queue issue.
"""

from embodied_bus.actions.model import (
    Action,
    ActionError,
    ActionStatus,
    Attempt,
    decode_action,
    encode_action,
)
from embodied_bus.actions.policy import DEFAULT_RETRY, PermanentFailure, RetryPolicy
from embodied_bus.actions.store import ActionStore

__all__ = [
    "DEFAULT_RETRY",
    "Action",
    "ActionError",
    "ActionStatus",
    "ActionStore",
    "Attempt",
    "PermanentFailure",
    "RetryPolicy",
    "decode_action",
    "encode_action",
]
