"""Replay recordings into the bus (or another :class:`~embodied_bus.replay.targets.ReplayTarget`)
with faithful timing, or as fast as possible."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from embodied_bus.bus import Bus
from embodied_bus.errors import BusConfigError
from embodied_bus.model.clock import BucketClock
from embodied_bus.replay.reader import (
    RecordedMessage,
    RecordingInfo,
    SkippedTopic,
    read_recording,
    recording_info,
)
from embodied_bus.replay.targets import (
    BusTarget,
    ReplayControl,
    ReplayPublisher,
    ReplayTarget,
    TopicNotReplayable,
)

__all__ = ["SPIN_S", "ReplayOptions", "ReplaySummary", "replay"]

_log = logging.getLogger("embodied_bus.replay")

#: The last stretch before a message's due time is spent spinning, not sleeping (seconds).
SPIN_S = 0.002
#: Messages read ahead of the replay clock.
READ_AHEAD = 4096
#: GIL switch interval while a timed replay runs, seconds (Python's default is 0.005).
TIMED_SWITCH_INTERVAL_S = 0.0005
#: At most this long is spent reading ahead before the clock starts (seconds).
PRIME_S = 3.0


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    """How to replay.

    Attributes:
        rate: Speed factor (1.0 = recorded timing).
        fast: Ignore timing, publish as fast as possible in log-time order.
        loop: Start over at the end until stopped.
        start_s: Skip the first seconds of the recording.
        duration_s: Replay at most this many seconds of the recording.
        topics: Only these topics.
        mapping: Topic → stream name overrides (default: the topic without its leading ``/``).
        stamp: ``header`` (sensor stamps; zero stamps fall back to log time with a flag) or
            ``log`` (the recorder's clock).
        clock: Bucket clock of the published streams.
        wait_subscribers_s: Before the first message, wait up to this long for a subscriber on
            every replayed topic (0: start at once; Zenoh drops what nobody receives).
    """

    rate: float = 1.0
    fast: bool = False
    loop: bool = False
    start_s: float = 0.0
    duration_s: float | None = None
    topics: tuple[str, ...] | None = None
    mapping: Mapping[str, str] = field(default_factory=dict)
    stamp: str = "header"
    clock: BucketClock = field(default_factory=BucketClock)
    wait_subscribers_s: float = 0.0

    def __post_init__(self) -> None:
        if self.rate <= 0:
            raise BusConfigError(f"replay rate must be positive, got {self.rate}")
        if self.stamp not in ("header", "log"):
            raise BusConfigError(f"replay stamp must be 'header' or 'log', got {self.stamp!r}")
        if self.start_s < 0 or (self.duration_s is not None and self.duration_s <= 0):
            raise BusConfigError("replay start must be >= 0 and duration > 0")
        if self.wait_subscribers_s < 0:
            raise BusConfigError("replay wait for subscribers: seconds must be >= 0")


@dataclass
class ReplaySummary:
    """What a replay did."""

    messages: Counter[str] = field(default_factory=Counter)
    skipped: dict[str, str] = field(default_factory=dict)
    stamp_fallbacks: int = 0
    planned_s: float = 0.0
    topics: dict[str, str] = field(default_factory=dict)
    timing_errors_ms: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    recording_s: float = 0.0
    #: Topics without a subscriber when a replay that waited for them started.
    no_subscriber: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary (timing error percentiles in ms)."""
        errs = np.abs(np.asarray(self.timing_errors_ms)) if self.timing_errors_ms else None
        return {
            "messages": dict(sorted(self.messages.items())),
            "total": sum(self.messages.values()),
            "skipped": self.skipped,
            "no_subscriber": self.no_subscriber,
            "stamp_fallbacks": self.stamp_fallbacks,
            "recording_s": round(self.recording_s, 3),
            "wall_s": round(self.wall_s, 3),
            "timing_error_p50_ms": None if errs is None else round(float(np.percentile(errs, 50)), 3),
            "timing_error_p99_ms": None if errs is None else round(float(np.percentile(errs, 99)), 3),
        }


async def replay(
    bus: Bus | ReplayTarget,
    paths: Sequence[str | Path],
    options: ReplayOptions | None = None,
    *,
    stop: asyncio.Event | None = None,
    progress: Callable[[float, int], None] | None = None,
    control: ReplayControl | None = None,
) -> ReplaySummary:
    """Publish the messages of recordings on the bus (or another target).

    Args:
        bus: Where to publish: a bus (one stream per topic, encoding ``cdr:<type>``) or a
            :class:`~embodied_bus.replay.targets.ReplayTarget`.
        paths: Recordings (see :func:`read_recording`).
        options: Timing, selection and mapping.
        stop: Set to end early.
        progress: Called with (fraction of the recording done, messages so far).
        control: Pause and resume a timed replay while it runs.

    Returns:
        Counts per topic, skipped topics with reasons, timing errors.
    """
    opts = options or ReplayOptions()
    target: ReplayTarget = BusTarget(bus) if isinstance(bus, Bus) else bus
    summary = ReplaySummary()
    pubs: dict[str, ReplayPublisher] = {}
    if not opts.fast or opts.wait_subscribers_s > 0:
        # declared up front: no set-up cost on the clock, subscribers can match first (fast
        # without waiting: the reader reports the extent when it opens, one open, not two)
        _plan(summary, opts, recording_info(paths))
        for topic, msgtype in summary.topics.items():  # declare up front: no setup cost on the clock
            if opts.topics is None or topic in opts.topics:
                pub = await _publisher(target, opts, topic, msgtype, "", summary)
                if pub is not None:
                    pubs[topic] = pub
        if opts.wait_subscribers_s > 0:
            await _wait_subscribers(pubs, opts.wait_subscribers_s, summary)
    t_wall0 = time.monotonic()
    # Timed replay shares the GIL with the read-ahead thread: hand it over every 0.5 ms instead
    # of every 5 ms so a message falls due while the reader parses (restored afterwards).
    switch = sys.getswitchinterval()
    if not opts.fast:
        sys.setswitchinterval(min(switch, TIMED_SWITCH_INTERVAL_S))
    try:
        while True:
            if opts.fast:
                loop = asyncio.get_running_loop()
                await asyncio.to_thread(_fast_pass, target, loop, paths, opts, summary, pubs, stop, progress)
            else:
                await _one_pass(target, paths, opts, summary, pubs, stop, progress, control)
            if not opts.loop or (stop is not None and stop.is_set()):
                break
    finally:
        sys.setswitchinterval(switch)
    for p in pubs.values():
        await p.flush()
    summary.wall_s = time.monotonic() - t_wall0
    return summary


async def _wait_subscribers(
    pubs: dict[str, ReplayPublisher], timeout_s: float, summary: ReplaySummary
) -> None:
    """Wait (together, at most ``timeout_s``) for a subscriber on every topic; name the others."""
    topics = list(pubs)
    matched = await asyncio.gather(*(pubs[t].wait_for_subscribers(timeout_s) for t in topics))
    summary.no_subscriber = [t for t, ok in zip(topics, matched, strict=True) if not ok]
    if summary.no_subscriber:
        _log.warning(
            "no subscriber within %g s for %s: replaying anyway", timeout_s, ", ".join(summary.no_subscriber)
        )


_END = object()
#: How long a wait for the reader thread's next message lasts before the thread is checked
#: (a reader that died without a word must not keep the replay, or a worker thread, waiting
#: for good), seconds.
READ_WAIT_S = 0.5


def _get_from_reader(q: queue.Queue[Any], reader: threading.Thread) -> Any:
    """The reader thread's next item (in a worker thread), waiting :data:`READ_WAIT_S` at a
    time; ``_END`` if the reader has stopped and left nothing."""
    while True:
        alive = reader.is_alive()  # before the wait: what it put before it ended is then seen
        try:
            return q.get(timeout=READ_WAIT_S)
        except queue.Empty:
            if not alive:
                return _END


def _put_unless_cancelled(q: queue.Queue[Any], item: Any, cancelled: threading.Event) -> bool:
    """Queue ``item`` from a reader thread, waiting for room; False once the consumer has gone
    away (``cancelled``)."""
    while not cancelled.is_set():
        try:
            q.put(item, timeout=0.2)
            return True
        except queue.Full:
            continue
    return False


async def _read_ahead(
    paths: Sequence[str | Path], topics: tuple[str, ...] | None, opts: ReplayOptions | None = None
) -> AsyncGenerator[RecordedMessage | SkippedTopic, None]:
    """Read (and decompress, convert) in a named thread, ahead of the replay clock.

    The reader stops at the end of the replayed window, and the queue is filled before the
    clock starts: a window of up to :data:`READ_AHEAD` messages is replayed with no reading
    at all competing for the GIL.
    """
    q: queue.Queue[Any] = queue.Queue(maxsize=READ_AHEAD)
    cancelled = threading.Event()
    start_ns = int(opts.start_s * 1e9) if opts else 0
    span_ns = int(opts.duration_s * 1e9) if opts and opts.duration_s is not None else None

    def put(item: Any) -> bool:
        return _put_unless_cancelled(q, item, cancelled)

    def produce() -> None:
        first_log: int | None = None
        try:
            for item in read_recording(paths, topics=topics, decode=False):
                last = False
                if span_ns is not None and isinstance(item, RecordedMessage):
                    if first_log is None:
                        first_log = item.log_time_ns + start_ns
                    last = item.log_time_ns - first_log > span_ns  # the consumer stops on it
                if not put(item) or last:
                    return
        except BaseException as err:  # re-raised on the asyncio side
            put(err)
            return
        put(_END)

    th = threading.Thread(target=produce, name="eb-replay-reader", daemon=True)
    th.start()
    # Prime the queue before the replay clock starts, so the first seconds are on time too.
    deadline = time.monotonic() + PRIME_S
    while not q.full() and th.is_alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    try:
        while True:
            try:
                item = q.get_nowait()
            except queue.Empty:
                # bounded waits: a worker thread never stays blocked on a reader that is gone
                item = await asyncio.to_thread(_get_from_reader, q, th)
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        cancelled.set()


def _batches_ahead(
    items: Iterator[Any], batch: int = 256, depth: int = 8
) -> Generator[list[Any], None, None]:
    """Run ``items`` in a named thread and yield its items in lists of up to ``batch``.

    ``--fast`` uses it so that reading (bz2/lz4 decompression releases the GIL) overlaps
    publishing. Closing the returned generator stops the thread; an exception in the reader is
    re-raised here.
    """
    q: queue.Queue[Any] = queue.Queue(maxsize=depth)
    cancelled = threading.Event()

    def put(item: Any) -> bool:
        return _put_unless_cancelled(q, item, cancelled)

    def produce() -> None:
        chunk: list[Any] = []
        try:
            for item in items:
                chunk.append(item)
                if len(chunk) >= batch:
                    if not put(chunk):
                        return
                    chunk = []
        except BaseException as err:  # re-raised in the consumer
            if chunk:
                put(chunk)
            put(err)
            return
        finally:
            close = getattr(items, "close", None)
            if close is not None and cancelled.is_set():
                close()
        if chunk:
            put(chunk)
        put(_END)

    th = threading.Thread(target=produce, name="eb-replay-reader", daemon=True)
    th.start()
    try:
        while True:
            got = q.get()
            if got is _END:
                return
            if isinstance(got, BaseException):
                raise got
            yield got
    finally:
        cancelled.set()
        th.join(5.0)


async def _publisher(
    target: ReplayTarget, opts: ReplayOptions, topic: str, msgtype: str, frame_id: str, summary: ReplaySummary
) -> ReplayPublisher | None:
    """The topic's publisher; None (and the topic skipped, with the reason) if the target
    cannot carry it."""
    if topic in summary.skipped:
        return None
    try:
        return await target.publisher(
            topic, msgtype, frame_id, stream=opts.mapping.get(topic, ""), clock=opts.clock
        )
    except TopicNotReplayable as err:
        summary.skipped[topic] = str(err)
        return None


def _plan(summary: ReplaySummary, opts: ReplayOptions, info: RecordingInfo) -> None:
    span = info.end_ns - info.start_ns - int(opts.start_s * 1e9)
    if opts.duration_s is not None:
        span = min(span, int(opts.duration_s * 1e9))
    summary.planned_s = max(0.0, span / 1e9)
    summary.topics = dict(info.topics)


def _sample_stamp(m: RecordedMessage, opts: ReplayOptions) -> tuple[int, bool]:
    """The stamp to publish and whether it is a fallback (a zero header stamp → log time)."""
    if opts.stamp == "header" and m.stamp_ns:
        return m.stamp_ns, False
    return m.log_time_ns, opts.stamp == "header"


class _PastWindow(Exception):
    """A message beyond ``--duration``: the pass ends."""


class _Window:
    """Where a message falls in the replayed window (``--start`` / ``--duration``), shared by
    the fast and the timed pass."""

    def __init__(self, opts: ReplayOptions, summary: ReplaySummary) -> None:
        self._start_ns = int(opts.start_s * 1e9)
        self._span_ns = int(opts.duration_s * 1e9) if opts.duration_s is not None else None
        self._summary = summary
        self.first_log: int | None = None

    def place(self, m: RecordedMessage) -> int | None:
        """Nanoseconds since the window opened; None before it (raises _PastWindow after it)."""
        if self.first_log is None:
            self.first_log = m.log_time_ns + self._start_ns
        rel = m.log_time_ns - self.first_log
        if rel < 0:
            return None
        if self._span_ns is not None and rel > self._span_ns:
            raise _PastWindow
        self._summary.recording_s = max(self._summary.recording_s, rel / 1e9)
        return rel


def _fast_pass(
    target: ReplayTarget,
    loop: asyncio.AbstractEventLoop,
    paths: Sequence[str | Path],
    opts: ReplayOptions,
    summary: ReplaySummary,
    pubs: dict[str, ReplayPublisher],
    stop: asyncio.Event | None,
    progress: Callable[[float, int], None] | None,
) -> None:
    """``--fast``: read and publish in one worker thread, in log order, as fast as the engine
    accepts (no clock, no hand-offs between threads per message)."""
    window = _Window(opts, summary)
    reader = read_recording(
        paths, topics=opts.topics, decode=False, on_open=lambda info: _plan(summary, opts, info)
    )
    batches = _batches_ahead(reader)
    try:
        for batch in batches:
            if stop is not None and stop.is_set():
                return
            if not _publish_fast(target, loop, batch, opts, summary, pubs, window, progress):
                return
    finally:
        batches.close()


def _publish_fast(
    target: ReplayTarget,
    loop: asyncio.AbstractEventLoop,
    batch: list[RecordedMessage | SkippedTopic],
    opts: ReplayOptions,
    summary: ReplaySummary,
    pubs: dict[str, ReplayPublisher],
    window: _Window,
    progress: Callable[[float, int], None] | None,
) -> bool:
    """Publish one batch of ``--fast``; False once the replay window is past."""
    for item in batch:
        if isinstance(item, SkippedTopic):
            summary.skipped.setdefault(item.topic, f"{item.msgtype}: {item.reason}")
            continue
        m: RecordedMessage = item
        try:
            rel = window.place(m)
        except _PastWindow:
            return False
        if rel is None:
            continue
        pub = pubs.get(m.topic)
        if pub is None:
            made = asyncio.run_coroutine_threadsafe(
                _publisher(target, opts, m.topic, m.msgtype, m.frame_id, summary), loop
            ).result()
            if made is None:
                continue
            pub = pubs[m.topic] = made
        stamp, fallback = _sample_stamp(m, opts)
        summary.stamp_fallbacks += fallback
        pub.publish_from_thread(m.cdr, stamp_ns=stamp, frame_id=m.frame_id, stamp_fallback=fallback)
        summary.messages[m.topic] += 1
        if progress is not None and summary.messages[m.topic] % 64 == 0:
            done = rel / 1e9 / summary.planned_s if summary.planned_s > 0 else 1.0
            progress(min(1.0, done), sum(summary.messages.values()))
    return True


async def _one_pass(
    target: ReplayTarget,
    paths: Sequence[str | Path],
    opts: ReplayOptions,
    summary: ReplaySummary,
    pubs: dict[str, ReplayPublisher],
    stop: asyncio.Event | None,
    progress: Callable[[float, int], None] | None,
    control: ReplayControl | None,
) -> None:
    window = _Window(opts, summary)
    # closed here when the window ends early (not whenever the collector finalizes it): the
    # reader thread then stops at once
    async with contextlib.aclosing(_read_ahead(paths, opts.topics, opts)) as items:
        await _timed(items, target, opts, summary, pubs, stop, progress, window, control)


async def _timed(
    items: AsyncIterator[RecordedMessage | SkippedTopic],
    target: ReplayTarget,
    opts: ReplayOptions,
    summary: ReplaySummary,
    pubs: dict[str, ReplayPublisher],
    stop: asyncio.Event | None,
    progress: Callable[[float, int], None] | None,
    window: _Window,
    control: ReplayControl | None,
) -> None:
    """The body of :func:`_one_pass`: each message published when it falls due."""
    t0 = 0.0
    async for item in items:
        if stop is not None and stop.is_set():
            return
        if isinstance(item, SkippedTopic):
            summary.skipped.setdefault(item.topic, f"{item.msgtype}: {item.reason}")
            continue
        m: RecordedMessage = item
        if window.first_log is None:
            t0 = time.monotonic()
        try:
            rel = window.place(m)
        except _PastWindow:
            return
        if rel is None:
            continue
        pub = pubs.get(m.topic)
        if pub is None:
            made = await _publisher(target, opts, m.topic, m.msgtype, m.frame_id, summary)
            if made is None:
                continue
            pub = pubs[m.topic] = made
        due = t0 + rel / 1e9 / opts.rate  # the timed pass (--fast has its own)
        if control is not None:
            t0, due = await _wait_paused(control, t0, due)
        else:
            await _sleep_until(due)
        summary.timing_errors_ms.append((time.monotonic() - due) * 1e3)
        stamp, fallback = _sample_stamp(m, opts)
        summary.stamp_fallbacks += fallback
        await pub.publish(m.cdr, stamp_ns=stamp, frame_id=m.frame_id, stamp_fallback=fallback)
        target.played(m.log_time_ns)
        summary.messages[m.topic] += 1
        if progress is not None:
            done = rel / 1e9 / summary.planned_s if summary.planned_s > 0 else 1.0
            progress(min(1.0, done), sum(summary.messages.values()))


async def _sleep_until(due: float) -> None:
    """Sleep, then spin the last :data:`SPIN_S`."""
    delay = due - time.monotonic()
    if delay > SPIN_S:
        await asyncio.sleep(delay - SPIN_S)
    while time.monotonic() < due:
        pass


#: While a pausable replay sleeps, it looks at its control this often (seconds).
PAUSE_POLL_S = 0.05


async def _wait_paused(control: ReplayControl, t0: float, due: float) -> tuple[float, float]:
    """Sleep until ``due``; time spent paused moves the replay clock (``t0``) and ``due`` on."""
    while True:
        shift = await control.wait_running()
        t0, due = t0 + shift, due + shift
        delay = due - time.monotonic()
        if delay <= PAUSE_POLL_S + SPIN_S:
            await _sleep_until(due)
            return t0, due
        await asyncio.sleep(PAUSE_POLL_S)
