"""Bounded blocking calls (``engines.blocking``): daemon threads, reused while idle."""

from __future__ import annotations

import asyncio
import threading

import pytest

from embodied_bus.engines.blocking import call_bounded


def _bounded_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("eb-test-bounded")]


async def test_sequential_bounded_calls_reuse_one_idle_daemon_thread() -> None:
    callers = set()
    for i in range(50):
        assert await call_bounded(lambda i=i: i * 2, 5.0, name="eb-test-bounded") == i * 2
        callers.add(await call_bounded(threading.get_ident, 5.0, name="eb-test-bounded"))
    assert len(callers) <= 2  # not a new thread per call (50 calls; another caller may take one)
    assert all(t.daemon for t in _bounded_threads())


async def test_a_stuck_call_times_out_keeps_its_thread_and_later_calls_still_run() -> None:
    release = threading.Event()
    stuck: list[int] = []

    def hang() -> None:
        stuck.append(threading.get_ident())
        release.wait()

    try:
        with pytest.raises(TimeoutError):
            await call_bounded(hang, 0.2, name="eb-test-bounded")
        # the stuck thread is never handed the next call: another one answers at once
        for _ in range(3):
            call = call_bounded(threading.get_ident, 5.0, name="eb-test-bounded")
            ident = await asyncio.wait_for(call, 2.0)
            assert ident != stuck[0]
        with pytest.raises(ValueError, match="bad input"):
            await call_bounded(lambda: int("bad input"), 5.0, name="eb-test-bounded")
    finally:
        release.set()
