"""The sender thread of a BLOCK publisher: puts off the event loop, small samples batched."""

from __future__ import annotations

import asyncio
import logging
import threading
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from itertools import accumulate
from typing import Any

from embodied_bus.engines.blocking import resolve_none
from embodied_bus.engines.zenoh.tuning import BATCH_MAX_BYTES, SENDER_RECHECK_S, SLOT_BYTES
from embodied_bus.model.batches import MAX_BATCH_SAMPLES

#: Stamps, buckets and publish times of the template samples a sender thread took, in order.
Columns = tuple[list[int], list[int], list[int]]
#: Bytes of an encoded header before its tail (the string lengths and strings): see
#: :class:`HeaderPacker`.
HEADER_FIXED_BYTES = 62

_logger = logging.getLogger("embodied_bus.zenoh")


def batch_cuts(sizes: list[int]) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of consecutive runs of samples of these sizes (bytes), each of at most
    :data:`BATCH_MAX_BYTES` and :data:`MAX_BATCH_SAMPLES` (a sample larger than that alone),
    cut with C-level calls."""
    ends = list(accumulate(sizes))
    n = len(sizes)
    i = 0
    while i < n:
        start = ends[i - 1] if i else 0
        j = bisect_right(ends, start + BATCH_MAX_BYTES, i + 1, min(n, i + MAX_BATCH_SAMPLES))
        yield i, j
        i = j


def slot_count(payloads: Sequence[Any]) -> int:
    """Sender-queue slots of these payloads: one per sample, or one per :data:`SLOT_BYTES` of
    a larger payload."""
    sizes = list(map(len, payloads))
    if max(sizes, default=0) <= SLOT_BYTES:
        return len(sizes)
    return sum((size + SLOT_BYTES - 1) // SLOT_BYTES or 1 for size in sizes)


def take_first(items: list[Any], n: int) -> list[Any]:
    """Remove and return the first ``n`` of ``items`` (two C-level calls: another thread may
    append meanwhile, never remove)."""
    taken = items[:n]
    del items[:n]
    return taken


class SenderThread:
    """Runs blocking ``put`` calls off the event loop (Zenoh congestion control BLOCK).

    A BLOCK put waits while the transport queue is full. On the loop thread that could stall
    the very consumer that would free it (publisher and subscriber in one process), so BLOCK
    publishers hand samples to this named thread; the asyncio side awaits room when more than
    ``high_water`` samples are queued. Whatever queued up while the thread was putting goes
    out in one call of ``put_all`` (which may batch small samples: no waiting is added).
    """

    def __init__(
        self,
        name: str,
        put_all: Callable[[list[Any], list[bytes | int], Columns | None], BaseException | None],
        high_water: int,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._put_all = put_all
        self._loop = loop
        self.high_water = high_water
        # the queued samples' payloads and headers, in queues of their own (no tuple per
        # sample). A header is the encoded header, or (a sample of the publisher's template,
        # :meth:`ZenohPublisher.fast_sender`) its seq, with its stamp, bucket and publish time
        # in the three column queues. A sample's header (or seq) is appended last, so every
        # header the thread counts has its payload and columns queued
        self.payloads: list[Any] = []
        self.atts: list[bytes | int] = []
        self._stamps: list[int] = []
        self._buckets: list[int] = []
        self._pubs: list[int] = []
        # slots pushed (by the publishing thread) and sent (by this thread): each has one writer
        self.pushed_slots = 0
        self.sent_slots = 0
        self._cond = threading.Condition(threading.Lock())
        self._idle = False
        self._waiters: list[asyncio.Future[None]] = []
        self._closed = False
        self._miscounted = False  # warned once that the counts disagree with an idle sender
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"eb-zenoh-put-{name}", daemon=True)
        self._thread.start()

    def push(self, payload: Any, attachment: bytes, size: int) -> None:
        # No lock while the thread is busy: ``deque.append`` is atomic, and the thread checks
        # for items under the lock before it waits (so an item appended before ``_idle`` is
        # set is seen, and one appended after finds ``_idle`` set and notifies). Taking the
        # lock on every push made the publishing loop queue behind the sender thread.
        self.payloads.append(payload)
        self.atts.append(attachment)
        self.pushed_slots += (size + SLOT_BYTES - 1) // SLOT_BYTES or 1  # the publisher's thread only
        if self._idle:
            self.wake()

    def wake(self) -> None:
        """Wake the thread if it is idle (call after appending to ``_atts``: see :meth:`push`)."""
        with self._cond:
            if self._idle:
                # woken once: later pushes find it already woken
                self._idle = False
                self._cond.notify()

    def push_many(self, payloads: Sequence[Any], attachments: Sequence[bytes]) -> None:
        """:meth:`push` for a run of samples, in order (one wake-up for the run)."""
        if len(payloads) != len(attachments):
            raise ValueError(f"{len(payloads)} payloads but {len(attachments)} headers")
        self.payloads.extend(payloads)
        self.atts.extend(attachments)
        self.pushed_slots += slot_count(payloads)
        if self._idle:
            self.wake()

    def push_columns(
        self,
        payloads: Sequence[Any],
        seqs: Sequence[int],
        stamps_ns: Sequence[int],
        buckets: Sequence[int],
        publish_ns: Sequence[int],
    ) -> None:
        """:meth:`push_many` for samples of the publisher's template, given by their seq,
        stamp, bucket and publish time (encoded by the thread, as columns where it can)."""
        n = len(payloads)
        if not len(seqs) == len(stamps_ns) == len(buckets) == len(publish_ns) == n:
            raise ValueError(f"{n} payloads but columns of other lengths")
        self.payloads.extend(payloads)
        self._stamps.extend(stamps_ns)
        self._buckets.extend(buckets)
        self._pubs.extend(publish_ns)
        self.atts.extend(seqs)
        self.pushed_slots += slot_count(payloads)
        if self._idle:
            self.wake()

    def backlog(self) -> int:
        """Slots (a sample, or one per :data:`SLOT_BYTES` of its payload) queued or being put."""
        return self.pushed_slots - self.sent_slots

    def _run(self) -> None:
        atts, payloads = self.atts, self.payloads
        while True:
            if not atts:
                with self._cond:
                    self._idle = True  # before the check: a push after it sees the flag
                    while not atts and not self._closed:
                        self._cond.wait()
                    self._idle = False
                    if not atts and self._closed:
                        self.wake_all()
                        return
            # the pushing thread may append meanwhile (taken next round); every header counted
            # here has its payload queued already
            n = len(atts)
            batch_atts, bodies = take_first(atts, n), take_first(payloads, n)
            kinds = set(map(type, batch_atts))
            k = n if kinds == {int} else 0 if int not in kinds else sum(type(a) is int for a in batch_atts)
            cols: Columns | None = None
            if k:
                cols = (take_first(self._stamps, k), take_first(self._buckets, k), take_first(self._pubs, k))
            try:
                err = self._put_all(bodies, batch_atts, cols)
            except BaseException as bug:  # encoding failed (publish checks what it queues): a bug
                _logger.exception("sender %s could not encode %d samples", self._thread.name, n)
                err = bug
            if err is not None:  # reported on the next publish or flush
                self.error = err
            self.sent_slots += slot_count(bodies)
            with self._cond:
                self.wake_all()

    def wake_all(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            self._loop.call_soon_threadsafe(resolve_none, fut)

    async def wait_below(self, limit: int) -> None:
        """Wait until at most ``limit`` slots are queued or being put, the sender is idle with
        nothing queued (everything pushed has been put, whatever the counts say), or it closed.
        Each wait for a wake-up lasts at most :data:`SENDER_RECHECK_S`: a wake-up that never
        comes costs that much, never a flush that waits for good."""
        while True:
            with self._cond:
                if self.backlog() <= limit or self._closed:
                    return
                if self._idle and not self.atts:
                    if not self._miscounted:
                        self._miscounted = True
                        name, queued = self._thread.name, self.backlog()
                        _logger.warning("sender %s idle with %d slots counted as queued", name, queued)
                    return
                fut: asyncio.Future[None] = self._loop.create_future()
                self._waiters.append(fut)
            try:
                async with asyncio.timeout(SENDER_RECHECK_S):
                    await fut
            except TimeoutError:
                pass  # look again

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(10.0)
