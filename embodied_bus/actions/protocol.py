"""The queue service's wire protocol: typed requests and replies (JSON, msgspec structs).

A request names its operation in ``op``, a reply its kind in ``r``; an error is ``{"r":
"error", "error": "..."}``. Malformed requests are refused by name (field path and expected
type). Actions travel as their JSON envelopes (:func:`~embodied_bus.actions.model.encode_action`),
spliced into replies as stored.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

import msgspec

from embodied_bus.actions.model import Action, ActionError
from embodied_bus.actions.queue import QueueUnavailable

__all__ = [
    "MAX_IDS",
    "MAX_LEASES",
    "MAX_REQUEST_BYTES",
    "NULL",
    "ActionReply",
    "ActionsReply",
    "BacklogReply",
    "Cancel",
    "Checkpoint",
    "DeadLetters",
    "Done",
    "Ended",
    "ExecutorRef",
    "Failed",
    "Get",
    "GetBacklog",
    "LeaseRef",
    "LeasesReply",
    "Purge",
    "ReceiptItem",
    "Renew",
    "RenewReply",
    "Reply",
    "ReportItem",
    "Reports",
    "ReportsReply",
    "Request",
    "Requeue",
    "Retire",
    "Submit",
    "SubmitReply",
    "SubmittedItem",
    "Take",
    "decode_reply",
    "decode_request",
    "encode",
]

#: Largest request accepted, bytes (a batch of submits included).
MAX_REQUEST_BYTES = 16 * 1024 * 1024
#: Most ids in one :class:`Ended` request.
MAX_IDS = 1000
#: Most leases taken, renewed or reported in one request.
MAX_LEASES = 256

#: JSON ``null``.
NULL = msgspec.Raw(b"null")
_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class ExecutorRef(msgspec.Struct, frozen=True):
    """An executor process: its name and its session (incarnation)."""

    name: _Name
    session: Annotated[str, msgspec.Meta(max_length=64)] = ""


class LeaseRef(msgspec.Struct, frozen=True):
    """One lease: the action and the attempt number it grants."""

    id: _Name
    attempt: Annotated[int, msgspec.Meta(ge=1)]


class _Req(msgspec.Struct, tag_field="op"):
    pass


class Submit(_Req, tag="submit"):
    actions: list[Action]


class Get(_Req, tag="get"):
    id: _Name


class Ended(_Req, tag="ended"):
    ids: Annotated[list[str], msgspec.Meta(max_length=MAX_IDS)]


class Cancel(_Req, tag="cancel"):
    id: _Name


class DeadLetters(_Req, tag="dead_letters"):
    pass


class Requeue(_Req, tag="requeue"):
    id: _Name


class Purge(_Req, tag="purge"):
    pass


class GetBacklog(_Req, tag="backlog"):
    pass


class Take(_Req, tag="take"):
    """Lease up to ``max`` ready actions; ``push``: while the executor has free slots left,
    lease new actions to it as they are submitted and send them to it."""

    executor: ExecutorRef
    kinds: list[str]
    labels: dict[str, str] = {}
    max: Annotated[int, msgspec.Meta(ge=1, le=MAX_LEASES)] = 1
    push: bool = False


class Renew(_Req, tag="renew"):
    executor: ExecutorRef
    leases: Annotated[list[LeaseRef], msgspec.Meta(max_length=MAX_LEASES)]


class Checkpoint(_Req, tag="checkpoint"):
    executor: ExecutorRef
    lease: LeaseRef
    state: Any = None


class ReportItem(msgspec.Struct, frozen=True):
    id: _Name
    attempt: Annotated[int, msgspec.Meta(ge=1)]
    ok: bool
    result: Any = None
    reason: str = ""
    permanent: bool = False


class Reports(_Req, tag="report"):
    """Outcomes that ended together, each answered on its own; ``take``: lease the next actions
    in the same round trip."""

    executor: ExecutorRef
    reports: Annotated[list[ReportItem], msgspec.Meta(max_length=MAX_LEASES)]
    take: Take | None = None


class Retire(_Req, tag="retire"):
    executor: ExecutorRef


#: Every request.
Request = (
    Submit
    | Get
    | Ended
    | Cancel
    | DeadLetters
    | Requeue
    | Purge
    | GetBacklog
    | Take
    | Renew
    | Checkpoint
    | Reports
    | Retire
)


class _Rep(msgspec.Struct, tag_field="r"):
    pass


class Failed(_Rep, tag="error"):
    """A refused request; ``unavailable``: the service cannot answer now (it is stopping)."""

    error: str
    unavailable: bool = False


class SubmittedItem(msgspec.Struct, frozen=True):
    id: str
    duplicate: bool
    status: str


class SubmitReply(_Rep, tag="submitted"):
    actions: list[SubmittedItem]


class ActionReply(_Rep, tag="action"):
    """One action's envelope, or ``null`` when there is none."""

    action: msgspec.Raw = NULL

    def envelope(self) -> bytes | None:
        """The envelope, or None."""
        data = bytes(self.action)
        return None if data == b"null" else data

    @classmethod
    def of(cls, envelope: bytes | None) -> ActionReply:
        return cls(msgspec.Raw(envelope) if envelope is not None else NULL)


