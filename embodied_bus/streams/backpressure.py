"""Bounded hand-off from engine threads to an asyncio consumer, with a backpressure policy."""

from __future__ import annotations

import asyncio
import enum
import threading
from collections import deque
from itertools import repeat, starmap
from typing import Generic, TypeVar

from embodied_bus.errors import BusClosedError
from embodied_bus.model.qos import Backpressure

__all__ = ["REFUSED", "RESUME_FRACTION", "STASH_MAX", "BoundedBuffer", "Refused"]

T = TypeVar("T")


class Refused(enum.Enum):
    """What :meth:`BoundedBuffer.put` returns for an item it did not take (the buffer is
    closed): an explicit answer, not the item itself, so no caller tells "refused" from
    "dropped" by object identity."""

    REFUSED = "refused"


#: The item was not taken: the buffer is (or got, while waiting for room) closed.
REFUSED = Refused.REFUSED

#: Under ``BLOCK``, a producer waiting for room resumes once 1/this of the buffer is free
#: (or the room it needs, if less).
RESUME_FRACTION = 4

#: Under ``BLOCK``, the consumer moves up to this many of the oldest items at a time to a
#: stash of its own that it pops without the lock (they still count against the capacity).
STASH_MAX = 64


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class BoundedBuffer(Generic[T]):
    """A thread-safe bounded FIFO: engine threads ``put``, one asyncio task ``get``\\ s.

    Under ``BLOCK`` the consumer takes the oldest items in runs of up to :data:`STASH_MAX` into
    a stash that only its thread touches, and pops them from there without taking the lock
    (one lock round per run, not per item). Stashed items count against ``capacity`` until
    they are popped: the bound and the order are those of one FIFO.

    Args:
        capacity: Maximum number of buffered items (>= 1).
        policy: What ``put`` does when full; see :class:`Backpressure`.
        loop: The event loop of the consumer.
    """

    def __init__(self, capacity: int, policy: Backpressure, loop: asyncio.AbstractEventLoop) -> None:
        if capacity < 1:
            raise ValueError(f"buffer capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.policy = policy
        self._loop = loop
        self._items: deque[T] = deque()
        # the consumer's stash (BLOCK only; see the class docstring): the oldest items, popped
        # by the consumer's thread without the lock; producers only read its length
        self._stash: deque[T] = deque()
        self._stash_max = STASH_MAX if policy is Backpressure.BLOCK and capacity >= 2 * STASH_MAX else 0
        self._lock = threading.Lock()
        self._not_full = threading.Condition(self._lock)
        self._blocked = 0
        # A blocked producer is woken once this much room is free, not at every freed slot:
        # a full buffer then costs one thread switch per batch of samples, not one per sample.
        self._resume_room = max(1, capacity // RESUME_FRACTION)
        self._room_wanted = 1
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        #: Items discarded by ``DROP_OLDEST``.
        self.dropped = 0
        #: Times a producer waited for room (``BLOCK``).
        self.waits = 0

    def __len__(self) -> int:
        return len(self._stash) + len(self._items)

    def put(self, item: T) -> T | Refused | None:
        """Add an item from any thread except the consumer's loop thread (under ``BLOCK``).

        Returns:
            The item discarded to make room (``DROP_OLDEST``), :data:`REFUSED` if ``item`` was
            not taken because the buffer is (or got, while waiting for room) closed, else None.
        """
        dropped: T | None = None
        with self._lock:
            if self._closed:
                return REFUSED
            if len(self._items) + len(self._stash) >= self.capacity:
                if self.policy is Backpressure.DROP_OLDEST:
                    dropped = self._items.popleft()
                    self.dropped += 1
                else:
                    self._wait_for_room(self._resume_room)
                    if self._closed:
                        return REFUSED
            self._items.append(item)
            waiter = self._waiter
            self._waiter = None
        if waiter is not None:
            self._loop.call_soon_threadsafe(_wake, waiter)
        return dropped

    def put_many(self, items: list[T]) -> tuple[list[T], list[T]]:
        """Add items in order, as :meth:`put` does one by one, waking the consumer once.

        Returns:
            The items discarded to make room (``DROP_OLDEST``) and those of ``items`` not
            taken because the buffer is (or got, while waiting for room) closed.
        """
        dropped: list[T] = []
        refused: list[T] = []
        buf = self._items
        with self._lock:
            i = 0
            while i < len(items):
                if self._closed:
                    refused = items[i:]
                    break
                room = self.capacity - len(buf) - len(self._stash)
                if room <= 0:
                    if self.policy is Backpressure.DROP_OLDEST:
                        dropped.append(buf.popleft())
                        self.dropped += 1
                        room = 1
                    else:
                        waiter = self._waiter
                        self._waiter = None
                        if waiter is not None:
                            self._loop.call_soon_threadsafe(_wake, waiter)
                        self._wait_for_room(len(items) - i)
                        continue
                if self.policy is Backpressure.DROP_OLDEST and len(items) - i > self.capacity:
                    # only the newest `capacity` can survive: the rest are dropped unbuffered
                    skip = len(items) - i - self.capacity
                    dropped.extend(buf)
                    self.dropped += len(buf) + skip
                    buf.clear()
                    dropped.extend(items[i : i + skip])
                    i += skip
                    continue
                chunk = items[i : i + room]
                buf.extend(chunk)
                i += len(chunk)
            waiter = self._waiter
            self._waiter = None
        if waiter is not None:
            self._loop.call_soon_threadsafe(_wake, waiter)
        return dropped, refused

    def _wait_for_room(self, needed: int) -> None:
        """Wait (lock held) until ``min(needed, resume room)`` slots are free or it closes."""
        want = min(needed, self._resume_room)
        self.waits += 1
        self._blocked += 1
        try:
            while True:
                # several blocked producers: wake at the smallest room any of them wants. Set
                # before the room is measured: the consumer pops its stash without the lock,
                # and one that pops after the measurement must see what this producer wants
                # (it then notifies, once this wait has released the lock).
                self._room_wanted = want if self._blocked == 1 else min(want, self._room_wanted)
                if self.capacity - len(self._items) - len(self._stash) >= want or self._closed:
                    break
                self._not_full.wait(0.5)
        finally:
            self._blocked -= 1

    def _took(self) -> None:
        """After a pop (lock held): wake blocked producers once there is the room they want,
        once: until a woken producer waits again, later pops notify nobody (``notify_all`` is
        Python code, and the producer takes a while to get the GIL back)."""
        if self.capacity - len(self._items) - len(self._stash) >= self._room_wanted:
            self._room_wanted = self.capacity + 1  # notified: a producer that waits again re-arms
            self._not_full.notify_all()

    def get_nowait(self) -> T | None:
        """Pop the oldest item, or return None if empty (consumer's thread only)."""
        stash = self._stash
        if stash:
            item = stash.popleft()
            # read without the lock: see _refill (and _took, under the lock, decides)
            if self._blocked and self.capacity - len(self._items) - len(stash) >= self._room_wanted:
                self.room_freed()
            return item
        with self._lock:
            items = self._items
            if not items:
                return None
            item = items.popleft()
            if self._stash_max and items:
                self._refill(items)
            if self._blocked:
                self._took()
            return item

    def room_freed(self) -> None:
        """After a pop from the stash that may have freed the room a blocked producer wants
        (for consumers that pop the stash themselves): wake it if so."""
        with self._lock:
            self._took()

    def _refill(self, items: deque[T]) -> None:
        """Move the oldest items to the stash (lock held, stash empty). A producer that blocks
        after the consumer read ``_blocked`` as 0 counted the stash as taken room, so it waits
        only while there are items the consumer's next locked pop will find (and notify)."""
        n = min(len(items), self._stash_max)
        self._stash.extend(starmap(items.popleft, repeat((), n)))  # n pops, no bytecode per item

    def get_many_nowait(self, max_items: int) -> list[T]:
        """Pop up to ``max_items`` of the oldest items (an empty list if none are waiting;
        consumer's thread only)."""
        stash = self._stash
        out: list[T] = []
        if stash:
            if len(stash) <= max_items:
                out = list(stash)
                stash.clear()
            else:
                out = list(starmap(stash.popleft, repeat((), max_items)))
            max_items -= len(out)
            if not max_items:
                if self._blocked:
                    with self._lock:
                        self._took()
                return out
        with self._lock:
            items = self._items
            if len(items) <= max_items:
                out += items
                items.clear()
            else:
                out += starmap(items.popleft, repeat((), max_items))
            if self._blocked and out:
                self._took()
            return out

    async def get_many(self, max_items: int, timeout_s: float | None = None) -> list[T]:
        """Wait for at least one item, then pop up to ``max_items`` of the oldest.

        Raises:
            TimeoutError: Nothing arrived within ``timeout_s`` seconds.
            BusClosedError: The buffer was closed and is empty.
        """
        out = self.get_many_nowait(max_items)
        if out:
            return out
        first = await self.get(timeout_s)
        return [first, *self.get_many_nowait(max_items - 1)] if max_items > 1 else [first]

    async def get(self, timeout_s: float | None = None) -> T:
        """Wait for and pop the oldest item.

        Raises:
            TimeoutError: Nothing arrived within ``timeout_s`` seconds.
            BusClosedError: The buffer was closed and is empty.
        """
        while True:
            item = self.get_nowait()
            if item is not None:
                return item
            with self._lock:
                if self._items:
                    continue  # arrived meanwhile
                if self._closed:
                    raise BusClosedError("subscription closed")
                fut: asyncio.Future[None] = self._loop.create_future()
                self._waiter = fut
            try:
                if timeout_s is None:
                    await fut
                else:
                    async with asyncio.timeout(timeout_s):
                        await fut
            finally:
                with self._lock:
                    if self._waiter is fut:
                        self._waiter = None

    def notify_when_ready(self, fut: asyncio.Future[None]) -> bool:
        """Have ``fut`` set (from the loop) once an item is waiting or the buffer closes, so
        one consumer can wait on several buffers with one future (consumer's thread only).

        Returns:
            True if that is already so (``fut`` is left alone).
        """
        if self._stash:
            return True
        with self._lock:
            if self._items or self._closed:
                return True
            self._waiter = fut
            return False

    @property
    def closed(self) -> bool:
        """Whether the buffer was closed."""
        return self._closed

    def close(self) -> list[T]:
        """Close the buffer, wake all waiters and return what was left in it."""
        with self._lock:
            self._closed = True
            left = [*self._stash, *self._items]  # the stash: this runs on the consumer's thread
            self._stash.clear()
            self._items.clear()
            self._not_full.notify_all()
            waiter = self._waiter
            self._waiter = None
        if waiter is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_wake, waiter)
        return left
