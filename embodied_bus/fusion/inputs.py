"""A fusion worker's inputs, taken in stamp order across streams (event-time alignment).

Each input stream has its own subscription; the worker takes, of the streams that have a sample
waiting, the one stamped earliest. A broker delivers separate topics at their own pace (Pulsar
hands out about as many messages of a 10 Hz lidar topic as of a 200 Hz IMU topic, so their
stamps drift seconds apart in a fast replay), and a stream merely behind must not be taken for a
silent one. So when a stream that delivered recently has nothing waiting while the next sample
is ahead of it by more than the wall-clock time between their arrivals, its own period and the
alignment bound (samples coming faster than real time: a fast replay, a backlog), the worker
waits for it, at most :data:`WAIT_S` per such episode. Live data (stamps advancing with the
wall clock) is never held up, and a silent stream (nothing for the idle bound) is not waited
for.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from embodied_bus.errors import BusClosedError
from embodied_bus.model.sample import Sample
from embodied_bus.streams.subscriber import Subscription

__all__ = ["BATCH", "WAIT_S", "AlignedInputs"]

#: Longest wait for a stream that is behind the others, per episode (wall clock), seconds.
WAIT_S = 0.1
#: Most samples :meth:`AlignedInputs.next_batch` returns.
BATCH = 256


@dataclass(slots=True)
class _Input:
    sub: Subscription
    offset_ns: int
    #: Samples taken from the subscription, not yet handed out (with their stamps).
    queue: deque[Sample] = field(default_factory=deque)
    stamps: deque[int] = field(default_factory=deque)
    last_stamp: int | None = None
    last_receive_ns: int = 0
    last_arrival_s: float = float("-inf")
    #: Waited for in vain since it last delivered: not waited for again until it does.
    gave_up: bool = False
    #: Its recent interval between stamps (ns).
    interval_ns: int = 0

    def fill(self) -> bool:
        """Take what the subscription has waiting (True if anything is queued)."""
        if self.queue:
            return True
        got = self.sub.recv_many_nowait(BATCH)
        if not got:
            return False
        offset = self.offset_ns
        self.queue.extend(got)
        self.stamps.extend((s.header.stamp_ns or s.receive_ns) + offset for s in got)
        self.last_arrival_s = time.monotonic()
        self.gave_up = False
        return True


class AlignedInputs:
    """Samples of several subscriptions, the earliest stamped first.

    Args:
        subs: One subscription per input stream, by stream name.
        offsets_ns: Clock offsets added to a stream's stamps (as the spec corrects them).
        align_ns: A stream more than this behind the next sample is waited for.
        idle_s: A stream that delivered nothing for this long (wall clock) is silent.
    """

    def __init__(
        self, subs: dict[str, Subscription], offsets_ns: dict[str, int], align_ns: int, idle_s: float
    ) -> None:
        self._inputs = [_Input(sub, offsets_ns.get(name, 0)) for name, sub in subs.items()]
        self._align_ns = align_ns
        self._idle_s = idle_s
        self._loop = asyncio.get_running_loop()
        #: Times a stream behind the others was waited for, and how often in vain.
        self.waits = 0
        self.waits_in_vain = 0

    async def next_batch(self) -> list[Sample]:
        """The next samples in stamp order across the streams (at least one; waiting for a
        stream behind, as above).

        Raises:
            BusClosedError: Every subscription is closed.
        """
        inputs = self._inputs
        out: list[Sample] = []
        while not out:
            ready = [inp for inp in inputs if inp.fill()]
            if not ready:
                await self._any()
                continue
            while len(out) < BATCH:
                best = ready[0]
                for inp in ready:
                    if inp.stamps[0] < best.stamps[0]:
                        best = inp
                stamp = best.stamps[0]
                sample = best.queue[0]
                if len(ready) < len(inputs):
                    laggard = self._laggard(stamp, sample.receive_ns)
                    if laggard is not None:
                        if not out:
                            await self._wait_for(laggard)
                        break
                best.queue.popleft()
                best.stamps.popleft()
                if best.last_stamp is not None and stamp > best.last_stamp:
                    # a smoothed interval: a lost sample stretches it only a little
                    best.interval_ns = (3 * best.interval_ns + (stamp - best.last_stamp)) // 4
                best.last_stamp = stamp
                best.last_receive_ns = sample.receive_ns
                out.append(sample)
                if not best.queue and not best.fill():
                    ready.remove(best)
                    if not ready:
                        break
        return out

    def _laggard(self, next_stamp: int, next_receive_ns: int) -> _Input | None:
        """A stream with nothing waiting, recently active, that the next sample (stamped
        ``next_stamp``, received at ``next_receive_ns``) is ahead of by more than their arrivals
        are apart, its period and the alignment bound."""
        now = time.monotonic()
        for inp in self._inputs:
            if (
                not inp.queue
                and not inp.gave_up
                and inp.last_stamp is not None
                and (next_stamp - inp.last_stamp) - (next_receive_ns - inp.last_receive_ns)
                > self._align_ns + inp.interval_ns
                and now - inp.last_arrival_s < self._idle_s
                and not inp.sub.closed
            ):
                return inp
        return None

    async def _wait_for(self, inp: _Input) -> None:
        self.waits += 1
        fut: asyncio.Future[None] = self._loop.create_future()
        if inp.sub.notify_when_ready(fut):
            return
        done, _ = await asyncio.wait({fut}, timeout=WAIT_S)
        if not done:
            self.waits_in_vain += 1
            inp.gave_up = True

    async def _any(self) -> None:
        """Wait until some stream has a sample (or every one is closed)."""
        live = [inp for inp in self._inputs if not inp.sub.closed]
        if not live:
            raise BusClosedError("every input subscription of the fusion worker is closed")
        fut: asyncio.Future[None] = self._loop.create_future()
        for inp in live:
            if inp.sub.notify_when_ready(fut):
                return
        await fut
