"""Actions, attempts and their states: plain values, and the JSON envelope with its limits."""

from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec

from embodied_bus.actions.policy import RetryPolicy
from embodied_bus.errors import EmbodiedBusError
from embodied_bus.model.limits import DEFAULT_LIMITS, DecodeLimits

__all__ = [
    "MAX_KIND_CHARS",
    "MAX_PAYLOAD_BYTES",
    "Action",
    "ActionError",
    "ActionStatus",
    "Attempt",
    "Outcome",
    "SessionFailure",
    "action_from_dict",
    "action_to_dict",
    "decode_action",
    "encode_action",
]

#: Largest JSON payload of an action, in bytes.
MAX_PAYLOAD_BYTES = 256 * 1024
#: Longest action kind / idempotency key / executor name.
MAX_KIND_CHARS = 128
#: Largest integer an action carries (stamps, deadlines, counters: SQLite's INTEGER, int64).
MAX_INT64 = (1 << 63) - 1

_KIND_RE = re.compile(r"^[A-Za-z0-9_.\-/]+$")


class ActionError(EmbodiedBusError, ValueError):
    """An action is invalid (unknown kind, bad payload, too large); the message says why."""


class ActionStatus(str, enum.Enum):
    """Where an action is in its life."""

    QUEUED = "queued"
    RUNNING = "running"
    RETRYING = "retrying"
    SUCCEEDED = "succeeded"
    DEAD = "dead"
    CANCELED = "canceled"

    @property
    def terminal(self) -> bool:
        """No further change will happen."""
        return self in _TERMINAL


_TERMINAL = frozenset({ActionStatus.SUCCEEDED, ActionStatus.DEAD, ActionStatus.CANCELED})


class Outcome(str, enum.Enum):
    """How an attempt ended (``OPEN`` while it runs)."""

    OPEN = ""
    OK = "ok"
    NACK = "nack"
    REJECTED = "rejected"
    LOST = "lost"
    CANCELED = "canceled"
    EXPIRED = "expired"


class SessionFailure(str, enum.Enum):
    """What the later steps of a session do when a step is dead-lettered."""

    #: They end canceled, with the reason (the default).
    CANCEL = "cancel"
    #: They wait until the dead step is requeued and ends, or is purged from the dead letters.
    HOLD = "hold"
    #: They run on, as if the step had succeeded.
    CONTINUE = "continue"


@dataclass(frozen=True, slots=True)
class Attempt:
    """One try of an action by an executor.

    Attributes:
        number: 1 for the first try; also the attempt's fencing token (it only grows).
        executor: Executor name.
        started_ns: When it was leased (UTC ns).
        ended_ns: When it ended (0 while running).
        outcome: How it ended (see :class:`Outcome`; a plain string on the wire).
        reason: Error text for anything but ``ok``.
        session: The executor process (incarnation) that holds it: an executor restarted under
            the same name is another holder.
    """

    number: int
    executor: str
    started_ns: int
    ended_ns: int = 0
    outcome: str = ""
    reason: str = ""
    session: str = ""

    @property
    def open(self) -> bool:
        """Still running (not ended)."""
        return self.ended_ns == 0 and self.outcome == ""

    def ended(self, ended_ns: int, outcome: Outcome | str, reason: str = "") -> Attempt:
        """This attempt, ended (``dataclasses.replace`` without its field lookups)."""
        text = outcome.value if isinstance(outcome, Outcome) else outcome
        return Attempt(self.number, self.executor, self.started_ns, ended_ns, text, reason, self.session)


