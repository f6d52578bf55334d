"""Serve the bus live to Foxglove (or any client of the Foxglove WebSocket protocol).

Channels, advertised as their data first appears:

* ``/<stream>``: every stream, as its ROS 2 message where it has one (see
  :mod:`embodied_bus.viz.messages`), with the sensor stamp as the message time;
* ``/fused/<stream>``: the members of each fused frame, and ``/fused/status`` (JSON): pipeline,
  bucket, reference stamp, complete, missing, late count, skew per member, what it waited on;
* ``/actions/queue`` (JSON): backlog per kind and priority, in flight, totals, and the latest
  outcomes with their attempts;
* ``/bus/streams`` (JSON): the stream statistics of ``embodied-bus top`` and what the view
  forwarded, dropped and could not show per channel.

Only channels a viewer subscribes to are encoded; a viewer that reads slowly loses its oldest
messages (per viewer, in the server) and a view that falls behind keeps the newest items per
channel (counted drops), so watching never slows the bus.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from embodied_bus.actions import Action, ActionQueue
from embodied_bus.bus import Bus
from embodied_bus.errors import BusConfigError, EmbodiedBusError, EncodingError
from embodied_bus.fusion.codec import FRAME_ENCODING, decode_frame, frame_summary
from embodied_bus.model.qos import Backpressure, SubscriptionOptions
from embodied_bus.model.sample import Sample
from embodied_bus.streams.subscriber import Subscription
from embodied_bus.viz.channels import PendingLimits, ViewChannel
from embodied_bus.viz.messages import ChannelSchema, MessageView, json_schema, view_for

__all__ = ["DEFAULT_VIEW_PORT", "FRAMES_PREFIX", "LiveView", "ViewOptions"]

_log = logging.getLogger("embodied_bus.viz")

#: The port Foxglove's "Open connection" dialog proposes.
DEFAULT_VIEW_PORT = 8765
#: Streams carrying fused frames (``frames/<pipeline>``).
FRAMES_PREFIX = "frames/"
#: Outcomes kept for ``/actions/queue``.
RECENT_OUTCOMES = 20

_STATUS_SCHEMA = json_schema(
    "embodied_bus/FrameStatus",
    {
        "type": "object",
        "properties": {
            "pipeline": {"type": "string"},
            "bucket": {"type": "integer"},
            "reference_stamp_ns": {"type": "integer"},
            "complete": {"type": "boolean"},
            "missing": {"type": "array", "items": {"type": "string"}},
            "late_count": {"type": "integer"},
            "max_skew_ms": {"type": ["number", "null"]},
            "waited_on": {"type": ["string", "null"]},
            "skew_ms": {"type": "object"},
            "members": {"type": "object"},
        },
    },
)
_QUEUE_SCHEMA = json_schema(
    "embodied_bus/ActionQueue",
    {
        "type": "object",
        "properties": {
            "available": {"type": "boolean"},
            "queued": {"type": "integer"},
            "in_flight": {"type": "integer"},
            "retrying": {"type": "integer"},
            "dead_letters": {"type": "integer"},
            "waiting_in_session": {"type": "integer"},
            "backlog": {"type": "object"},
            "totals": {"type": "object"},
            "recent": {"type": "array"},
        },
    },
)
_STATS_SCHEMA = json_schema(
    "embodied_bus/BusStreams",
    {"type": "object", "properties": {"streams": {"type": "array"}, "view": {"type": "object"}}},
)


@dataclass(frozen=True, slots=True)
class ViewOptions:
    """What a :class:`LiveView` serves, and where.

    Attributes:
        host: Interface to listen on (``0.0.0.0`` to be seen from other machines).
        port: TCP port (0: any free port; see :attr:`LiveView.port`).
        streams: Streams to show (None: every stream of the namespace).
        pipelines: Fusion pipelines whose frames to show (None: every one).
        client_backlog: Messages the server buffers per viewer before it drops that viewer's
            oldest.
        pending: What each channel keeps while the view is behind.
        stats_interval_s: Period of ``/bus/streams`` and ``/actions/queue``, seconds.
        actions_timeout_s: Longest wait for the action queue's backlog, seconds.
    """

    host: str = "127.0.0.1"
    port: int = DEFAULT_VIEW_PORT
    streams: tuple[str, ...] | None = None
    pipelines: tuple[str, ...] | None = None
    client_backlog: int = 256
    pending: PendingLimits = field(default_factory=PendingLimits)
    stats_interval_s: float = 1.0
    actions_timeout_s: float = 2.0


class LiveView:
    """Serves a bus over the Foxglove WebSocket protocol; use as an async context manager.

    Args:
        bus: The bus to show (its namespace).
        options: What to serve and where.
        queue: The action queue to show on ``/actions/queue`` (None: no action channel).
    """

    def __init__(
        self, bus: Bus, options: ViewOptions | None = None, *, queue: ActionQueue | None = None
    ) -> None:
        self.bus = bus
        self.options = options or ViewOptions()
        self._queue = queue
        self._channels: dict[str, ViewChannel] = {}
        self._views: dict[str, MessageView] = {}
        self._recent: deque[dict[str, Any]] = deque(maxlen=RECENT_OUTCOMES)
        self._latest_stamp_ns = 0
        self._server: Any = None
        self._context: Any = None
        self._sub: Subscription | None = None
        self._tasks: list[asyncio.Task[None]] = []
        #: Frames that could not be decoded.
        self.malformed_frames = 0

    @property
    def port(self) -> int:
        """The TCP port viewers connect to."""
        if self._server is None:
            raise RuntimeError("the view is not started")
        return int(self._server.port)

    @property
    def url(self) -> str:
        """``ws://host:port`` for Foxglove's "Open connection"."""
        host = "localhost" if self.options.host in ("127.0.0.1", "0.0.0.0", "::") else self.options.host
        return f"ws://{host}:{self.port}"

    async def start(self) -> LiveView:
        """Start the server and subscribe to the bus.

        Raises:
            EmbodiedBusError: The port cannot be served.
        """
        try:
            import foxglove
        except ImportError as err:
            raise BusConfigError(
                "the live view needs foxglove-sdk: pip install 'embodied_bus[view]'"
            ) from err

        o = self.options
        self._context = foxglove.Context()
        try:
            self._server = foxglove.start_server(
                name=f"embodied_bus {self.bus.namespace}",
                host=o.host,
                port=o.port,
                context=self._context,
                message_backlog_size=o.client_backlog,
            )
        except Exception as err:
            raise EmbodiedBusError(f"cannot serve the live view on {o.host}:{o.port}: {err}") from err
        targets: tuple[str, ...] | None = None
        if o.streams is not None:
            frames = tuple(FRAMES_PREFIX + p for p in o.pipelines or ())
            targets = tuple(o.streams) + frames
        opts = SubscriptionOptions(capacity=4096, backpressure=Backpressure.DROP_OLDEST)
        self._sub = await self.bus.subscribe(targets, options=opts)
        self._tasks.append(asyncio.create_task(self._forward(self._sub)))
        self._tasks.append(asyncio.create_task(self._report()))
        if self._queue is not None:
            await self._queue.watch_results(self._ended)
        return self

    async def __aenter__(self) -> LiveView:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop serving and unsubscribe; idempotent."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._sub is not None:
            await self._sub.close()
            self._sub = None
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()
        if self._server is not None:
            self._server.stop()
            self._server = None

    # -- channels -------------------------------------------------------------------------

    def channel(self, topic: str, schema: ChannelSchema) -> ViewChannel:
        """The channel of a topic, advertised on first use."""
        ch = self._channels.get(topic)
        if ch is None:
            ch = ViewChannel(topic, schema, self._context, self.options.pending, self._tell_viewers)
            self._channels[topic] = ch
        return ch

    def _tell_viewers(self, topic: str, why: str) -> None:
        import foxglove

        if self._server is not None:
            self._server.publish_status(f"cannot show {topic}: {why}", foxglove.StatusLevel.Warning, id=topic)

    def counts(self) -> dict[str, dict[str, int]]:
        """Per channel topic: forwarded, dropped, failed, unwatched."""
        return {t: _as_dict(ch) for t, ch in sorted(self._channels.items())}

    # -- bus → channels -------------------------------------------------------------------

    async def _forward(self, sub: Subscription) -> None:
        idle_s = 0.5
        rate = self.options.pending.max_rate_hz
        while True:
            waiting = any(ch.pending for ch in self._channels.values())
            try:  # what waits for the rate limit goes out at the next interval
                batch = await sub.recv_many(timeout_s=1.0 / rate if waiting and rate > 0 else idle_s)
            except TimeoutError:
                batch = []
            for sample in batch:
                self._route(sample)
            for ch in list(self._channels.values()):
                if ch.pending:
                    ch.flush(time.monotonic())
                    await asyncio.sleep(0)  # let the subscription take what arrived meanwhile

    def _route(self, sample: Sample) -> None:
        h = sample.header
        if h.stamp_ns > self._latest_stamp_ns:
            self._latest_stamp_ns = h.stamp_ns
        if h.encoding == FRAME_ENCODING and h.stream.startswith(FRAMES_PREFIX):
            pipeline = h.stream[len(FRAMES_PREFIX) :]
            if self.options.pipelines is None or pipeline in self.options.pipelines:
                self._frame(pipeline, sample)
            return
        self._show(f"/{h.stream}", sample)

    def _show(self, topic: str, sample: Sample) -> None:
        view = self._views.get(topic)
        if view is None:
            view = self._views[topic] = view_for(sample.header)  # chosen once per channel
        encode = view.encode
        self.channel(topic, view.schema).offer(
            sample.header.stamp_ns, len(sample.payload), lambda: encode(sample)
        )

    def _frame(self, pipeline: str, sample: Sample) -> None:
        status = self.channel("/fused/status", _STATUS_SCHEMA)
        try:
            frame = decode_frame(sample.payload)
        except EncodingError as err:
            self.malformed_frames += 1
            _log.warning("malformed frame on %s: %s", sample.header.stream, err)
            return
        for name, members in frame.members.items():  # decoding is cheap: payloads are views
            topic = f"/fused/{name}"
            for m in members:
                self._show(topic, m.sample)
        emitted_ns = time.time_ns()

        def encode() -> bytes:
            doc = frame_summary(frame, emitted_ns)
            doc["pipeline"] = pipeline
            doc["skew_ms"] = {k: [x["skew_ms"] for x in v] for k, v in doc["members"].items()}
            return json.dumps(doc).encode()

        status.offer(frame.reference_stamp_ns, 512, encode)

    # -- periodic JSON channels -------------------------------------------------------------

    def _now_ns(self) -> int:
        """The bus's event time: the newest sensor stamp seen (a replayed recording's clock),
        the wall clock before any sample."""
        return self._latest_stamp_ns or time.time_ns()

    async def _report(self) -> None:
        stats = self.channel("/bus/streams", _STATS_SCHEMA)
        queue = self.channel("/actions/queue", _QUEUE_SCHEMA) if self._queue is not None else None
        while True:
            await asyncio.sleep(self.options.stats_interval_s)
            if stats.watched and self._sub is not None:
                doc = {"streams": _stream_rows(self._sub), "view": self.view_stats()}
                stats.offer(self._now_ns(), 4096, lambda doc=doc: json.dumps(doc).encode())  # type: ignore[misc]
                stats.flush(time.monotonic())
            if queue is not None and queue.watched:
                qdoc = await self._queue_doc()
                queue.offer(self._now_ns(), 4096, lambda qdoc=qdoc: json.dumps(qdoc).encode())  # type: ignore[misc]
                queue.flush(time.monotonic())

    def view_stats(self) -> dict[str, Any]:
        """What the view did: per channel counts, the subscription's drops, malformed frames."""
        sub = self._sub.counters() if self._sub is not None else {}
        return {
            "channels": self.counts(),
            "bus_dropped": sub.get("dropped", 0),
            "malformed": sub.get("malformed", 0) + self.malformed_frames,
        }

    async def _queue_doc(self) -> dict[str, Any]:
        assert self._queue is not None
        try:
            backlog = await asyncio.wait_for(self._queue.backlog(), self.options.actions_timeout_s)
        except (EmbodiedBusError, TimeoutError) as err:
            return {"available": False, "error": str(err) or type(err).__name__, "recent": list(self._recent)}
        columns = backlog.column_totals()
        return {
            "available": True,
            "queued": columns["queued"],
            "in_flight": columns["leased"],
            "retrying": columns["retrying"],
            "dead_letters": columns["dead"],
            "waiting_in_session": columns["blocked"],
            "backlog": backlog.as_dict()["backlog"],
            "totals": dict(backlog.totals),
            "redeliveries": backlog.redeliveries,
            "recent": list(self._recent),
        }

    def _ended(self, action: Action) -> None:
        self._recent.appendleft(
            {
                "id": action.id,
                "kind": action.kind,
                "priority": action.priority,
                "session": action.session,
                "status": action.status.value,
                "attempts": [
                    {"number": t.number, "executor": t.executor, "outcome": t.outcome, "reason": t.reason}
                    for t in action.attempts
                ],
            }
        )


def _as_dict(ch: ViewChannel) -> dict[str, int]:
    c = ch.counts
    return {"forwarded": c.forwarded, "dropped": c.dropped, "failed": c.failed, "unwatched": c.unwatched}


def _stream_rows(sub: Subscription) -> list[dict[str, object]]:
    return [sub.stats[k].as_dict() for k in sorted(sub.stats) if not k.startswith(FRAMES_PREFIX)]
