"""A fuzz pass over every sealed message of the queue protocol: requests (a planner's, an
executor's), replies, pushes, results and feedback. Each genuine message opens; truncated at
every length, sealed by a stranger, by a party without the role, moved to another channel
(a reply to another request, a push to another executor, a result of another action), with a
byte of its body changed, stale, or (requests) sent again or sealed before the queue started,
it is refused with its reason — never opened, never another exception."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from embodied_bus.actions.feedback import encode_feedback
from embodied_bus.security import AllowList, Refused, Role, Sealer, Trust, generate_private_key, public_entry
from embodied_bus.security.seal import WINDOW_S, RefuseReason, reply_channel

HOSTILE = Path(__file__).resolve().parents[1] / "data" / "hostile" / "sealed"
KEYS = {name: generate_private_key() for name in ("queue", "planner", "arm", "arm2", "stranger")}
ALLOW = AllowList(
    [
        public_entry("queue", KEYS["queue"], roles=(Role.QUEUE,)),
        public_entry("planner", KEYS["planner"], ["*"]),
        public_entry("arm", KEYS["arm"], roles=(Role.EXECUTOR,)),
        public_entry("arm2", KEYS["arm2"], roles=(Role.EXECUTOR,)),
    ]
)
SUBMIT = json.dumps({"op": "submit", "actions": [{"kind": "move", "payload": {"to": "bin"}}]}).encode()
TAKE = json.dumps(
    {"op": "take", "executor": {"name": "arm", "session": "s1"}, "kinds": ["move"], "labels": {}, "max": 1}
).encode()


@dataclass(frozen=True)
class Kind:
    """One sealed message type: who seals it, on which channel, who may, and a channel it
    must not be moved to."""

    name: str
    sealer: str
    channel: str
    body: bytes
    roles: frozenset[Role]
    other_channel: str
    wrong_role: str


REQUEST = Sealer(KEYS["planner"]).seal("request", SUBMIT)
KINDS = [
    Kind("planner request", "planner", "request", SUBMIT, frozenset({Role.PLANNER, Role.EXECUTOR}),
         "actions/result/x", "queue"),
    Kind("executor request", "arm", "request", TAKE, frozenset({Role.PLANNER, Role.EXECUTOR}),
         "actions/fb/x", "queue"),
    Kind("reply", "queue", reply_channel(REQUEST), b'{"r":"submitted","actions":[]}', frozenset({Role.QUEUE}),
         reply_channel(REQUEST + b" "), "planner"),
    Kind("push", "queue", "actions/assign/arm", b"[]", frozenset({Role.QUEUE}), "actions/assign/arm2", "arm"),
    Kind("result", "queue", "actions/result/a1", b'{"kind":"move","id":"a1"}', frozenset({Role.QUEUE}),
         "actions/result/a2", "planner"),
    Kind("feedback", "arm", "actions/fb/a1", encode_feedback("arm", 1, b'{"step":1}'),
         frozenset({Role.EXECUTOR}), "actions/fb/a2", "planner"),
]  # fmt: skip


def refused(reason: RefuseReason | None, trust: Trust, kind: Kind, data: bytes, **kw: object) -> None:
    with pytest.raises(Refused) as err:
        trust.open(kw.pop("channel", kind.channel), data, kind.roles, **kw)  # type: ignore[arg-type]
    assert reason is None or err.value.reason is reason, (kind.name, err.value)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_every_sealed_message_opens_only_as_its_sealer_sent_it(kind: Kind) -> None:
    trust = Trust(ALLOW)
    genuine = Sealer(KEYS[kind.sealer]).seal(kind.channel, kind.body)
    assert trust.open(kind.channel, genuine, kind.roles).body == kind.body
    rng = random.Random(kind.name)
    for cut in sorted(
        {*range(0, len(genuine), max(1, len(genuine) // 60)), *range(len(genuine) - 8, len(genuine))}
    ):
        refused(None, trust, kind, genuine[:cut])  # truncated: unsealed or a broken seal
    refused(RefuseReason.UNKNOWN_KEY, trust, kind, Sealer(KEYS["stranger"]).seal(kind.channel, kind.body))
    refused(RefuseReason.WRONG_ROLE, trust, kind, Sealer(KEYS[kind.wrong_role]).seal(kind.channel, kind.body))
    refused(RefuseReason.BAD_SIGNATURE, trust, kind, genuine, channel=kind.other_channel)
    start = genuine.index(b'"m":') + 4
    for _ in range(20):  # one byte of the message changed
        i = rng.randrange(start, len(genuine) - 1)
        flipped = genuine[:i] + bytes([genuine[i] ^ (1 << rng.randrange(7))]) + genuine[i + 1 :]
        if flipped != genuine:
            refused(None, trust, kind, flipped)
    t = json.loads(genuine)["t"]
    refused(RefuseReason.STALE, trust, kind, genuine, now_ns=t + int(WINDOW_S * 1e9) + 1)
    refused(RefuseReason.STALE, trust, kind, genuine, now_ns=t - int(WINDOW_S * 1e9) - 1)
    if kind.channel == "request":  # the queue opens each request once
        once = Trust(ALLOW)
        assert once.open("request", genuine, kind.roles, once=True).body == kind.body
        refused(RefuseReason.REPLAYED, once, kind, genuine, once=True)
        refused(RefuseReason.REPLAYED, Trust(ALLOW), kind, genuine, once=True, not_before_ns=t + 1)
    assert sum(trust.refused.values()) > 0


@pytest.mark.parametrize("path", sorted(HOSTILE.glob("*.json")), ids=lambda p: p.name)
def test_the_sealed_corpus_is_refused_with_every_key_known(path: Path) -> None:
    """The corpus's sealed messages against an allow-list that knows every party."""
    with pytest.raises(Refused):
        Trust(ALLOW).open("request", path.read_bytes(), [Role.PLANNER, Role.EXECUTOR, Role.QUEUE])
