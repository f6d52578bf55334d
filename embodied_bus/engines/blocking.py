"""Bounded waits on engine calls that may never return.

``asyncio.wait_for(asyncio.to_thread(fn), t)`` gives up waiting after ``t`` but leaves ``fn``
running on a worker of the loop's default executor, and the interpreter joins those workers when
it exits: a Pulsar ``close()`` stuck on a crashed broker then keeps the whole process from ever
exiting. :func:`call_bounded` runs ``fn`` on a daemon thread instead, so a call that is given up on
is really left behind. Idle daemon threads are kept for :data:`IDLE_THREAD_S` and reused (starting
a thread costs the calling event loop about 0.1 ms, and hot paths such as the Pulsar action
queue's state-log probe call this hundreds of times a second).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["IDLE_THREAD_S", "call_bounded", "resolve_none"]

T = TypeVar("T")

#: How long an idle daemon thread of :func:`call_bounded` waits for its next call, seconds.
IDLE_THREAD_S = 10.0


_Job = Callable[[], Callable[[], None]]


class _DaemonThreads:
    """Daemon threads that run one call at a time and wait for the next while idle.

    A job returns the function that hands its outcome over; the thread is idle again before it
    calls it, so a caller that submits its next job as soon as it has the outcome gets this same
    thread. A call that never returns keeps its thread for good (it is never handed more work);
    every other caller gets an idle thread or a new one.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[_Job | None]] = []

    def submit(self, job: _Job, name: str) -> None:
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is not None:
            inbox.put(job)
            return
        inbox = queue.SimpleQueue[_Job | None]()
        inbox.put(job)
        threading.Thread(target=self._serve, args=(inbox,), name=name, daemon=True).start()

    def _serve(self, inbox: queue.SimpleQueue[_Job | None]) -> None:
        while True:
            try:
                job = inbox.get(timeout=IDLE_THREAD_S)
            except queue.Empty:
                with self._lock:
                    if inbox in self._idle:
                        self._idle.remove(inbox)
                        return
                continue  # handed a job just now: it is in the inbox
            if job is None:
                return
            hand_over = job()
            with self._lock:
                self._idle.append(inbox)
            hand_over()


_threads = _DaemonThreads()


def resolve_none(fut: asyncio.Future[None]) -> None:
    """Complete ``fut`` with None unless it is done already (for ``call_soon_threadsafe``)."""
    if not fut.done():
        fut.set_result(None)


def _settle(fut: asyncio.Future[T], value: T | None, err: BaseException | None) -> None:
    if fut.done():  # cancelled: the caller stopped waiting
        return
    if err is not None:
        fut.set_exception(err)
    else:
        fut.set_result(value)  # type: ignore[arg-type]


async def call_bounded(fn: Callable[[], T], timeout_s: float, *, name: str = "eb-bounded-call") -> T:
    """Run blocking ``fn()`` on a daemon thread and wait at most ``timeout_s`` for it.

    Args:
        fn: The blocking call (no arguments; bind them with a lambda or ``functools.partial``).
        timeout_s: Longest wait, seconds.
        name: Name of the thread (shows in stack dumps).

    Returns:
        What ``fn`` returned.

    Raises:
        TimeoutError: ``fn`` did not return within ``timeout_s``; it is left running on its daemon
            thread, which never delays the interpreter's exit.
        Exception: Whatever ``fn`` raised.
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def run() -> Callable[[], None]:
        value: T | None = None
        error: BaseException | None = None
        try:
            value = fn()
        except BaseException as err:  # handed to the waiting coroutine
            error = err

        def hand_over() -> None:
            try:
                loop.call_soon_threadsafe(_settle, fut, value, error)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

        return hand_over

    _threads.submit(run, name)
    return await asyncio.wait_for(fut, timeout_s)
