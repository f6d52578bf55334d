"""Bounded waits on engine calls that may never return.

``asyncio.wait_for(asyncio.to_thread(fn), t)`` gives up waiting after ``t`` but leaves ``fn``
running on a worker of the loop's default executor, and the interpreter joins those workers when
it exits: a Pulsar ``close()`` stuck on a crashed broker then keeps the whole process from ever
exiting. :func:`call_bounded` runs ``fn`` on its own daemon thread instead, so a call that is given
up on is really left behind.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["call_bounded", "resolve_none"]

T = TypeVar("T")


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

    def run() -> None:
        value: T | None = None
        error: BaseException | None = None
        try:
            value = fn()
        except BaseException as err:  # handed to the waiting coroutine
            error = err
        try:
            loop.call_soon_threadsafe(_settle, fut, value, error)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    threading.Thread(target=run, name=name, daemon=True).start()
    return await asyncio.wait_for(fut, timeout_s)