@dataclass(slots=True)
class Action:
    """A command for robot executors.

    Attributes:
        kind: What to do (``navigate_to``, ``pick``, ``dock``, ``e_stop``...).
        payload: JSON-compatible arguments.
        priority: 0 (routine) to 9 (urgent); higher is dispatched first.
        deadline_ns: Never start after this UTC ns (0: no deadline).
        idempotency_key: Submitting the same key twice yields the same action.
        selector: Executor labels required (all must match), e.g. ``{"arm": "left"}``.
        id: Unique id (UUID4 hex), set on creation.
        status: Current state.
        attempts: Every try so far, with executor and reason.
        result: The handler's JSON result once succeeded.
        checkpoint: The last checkpoint a handler saved (resumed by the next attempt).
        created_ns: Submission time (UTC ns).
        cancel_requested: A running action was asked to stop.
        budget_from: Attempts before this index do not count toward the retry limit (a
            dead-lettered action that was requeued).
        auth: Signature block of a signed action (see :mod:`embodied_bus.security`), or None.
        session: Ordered session it is a step of: the steps of one session start in submission
            order, one at a time (None: an independent action).
        on_failure: What the later steps of its session do if this step is dead-lettered.
        ended_reason: Why it ended without running to its end (a session step canceled because
            an earlier step was dead-lettered); empty otherwise.
        retry: This action's own retry policy (None: its kind's in the queue, else the queue's
            default).
    """

    kind: str
    payload: Any = None
    priority: int = 0
    deadline_ns: int = 0
    idempotency_key: str | None = None
    selector: dict[str, str] = field(default_factory=dict)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    status: ActionStatus = ActionStatus.QUEUED
    attempts: list[Attempt] = field(default_factory=list)
    result: Any = None
    checkpoint: Any = None
    created_ns: int = 0
    cancel_requested: bool = False
    budget_from: int = 0
    auth: dict[str, Any] | None = None
    session: str | None = None
    on_failure: SessionFailure = SessionFailure.CANCEL
    ended_reason: str = ""
    retry: RetryPolicy | None = None

    def validate(self, *, check_payload: bool = True) -> Action:
        """Check kind, priority, payload size (unless ``check_payload`` is false) and selector;
        return self.

        Raises:
            ActionError: What is wrong, named.
        """
        if not isinstance(self.kind, str) or not _KIND_RE.match(self.kind) or len(self.kind) > MAX_KIND_CHARS:
            raise ActionError(f"invalid action kind {self.kind!r}: use letters, digits, '_', '-', '.', '/'")
        if (
            isinstance(self.priority, bool)
            or not isinstance(self.priority, int)
            or not 0 <= self.priority <= 9
        ):
            raise ActionError(f"priority must be an integer 0..9, got {self.priority!r}")
        for name, value in (
            ("deadline_ns", self.deadline_ns),
            ("created_ns", self.created_ns),
            ("budget_from", self.budget_from),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_INT64:
                raise ActionError(f"{name} must be an integer 0..{MAX_INT64} (int64), got {value!r}")
        if self.idempotency_key is not None and (
            not isinstance(self.idempotency_key, str) or not 0 < len(self.idempotency_key) <= MAX_KIND_CHARS
        ):
            raise ActionError(f"idempotency_key must be 1..{MAX_KIND_CHARS} characters")
        if not isinstance(self.selector, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.selector.items()
        ):
            raise ActionError("selector must map label names to string values")
        if self.auth is not None and not isinstance(self.auth, dict):
            raise ActionError("auth must be an object (the signature block) or absent")
        if self.session is not None and (
            not isinstance(self.session, str) or not 0 < len(self.session) <= MAX_KIND_CHARS
        ):
            raise ActionError(f"session must be 1..{MAX_KIND_CHARS} characters, got {self.session!r}")
        if not isinstance(self.on_failure, SessionFailure):
            try:
                self.on_failure = SessionFailure(self.on_failure)
            except ValueError:
                choices = ", ".join(f.value for f in SessionFailure)
                raise ActionError(f"on_failure must be one of {choices}, got {self.on_failure!r}") from None
        if self.retry is not None and not isinstance(self.retry, RetryPolicy):
            raise ActionError(f"retry must be a RetryPolicy or absent, got {self.retry!r}")
        if not check_payload:
            return self
        try:
            size = len(json.dumps(self.payload))
        except (TypeError, ValueError) as err:
            raise ActionError(f"payload of a {self.kind!r} action is not JSON-serializable: {err}") from err
        if size > MAX_PAYLOAD_BYTES:
            raise ActionError(f"payload of {size} bytes exceeds the limit of {MAX_PAYLOAD_BYTES} bytes")
        return self

    def copy(self) -> Action:
        """A copy whose attempts list and selector are its own (payload, result, checkpoint
        and auth are shared: JSON values nobody changes in place)."""
        return Action(
            self.kind,
            self.payload,
            self.priority,
            self.deadline_ns,
            self.idempotency_key,
            dict(self.selector),
            self.id,
            self.status,
            list(self.attempts),
            self.result,
            self.checkpoint,
            self.created_ns,
            self.cancel_requested,
            self.budget_from,
            self.auth,
            self.session,
            self.on_failure,
            self.ended_reason,
            self.retry,
        )

    @property
    def attempt_count(self) -> int:
        """Tries so far (crashes included)."""
        return len(self.attempts)

    def executors_tried(self) -> set[str]:
        """Executors that already tried and failed this action."""
        return {a.executor for a in self.attempts if a.outcome in _FAILED}

    @property
    def open_attempt(self) -> Attempt | None:
        """The attempt running now, if any."""
        last = self.attempts[-1] if self.attempts else None
        return last if last is not None and last.open else None


_FAILED = (Outcome.NACK.value, Outcome.LOST.value)


def action_to_dict(action: Action) -> dict[str, Any]:
    """Action → the JSON envelope as a dict (fields in declaration order)."""
    a = action
    return {
        "kind": a.kind,
        "payload": a.payload,
        "priority": a.priority,
        "deadline_ns": a.deadline_ns,
        "idempotency_key": a.idempotency_key,
        "selector": a.selector,
        "id": a.id,
        "status": a.status.value,
        "attempts": [
            {
                "number": t.number,
                "executor": t.executor,
                "started_ns": t.started_ns,
                "ended_ns": t.ended_ns,
                "outcome": t.outcome,
                "reason": t.reason,
                "session": t.session,
            }
            for t in a.attempts
        ],
        "result": a.result,
        "checkpoint": a.checkpoint,
        "created_ns": a.created_ns,
        "cancel_requested": a.cancel_requested,
        "budget_from": a.budget_from,
        "auth": a.auth,
        "session": a.session,
        "on_failure": a.on_failure.value,
        "ended_reason": a.ended_reason,
        "retry": None if a.retry is None else asdict(a.retry),
    }


#: The envelope's codec (msgspec: fields in declaration order, enums by value).
_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(Action)


def encode_action(action: Action) -> bytes:
    """Action → JSON envelope bytes (fields in declaration order; the same bytes as
    ``json.dumps(action_to_dict(action), separators=(",", ":"))`` for ASCII text, written by
    msgspec in a tenth of the time).

    Raises:
        ActionError: A field holds something JSON cannot (validate the action first).
    """
    try:
        return _ENCODER.encode(action)
    except (TypeError, ValueError, OverflowError) as err:
        raise ActionError(f"action {action.id} cannot be written as JSON: {err}") from err


def decode_action(data: bytes | str, *, limits: DecodeLimits | None = None) -> Action:
    """JSON envelope → validated Action.

    Raises:
        ActionError: Not JSON, too large for ``limits.max_action_bytes``, missing or mistyped
            fields (named with their path, e.g. ``$.attempts[0].executor``), or invalid values.
    """
    lim = limits or DEFAULT_LIMITS
    if len(data) > lim.max_action_bytes:
        raise ActionError(
            f"action envelope of {len(data)} bytes exceeds max_action_bytes {lim.max_action_bytes}"
        )
    try:
        action = _DECODER.decode(data)
    except msgspec.ValidationError as err:
        raise _malformed(err) from err
    except msgspec.DecodeError as err:
        raise ActionError(f"action envelope is not valid JSON: {err}") from err
    except RecursionError as err:
        raise ActionError("action envelope is nested too deeply") from err
    # an envelope no larger than the payload limit cannot hold an oversized payload
    return action.validate(check_payload=len(data) > MAX_PAYLOAD_BYTES)


def action_from_dict(d: Any, *, check_payload: bool = True) -> Action:
    """An already parsed JSON envelope (a dict) → validated Action (no JSON round trip).

    Args:
        check_payload: Measure the payload against :data:`MAX_PAYLOAD_BYTES` (skip only when
            the envelope's size already bounds it).

    Raises:
        ActionError: Missing or mistyped fields, or invalid values.
    """
    if not isinstance(d, dict) or "kind" not in d:
        raise ActionError("action envelope must be a JSON object with a kind")
    try:
        action = msgspec.convert(d, Action)
    except msgspec.ValidationError as err:
        raise _malformed(err) from err
    return action.validate(check_payload=check_payload)


def _malformed(err: msgspec.ValidationError) -> ActionError:
    if "missing required field `kind`" in str(err):
        return ActionError(f"action envelope must be a JSON object with a kind ({err})")
    return ActionError(f"action envelope is malformed: {err}")
