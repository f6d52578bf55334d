"""Zenoh subscriptions and group membership through liveliness tokens."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import zenoh

from embodied_bus.engines.base import (
    EngineSubscriber,
    GroupMembership,
    MembershipCallback,
    MessageSink,
    hand_over_batch,
)
from embodied_bus.engines.zenoh.connection import ZenohConnection
from embodied_bus.engines.zenoh.shm import ShmPayload
from embodied_bus.engines.zenoh.tuning import LAZY_COPY_BYTES
from embodied_bus.errors import (
    BusConfigError,
    HeaderError,
)
from embodied_bus.model.batches import decode_batch_runs, is_batch
from embodied_bus.model.header import Header, decode_header

#: How long a group waits for a withdrawn member's token to answer as still alive, seconds.
GONE_CHECK_S = 1.0
#: How soon a group asks again after a withdrawn member's token still answered, seconds
#: (doubling each time, up to :data:`RECHECK_MAX_S`).
RECHECK_S = 0.25
RECHECK_MAX_S = 5.0


class ZenohSubscriber(EngineSubscriber):
    def __init__(self, engine: ZenohConnection, key: str, sink: MessageSink) -> None:
        deliver = sink.deliver
        reject = sink.reject

        def decoded(raw: bytes, sample: zenoh.Sample, what: str) -> Header | None:
            """The header, or None after counting the sample as malformed."""
            try:
                return decode_header(raw)
            except HeaderError as err:
                reject(HeaderError(f"{what} on {sample.key_expr}: {err}"), None)
                return None

        def on_sample(sample: zenoh.Sample) -> None:
            att = sample.attachment
            if att is None:
                reject(HeaderError(f"sample on {sample.key_expr} has no header attachment"), None)
                return
            raw_att = att.to_bytes()
            if is_batch(raw_att):
                body = sample.payload.to_bytes()
                hand_over_batch(sink, str(sample.key_expr), lambda: decode_batch_runs(raw_att, body), None)
                return
            header = decoded(raw_att, sample, "sample")
            if header is None:
                return
            payload = sample.payload
            size = len(payload)
            if size < LAZY_COPY_BYTES:
                deliver(header, payload.to_bytes(), None)
            else:
                # Copied when the application takes it, in its own thread: a large buffer is
                # then allocated and freed by one thread (no page-fault churn across threads),
                # and a sample dropped by drop_oldest is never copied at all.
                shm = payload.as_shm()
                deliver(header, payload if shm is None else ShmPayload(shm, size), None)

        self._sub = engine.session.declare_subscriber(key, on_sample)
        self._closed = False

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._sub.undeclare()  # type: ignore[no-untyped-call]
            except zenoh.ZError:
                pass


class ZenohMulti(EngineSubscriber):
    def __init__(self, subs: list[ZenohSubscriber]) -> None:
        self._subs = subs

    async def close(self) -> None:
        for sub in self._subs:
            await sub.close()


class ZenohGroup(GroupMembership):
    """Membership through liveliness tokens ``eb/<ns>/@group/<group>/<member>/<value>``."""

    def __init__(self, engine: ZenohConnection, group: str, on_change: MembershipCallback) -> None:
        self._engine = engine
        self._prefix = prefix = f"eb/{engine.settings.namespace}/@group/{group}"
        self._members: dict[str, str] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._token: Any = None
        self._on_change = on_change
        #: Members that left (a refresh does not add them back), with when.
        self._left: dict[str, float] = {}
        n = len(prefix.split("/"))

        def on_token(sample: zenoh.Sample) -> None:
            key = str(sample.key_expr)
            parts = key.split("/")
            if len(parts) != n + 2:
                return
            mid, val = parts[n], parts[n + 1]
            if sample.kind != zenoh.SampleKind.PUT:
                # anyone can declare a copy of a member's token and withdraw it: a member has
                # left only once no token of its key is alive
                self._confirm_gone(key, mid, val, on_change)
                return
            with self._lock:
                self._members[mid] = val
                self._left.pop(mid, None)
            on_change(mid, val, True)

        self._sub = engine.session.liveliness().declare_subscriber(f"{prefix}/**", on_token, history=True)

    def _confirm_gone(
        self, key: str, mid: str, val: str, on_change: MembershipCallback, tries: int = 0
    ) -> None:
        """Ask whether a token of ``key`` is still alive; if none answers, ``mid`` has left
        (``tries``: how many times a token answered already)."""
        alive = [False]

        def on_reply(reply: zenoh.Reply) -> None:
            if reply.ok is not None:
                alive[0] = True

        def on_done() -> None:
            with self._lock:
                if self._closed or self._members.get(mid) != val:
                    return
                if not alive[0]:
                    del self._members[mid]
                    self._left[mid] = time.monotonic()
            if alive[0]:
                # a token still answers: a copy was withdrawn, or the answer is not yet up to
                # date with a member that died; look again until it is gone
                delay_s = min(RECHECK_S * 2**tries, RECHECK_MAX_S)
                timer = threading.Timer(delay_s, self._confirm_gone, (key, mid, val, on_change, tries + 1))
                timer.daemon = True
                timer.start()
                return
            on_change(mid, val, False)

        try:
            self._engine.session.liveliness().get(
                key, zenoh.handlers.Callback(on_reply, on_done, indirect=False), timeout=GONE_CHECK_S
            )
        except zenoh.ZError:  # the session is closing
            on_done()

    def members(self) -> dict[str, str]:
        with self._lock:
            return dict(self._members)

    async def refresh(self) -> None:
        """A liveliness query of the group: members whose token answers and that this view
        lacks are added (and reported to ``on_change``)."""
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        found: list[str] = []

        def on_reply(reply: zenoh.Reply) -> None:
            if reply.ok is not None:
                found.append(str(reply.ok.key_expr))

        def on_done() -> None:
            loop.call_soon_threadsafe(done.set)

        try:
            handler = zenoh.handlers.Callback(on_reply, on_done, indirect=False)
            self._engine.session.liveliness().get(f"{self._prefix}/**", handler, timeout=GONE_CHECK_S)
        except zenoh.ZError:  # the session is closing
            return
        await done.wait()
        n = len(self._prefix.split("/"))
        for key in found:
            parts = key.split("/")
            if len(parts) != n + 2:
                continue
            mid, val = parts[n], parts[n + 1]
            with self._lock:
                # a member that left comes back only through its own new token (a query can
                # still be answered for a member that just died)
                gone = mid in self._left
                new = not self._closed and not gone and self._members.get(mid) != val
                if new:
                    self._members[mid] = val
            if new:
                self._on_change(mid, val, True)

    async def announce(self, member: str, value: str) -> None:
        for what, v in (("member", member), ("value", value)):
            if not v or any(c in v for c in "/*$#?@"):
                raise BusConfigError(f"invalid group {what} {v!r}")
        self._token = self._engine.session.liveliness().declare_token(f"{self._prefix}/{member}/{value}")

    async def leave(self) -> None:
        with self._lock:
            self._closed = True
        try:
            if self._token is not None:
                self._token.undeclare()
            self._sub.undeclare()  # type: ignore[no-untyped-call]
        except zenoh.ZError:
            pass