class ActionsReply(_Rep, tag="actions"):
    actions: list[msgspec.Raw] = []


class BacklogReply(_Rep, tag="backlog"):
    backlog: dict[str, dict[str, int]]
    stats: dict[str, int]
    redeliveries: int = 0
    pruned: int = 0


class LeasesReply(_Rep, tag="leases"):
    actions: list[msgspec.Raw] = []


class RenewReply(_Rep, tag="renewed"):
    canceled: list[str] = []
    lost: list[str] = []


class ReceiptItem(msgspec.Struct, frozen=True):
    accepted: bool
    status: str | None = None
    error: str = ""


class ReportsReply(_Rep, tag="reported"):
    receipts: list[ReceiptItem]
    actions: list[msgspec.Raw] = []


class Done(_Rep, tag="done"):
    count: int = 0


#: Every reply.
Reply = (
    Failed
    | SubmitReply
    | ActionReply
    | ActionsReply
    | BacklogReply
    | LeasesReply
    | RenewReply
    | ReportsReply
    | Done
)

_REQUESTS = msgspec.json.Decoder(Request)
_REPLIES = msgspec.json.Decoder(Reply)
_ENCODER = msgspec.json.Encoder()
R = TypeVar("R")


def encode(message: msgspec.Struct) -> bytes:
    """A request or reply as JSON bytes."""
    return _ENCODER.encode(message)


def decode_request(data: bytes) -> Request:
    """JSON bytes → a typed request.

    Raises:
        ActionError: Too large, not JSON, an unknown ``op`` or a field that is missing or of the
            wrong type (named with its path, e.g. ``$.actions[0].priority``).
    """
    if len(data) > MAX_REQUEST_BYTES:
        raise ActionError(f"request of {len(data)} bytes exceeds {MAX_REQUEST_BYTES} bytes")
    try:
        return _REQUESTS.decode(data)
    except msgspec.ValidationError as err:
        raise ActionError(f"bad request: {err}") from err
    except msgspec.DecodeError as err:
        raise ActionError(f"request is not a JSON object: {err}") from err
    except RecursionError as err:
        raise ActionError("request is nested too deeply") from err


def decode_reply(data: bytes, expected: type[R]) -> R:
    """JSON bytes → the reply of type ``expected``.

    Raises:
        ActionError: The service answered with an error (its text), or with something that is
            not an ``expected`` reply.
        QueueUnavailable: The service is stopping.
    """
    try:
        reply = _REPLIES.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError) as err:
        raise ActionError(f"the action queue service sent a malformed reply: {err!r}") from err
    if isinstance(reply, Failed):
        if reply.unavailable:
            raise QueueUnavailable(reply.error)
        raise ActionError(reply.error)
    if not isinstance(reply, expected):
        raise ActionError(
            f"the action queue service answered {type(reply).__name__}, not {expected.__name__}"
        )
    return reply
