"""Records of the state log and of reply messages: a message is a JSON array of
``{"k": action id, "e": event, "d": JSON data}``; records written together share a message."""

from __future__ import annotations

import enum
import logging

import msgspec

from embodied_bus.actions.model import Action, ActionError
from embodied_bus.actions.policy import RetryPolicy

__all__ = [
    "STATE_BATCH_MAX_BYTES",
    "STATE_BATCH_MAX_RECORDS",
    "Event",
    "Record",
    "chunks",
    "decode_policy",
    "encode_policy",
    "encode_record",
    "parse_records",
    "parse_snapshot",
]

_log = logging.getLogger("embodied_bus.actions.pulsar")

#: Most records in one state-log or reply message.
STATE_BATCH_MAX_RECORDS = 500
#: Most bytes of records gathered into one message (a larger record goes alone), well under
#: Pulsar's default message size limit (``maxMessageSize``, 5 MiB).
STATE_BATCH_MAX_BYTES = 1 << 20


class Event(str, enum.Enum):
    """What a record says."""

    #: ``d``: the action's envelope after a change.
    SNAPSHOT = "snapshot"
    #: ``d``: the envelope of a dead letter given a fresh budget.
    REQUEUE = "requeue"
    #: A cancel was asked for (``d``: null).
    CANCEL = "cancel"
    #: ``d``: ids of dead letters deleted.
    PURGE = "purge"
    #: ``d``: ``[attempt, ok, reason]`` reported by the executor of an attempt closed as lost.
    LATE = "late"
    #: ``d``: a marker token (waited for by :meth:`StateLog.sync`).
    SYNC = "sync"
    #: A step of a session was put on its priority topic (``d``: null): it may run.
    RELEASE = "release"
    #: ``d``: the reply topic of the planner of a session step (whoever releases it tells it).
    ROUTE = "route"
    #: ``d``: the action's envelope (reply topics: an ended action).
    RESULT = "result"
    #: ``d``: feedback JSON (reply topics).
    FEEDBACK = "fb"
    #: ``d``: the retry policy of action kind ``k`` ("" for kinds without their own), every
    #: field of :class:`~embodied_bus.actions.policy.RetryPolicy`.
    POLICY = "policy"


def encode_record(key: str, event: Event, data: bytes) -> bytes:
    """One record (``data``: JSON)."""
    return b'{"k":%s,"e":"%s","d":%s}' % (msgspec.json.encode(key), event.value.encode(), data or b"null")


class Record(msgspec.Struct):
    """One record; ``d`` stays JSON until it is needed."""

    k: str
    e: str
    d: msgspec.Raw = msgspec.Raw(b"null")


_RECORDS = msgspec.json.Decoder(list[Record])
_RAW_ITEMS = msgspec.json.Decoder(list[msgspec.Raw])
_ONE_RECORD = msgspec.json.Decoder(Record)
_SNAPSHOT = msgspec.json.Decoder(Action)


def parse_records(data: bytes) -> list[Record]:
    """The records of a message; a malformed record is logged and skipped.

    Raises:
        ActionError: The message is not a JSON array of records.
    """
    try:
        return _RECORDS.decode(data)
    except msgspec.ValidationError:
        pass  # a malformed record among them: read the others one by one
    except (msgspec.DecodeError, RecursionError) as err:
        raise ActionError(f"a state-log or reply message is not JSON: {err!r}") from err
    try:
        items = _RAW_ITEMS.decode(data)
    except (msgspec.ValidationError, RecursionError) as err:
        raise ActionError("a state-log or reply message must be a JSON array of records") from err
    out = []
    for item in items:
        try:
            out.append(_ONE_RECORD.decode(item))
        except msgspec.ValidationError as err:
            _log.warning("ignored a malformed record %.80r: %s", bytes(item), err)
    return out


def parse_snapshot(raw: msgspec.Raw | bytes) -> Action:
    """The action of a snapshot record.

    Raises:
        ActionError: It is not a valid action envelope.
    """
    try:
        return _SNAPSHOT.decode(raw).validate(check_payload=False)
    except msgspec.ValidationError as err:
        raise ActionError(f"action envelope is malformed: {err}") from err
    except (msgspec.DecodeError, RecursionError) as err:
        raise ActionError(f"action envelope is not valid JSON: {err!r}") from err


_POLICY = msgspec.json.Decoder(RetryPolicy)


def encode_policy(policy: RetryPolicy) -> bytes:
    """The data of a policy record."""
    return msgspec.json.encode(policy)


def decode_policy(raw: msgspec.Raw | bytes) -> RetryPolicy:
    """The policy of a policy record.

    Raises:
        ActionError: It is not a valid retry policy.
    """
    try:
        return _POLICY.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as err:
        raise ActionError(f"retry policy record is malformed: {err}") from err


def chunks(records: list[bytes]) -> list[list[bytes]]:
    """Split records into message-sized runs (:data:`STATE_BATCH_MAX_RECORDS` and
    :data:`STATE_BATCH_MAX_BYTES`; a record larger than the byte limit goes alone)."""
    out: list[list[bytes]] = []
    run: list[bytes] = []
    size = 0
    for rec in records:
        if run and (size + len(rec) > STATE_BATCH_MAX_BYTES or len(run) >= STATE_BATCH_MAX_RECORDS):
            out.append(run)
            run, size = [], 0
        run.append(rec)
        size += len(rec)
    if run:
        out.append(run)
    return out
