"""Shared fixtures: real Zenoh sessions on free loopback ports and a real Apache Pulsar standalone.

Set ``EMBODIED_BUS_PULSAR_URL`` to use an already running broker instead of starting one.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import pytest

from embodied_bus import Bus, open_bus
from embodied_bus.testing.ports import free_port
from embodied_bus.testing.pulsar import PulsarStandalone

#: Exit status of the session, kept for :func:`pytest_unconfigure`.
_exit_status = pytest.StashKey[int]()


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM and SIGHUP (the test command's time limit, a closed terminal) end the session as
    Ctrl-C does, so session fixtures still stop their brokers and delete their data."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)
        signal.signal(signal.SIGHUP, interrupt)
    # the descriptor pytest's faulthandler plugin writes to as well: still the terminal's here
    _stderr_copy.append(os.dup(sys.stderr.fileno()))


#: A test (setup, call and teardown) still running after this long gets the asyncio tasks of
#: every running event loop printed with their stacks, seconds (thread stacks come from
#: ``faulthandler_timeout`` in pytest.ini; pytest-timeout ends the test at 300 s).
STUCK_TASKS_AFTER_S = 250.0


def _print_tasks(loop: asyncio.AbstractEventLoop, nodeid: str, write: Callable[[str], None]) -> None:
    """On ``loop``'s thread: every unfinished task of it, with its stack."""
    import io

    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    out = io.StringIO()
    print(f"\n{nodeid} still running: {len(tasks)} unfinished asyncio task(s)", file=out)
    for task in tasks:
        print(f"--- {task!r}"[:400], file=out)
        task.print_stack(limit=20, file=out)
    write(out.getvalue())


def _dump_stuck_tasks(nodeid: str, write: Callable[[str], None]) -> None:
    """From a timer thread: ask each running event loop to print its tasks."""
    import gc

    for obj in gc.get_objects():
        if isinstance(obj, asyncio.AbstractEventLoop) and obj.is_running():
            try:
                obj.call_soon_threadsafe(_print_tasks, obj, nodeid, write)
            except RuntimeError:  # closed meanwhile
                pass


#: The test command's own stderr (a copy made before pytest captures the tests' output).
_stderr_copy: list[int] = []


def _write_stderr(text: str) -> None:
    os.write(_stderr_copy[0] if _stderr_copy else 2, text.encode(errors="replace"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    done = threading.Event()

    def watch() -> None:  # at STUCK_TASKS_AFTER_S, then every 120 s (a teardown that hangs too)
        wait_s = STUCK_TASKS_AFTER_S
        while not done.wait(wait_s):
            _dump_stuck_tasks(item.nodeid, _write_stderr)
            wait_s = 120.0

    threading.Thread(target=watch, name="eb-test-watchdog", daemon=True).start()
    try:
        yield
    finally:
        done.set()


# Tests whose verdict depends on timing under bursts of load they make themselves (chaos runs
# that kill processes and cut links, recordings replayed at rate 1 into workers killed mid-run,
# the live view's deadlines for a browser-like client):
# marked ``serial``; the test command runs them alone, after the others have run on two workers
# (``-n 2 -m "not serial"``).
SERIAL_MODULES = frozenset(
    {"test_actions_chaos", "test_actions_session_chaos", "test_fusion_scale_out", "test_view"}
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.stem in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_exit_status] = int(exitstatus)


def _busy_threads() -> list[threading.Thread]:
    """Non-daemon threads the interpreter would join at exit, without idle pool workers."""
    frames = sys._current_frames()
    busy = []
    for t in threading.enumerate():
        if t is threading.main_thread() or t.daemon or not t.is_alive() or t.ident is None:
            continue
        stack = traceback.extract_stack(frames.get(t.ident)) if t.ident in frames else []
        idle_worker = any(f.name == "_worker" for f in stack) and not any(f.name == "run" for f in stack)
        if not idle_worker:
            busy.append(t)
    return busy


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave as soon as pytest has reported, whatever native code would do at interpreter exit.

    A blocking engine call left behind (a Pulsar close on a crashed broker, a Zenoh session that
    does not close) must not hold the test command open until CI's time limit: the product runs
    such calls on daemon threads (``engines.blocking``), and this guard names any that still
    hold the exit, with their stacks, then exits with pytest's status.
    """
    status = config.stash.get(_exit_status, None)
    worker = hasattr(config, "workerinput")  # an xdist worker leaves through its controller
    if status is None or worker or os.environ.get("EMBODIED_BUS_TEST_NORMAL_EXIT"):
        return
    frames = sys._current_frames()
    for t in _busy_threads():
        print(f"\nthread {t.name!r} would hold the interpreter's exit:", file=sys.stderr)
        if t.ident in frames:
            traceback.print_stack(frames[t.ident], limit=12, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


@pytest.fixture(scope="session")
def pulsar_broker() -> Iterator[PulsarStandalone | None]:
    """A real Apache Pulsar standalone for the whole session (started on first use)."""
    if os.environ.get("EMBODIED_BUS_PULSAR_URL"):
        yield None
        return
    # compaction thresholds (state tables) are checked every 2 s instead of every minute
    broker = PulsarStandalone(
        extra_conf={"brokerServiceCompactionMonitorIntervalInSeconds": "2"},
        listener="robots",  # robots on a link a test can cut (test_uplink.py)
    )
    try:
        broker.start()
        yield broker
    finally:
        broker.cleanup()


@pytest.fixture(scope="session")
def pulsar_url(pulsar_broker: PulsarStandalone | None) -> str:
    """Service URL of the Pulsar broker used by the tests."""
    return os.environ.get("EMBODIED_BUS_PULSAR_URL") or pulsar_broker.url  # type: ignore[union-attr]


@dataclass
class BusPair:
    """Two buses on separate engine sessions of the same namespace."""

    engine: str
    publisher_bus: Bus
    subscriber_bus: Bus
    namespace: str
    url_pub: str
    url_sub: str


def zenoh_urls() -> tuple[str, str]:
    """A listening peer and a peer connecting to it, on a free loopback port (scouting off)."""
    port = free_port()
    return f"zenoh:?listen=tcp/127.0.0.1:{port}", f"zenoh://127.0.0.1:{port}"


@pytest.fixture(params=["zenoh", "pulsar"])
def engine_name(request: pytest.FixtureRequest) -> str:
    """Each contract test runs once per engine."""
    return str(request.param)


@pytest.fixture
async def bus_pair(engine_name: str, request: pytest.FixtureRequest) -> AsyncIterator[BusPair]:
    """Publisher and subscriber buses on the engine under test, in a fresh namespace."""
    ns = "t" + uuid.uuid4().hex[:10]
    if engine_name == "zenoh":
        url_pub, url_sub = zenoh_urls()
    else:
        url = request.getfixturevalue("pulsar_url")
        url_pub = url_sub = url
    pub_bus = await open_bus(url_pub, namespace=ns)
    sub_bus = await open_bus(url_sub, namespace=ns)
    try:
        yield BusPair(engine_name, pub_bus, sub_bus, ns, url_pub, url_sub)
    finally:
        await sub_bus.close()
        await pub_bus.close()


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "") -> None:
    """Poll ``predicate`` until it holds; fail the test with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what or predicate}")
        await asyncio.sleep(0.01)
