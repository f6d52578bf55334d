"""Latest-value state tables: the columnar form and the SQLite store directly, then every
contract on both engines (a late joiner loads the latest value of every key, watchers see each
change in order, deletes), a Zenoh state service killed for real, the Pulsar broker really
compacting a table by its threshold policy, and the ``embodied-bus state`` commands."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from embodied_bus import Bus, open_bus
from embodied_bus.errors import BusConfigError, BusConnectionError, EmbodiedBusError
from embodied_bus.state import StateEntry, StateOptions, StateService, StateStore, open_state
from embodied_bus.state.codec import OP_PUT, decode_entries, decode_request, encode_entries, encode_request
from embodied_bus.testing.ports import free_port

CLI = [sys.executable, "-m", "embodied_bus.cli.main"]


# ---------------------------------------------------------------------------- pure logic
def test_entries_round_trip_through_the_columnar_form() -> None:
    entries = [
        StateEntry("pose", b'{"x":1.5}', True, 1_700_000_000_000_000_001, False, 7),
        StateEntry("ünïcode/κλειδί", b"\x00\xff" * 100, False, 2, False, 8),
        StateEntry("empty", b"", False, 3, False, 9),
        StateEntry("gone", b"", False, 4, True, 10),
    ]
    assert decode_entries(encode_entries(entries)) == entries
    assert decode_entries(encode_entries([])) == []
    prefixed = b"xyz" + encode_entries(entries)
    assert decode_entries(prefixed, 3) == entries


def test_malformed_entries_and_requests_are_refused_by_name() -> None:
    good = encode_entries([StateEntry("k", b"value", False, 1)])
    for bad in (b"", good[:-1], good + b"x", good[:5], b"\xff" * 20):
        with pytest.raises(BusConfigError, match="state"):
            decode_entries(bad)
    with pytest.raises(BusConfigError, match="too short"):
        decode_request(b"\x01")
    request = decode_request(encode_request(OP_PUT, "robot", good))
    assert (request.op, request.table, request.body) == (OP_PUT, "robot", good)


def test_bad_tables_keys_and_values_are_refused() -> None:
    from embodied_bus.state.model import encode_value, validate_key, validate_table

    for name in ("", "a/b", "a.b", "x" * 65, "sp ace"):
        with pytest.raises(BusConfigError, match="state table name"):
            validate_table(name)
    for key in ("", "a\0b", "k" * 1025):
        with pytest.raises(BusConfigError, match="state key"):
            validate_key(key)
    with pytest.raises(BusConfigError, match="JSON-serialisable"):
        encode_value({"x": object()})
    with pytest.raises(BusConfigError, match="JSON-serialisable"):
        encode_value(float("nan"))
    assert encode_value(b"raw") == (b"raw", False)
    assert encode_value({"x": [1, 2]}) == (b'{"x":[1,2]}', True)


def test_the_store_numbers_writes_per_table_and_keeps_them_across_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = StateStore(path)
    stored = store.put("a", [StateEntry("k1", b"1", stamp_ns=1), StateEntry("k2", b"2", stamp_ns=2)])
    assert [e.revision for e in stored] == [1, 2]
    assert [e.revision for e in store.put("b", [StateEntry("k1", b"x")])] == [1]  # its own numbering
    store.put("a", [StateEntry("k1", b"", deleted=True), StateEntry("k3", b"3")])
    store.close()
    store = StateStore(path)
    assert store.revision("a") == 4
    revision, live = store.since("a", 0)
    assert revision == 4 and [(e.key, e.data) for e in live] == [("k2", b"2"), ("k3", b"3")]
    _, after = store.since("a", 2)  # a reader at revision 2 learns the delete too
    assert [(e.key, e.deleted, e.revision) for e in after] == [("k1", True, 3), ("k3", False, 4)]
    assert store.tables() == {"a": 4, "b": 1}
    store.close()


# ---------------------------------------------------------------------------- both engines
@dataclass
class StateBuses:
    writer: Bus
    reader_url: str
    namespace: str


@pytest.fixture
async def state_buses(
    engine_name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[StateBuses]:
    """A writer bus (on Zenoh with the state service beside it) and where readers connect."""
    ns = "st" + uuid.uuid4().hex[:8]
    stop = asyncio.Event()
    service = None
    if engine_name == "zenoh":
        port = free_port()
        writer = await open_bus(f"zenoh:?listen=tcp/127.0.0.1:{port}", namespace=ns)
        reader_url = f"zenoh://127.0.0.1:{port}"
        ready = asyncio.Event()
        service = asyncio.create_task(StateService(writer, tmp_path / "state.db").run(stop, ready))
        await asyncio.wait_for(ready.wait(), 10)
    else:
        reader_url = request.getfixturevalue("pulsar_url")
        writer = await open_bus(reader_url, namespace=ns)
    try:
        yield StateBuses(writer, reader_url, ns)
    finally:
        stop.set()
        if service is not None:
            await service
        await writer.close()


async def test_a_late_joiner_loads_the_latest_value_of_every_key(state_buses: StateBuses) -> None:
    table = await open_state(state_buses.writer, "robot")
    expected: dict[str, Any] = {}
    for round_ in range(5):
        values = {f"joint/{i}": {"round": round_, "angle_rad": i * 0.01} for i in range(200)}
        await table.put_many(values)
        expected.update(values)
    await table.put("calibration", b"\x00\x01binary")
    await table.put("mission", "docking")
    await table.delete("joint/7", "joint/8")
    await table.put("joint/9", {"round": 99})
    expected.update({"calibration": b"\x00\x01binary", "mission": "docking", "joint/9": {"round": 99}})
    del expected["joint/7"], expected["joint/8"]
    # the writer reads its own writes at once
    assert await table.get("joint/9") == {"round": 99}
    assert await table.get("joint/7") is None and await table.get("joint/7", "none") == "none"

    async with open_bus(state_buses.reader_url, namespace=state_buses.namespace) as reader:
        late = await open_state(reader, "robot")
        assert {k: e.value for k, e in late.snapshot().items()} == expected
        assert set(late.snapshot("joint/1")) == {f"joint/{i}" for i in range(200) if str(i).startswith("1")}
        entry = late.entry("calibration")
        assert entry is not None and not entry.is_json and abs(entry.stamp_ns - time.time_ns()) < 60e9
        other = await open_state(reader, "other")  # tables are apart
        assert len(other) == 0


async def test_watchers_see_every_change_in_order_with_deletes(state_buses: StateBuses) -> None:
    async with open_bus(state_buses.reader_url, namespace=state_buses.namespace) as reader:
        watched = await open_state(reader, "robot")
        got: list[StateEntry] = []
        done = asyncio.Event()

        async def follow() -> None:
            async for change in watched.watch("pose/"):
                got.append(change)
                if change.deleted:
                    done.set()

        task = asyncio.create_task(follow())
        await asyncio.sleep(0)  # the watcher is registered
        table = await open_state(state_buses.writer, "robot")
        for i in range(50):
            await table.put("pose/base", {"x": i})
            await table.put("other", i)  # not under the prefix
        await table.put_many({f"pose/arm{i}": i for i in range(3)})
        await table.delete("pose/base")
        await asyncio.wait_for(done.wait(), 20)
        assert [c.value for c in got if c.key == "pose/base" and not c.deleted] == [
            {"x": i} for i in range(50)
        ]
        assert [c.key for c in got[50:]] == ["pose/arm0", "pose/arm1", "pose/arm2", "pose/base"]
        assert got[-1].deleted and got[-1].value is None
        assert watched.entry("pose/base") is None and await watched.get("other") == 49
        await watched.close()
        await asyncio.wait_for(task, 5)  # closing the table ends its watchers


async def test_a_put_the_store_cannot_take_fails_and_names_why(engine_name: str, pulsar_url: str) -> None:
    if engine_name == "zenoh":  # no state service runs
        async with open_bus("zenoh:?listen=tcp/127.0.0.1:0", namespace="nostate") as bus:
            with pytest.raises(BusConnectionError, match=r"no state service answered.*embodied-bus queue"):
                await open_state(bus, "robot", StateOptions(request_timeout_s=0.5))
    else:
        async with open_bus(pulsar_url, namespace="st" + uuid.uuid4().hex[:8]) as bus:
            table = await open_state(bus, "robot")
            with pytest.raises(BusConfigError, match="state key"):
                await table.put("", 1)
            with pytest.raises(BusConfigError, match="invalid state table name"):
                await open_state(bus, "a/b")


# ---------------------------------------------------------------------------- real failures
class Serve:
    """``embodied-bus state serve`` as a process."""

    def __init__(self, url: str, ns: str, db: Path) -> None:
        cmd = [*CLI, "state", "serve", "--bus", url, "--ns", ns, "--db", str(db)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if "state service serving" in line:
                return
        raise AssertionError(f"state serve exited: {self.proc.stderr.read() if self.proc.stderr else ''}")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


async def test_zenoh_state_survives_its_service_killed(tmp_path: Path) -> None:
    port = free_port()
    listen, connect = f"zenoh:?listen=tcp/127.0.0.1:{port}", f"zenoh://127.0.0.1:{port}"
    ns = "st" + uuid.uuid4().hex[:8]
    service = Serve(listen, ns, tmp_path / "state.db")
    try:
        async with open_bus(connect, namespace=ns, wait_s=10) as bus:
            table = await open_state(bus, "robot")
            await table.put_many({f"k{i}": i for i in range(100)})
            service.kill()  # every put above returned: each is on disk
            service = Serve(listen, ns, tmp_path / "state.db")
            async with open_bus(connect, namespace=ns, wait_s=10) as late_bus:
                late = await open_state(late_bus, "robot", StateOptions(request_timeout_s=15))
                assert {k: e.value for k, e in late.snapshot().items()} == {f"k{i}": i for i in range(100)}
                await late.put("k0", "after the restart")
            # the table opened before the kill follows writes made after the restart
            deadline = time.monotonic() + 15
            while await table.get("k0") != "after the restart":
                assert time.monotonic() < deadline, "the old table never saw the write after the restart"
                await asyncio.sleep(0.05)
    finally:
        service.kill()


async def test_pulsar_compacts_a_state_topic_by_its_threshold_policy(pulsar_broker: Any) -> None:
    import pulsar

    from embodied_bus.state.pulsar import state_topic

    if pulsar_broker is None:
        pytest.skip("EMBODIED_BUS_PULSAR_URL points at a broker whose admin API this test does not know")
    ns = "st" + uuid.uuid4().hex[:8]
    keys, rounds, deleted = 300, 20, {"k3", "k4"}
    async with open_bus(pulsar_broker.url, namespace=ns) as bus:
        table = await open_state(bus, "robot")
        topic = state_topic(bus.engine, "robot")  # type: ignore[arg-type]
        path = "/admin/v2/" + topic.replace("://", "/")
        pulsar_broker.admin("POST", f"{path}/compactionThreshold", 50_000)
        await table.put_many({f"k{i}": {"round": 0, "pad": "x" * 180} for i in range(keys)})
        await table.delete(*deleted)
        for r in range(1, rounds):
            await table.put_many(
                {f"k{i}": {"round": r, "pad": "x" * 180} for i in range(keys) if f"k{i}" not in deleted}
            )
        written = keys * rounds + len(deleted)

        def compacted_read() -> list[str]:
            client = pulsar.Client(pulsar_broker.url)
            try:
                reader = client.create_reader(topic, pulsar.MessageId.earliest, is_read_compacted=True)
                seen = []
                while reader.has_message_available():
                    seen.append(reader.read_next(5000).partition_key())
                return seen
            finally:
                client.close()

        deadline = time.monotonic() + 90
        while True:  # the broker compacts on its own once the backlog passes the threshold
            seen = await asyncio.to_thread(compacted_read)
            if len(seen) < keys * 2 and not deleted & set(seen):
                break
            assert time.monotonic() < deadline, f"not compacted: {len(seen)} of {written} messages still read"
            await asyncio.sleep(1)
        status = pulsar_broker.admin("GET", f"{path}/compaction")
        stats = pulsar_broker.admin("GET", f"{path}/internalStats")
        assert status["status"] == "SUCCESS" and stats["compactedLedger"]["entries"] > 0
        late = await open_state(bus, "robot")
        assert len(late) == keys - len(deleted)
        assert all(e.value["round"] == rounds - 1 for e in late.snapshot().values())


# ---------------------------------------------------------------------------- the commands
def _cli(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout_s, check=False)


async def test_the_state_commands_put_get_watch_and_delete(
    engine_name: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    ns = "st" + uuid.uuid4().hex[:8]
    queue = None
    if engine_name == "zenoh":  # the queue service hosts the state service
        port = free_port()
        bus = f"zenoh://127.0.0.1:{port}"
        cmd = [
            *CLI,
            "queue",
            "--bus",
            f"zenoh:?listen=tcp/127.0.0.1:{port}",
            "--ns",
            ns,
            "--db",
            str(tmp_path / "q.db"),
        ]
        queue = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert queue.stdout is not None
        for line in queue.stdout:
            if "state service serving" in line:
                break
        assert (tmp_path / "state.db").exists()
    else:
        bus = request.getfixturevalue("pulsar_url")
    where = ["--bus", bus, "--ns", ns]
    try:
        assert _cli("state", "put", "mission", "docking", *where).returncode == 0
        assert _cli("state", "put", "pose/0", "0", *where).returncode == 0
        watch = subprocess.Popen(
            [*CLI, "state", "watch", "pose", "--json", "--count", "3", *where],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert watch.stdout is not None
        first = await asyncio.wait_for(asyncio.to_thread(watch.stdout.readline), 30)  # the current values
        assert json.loads(first)["key"] == "pose/0"
        for args in (
            ("put", "pose", '{"x": 1.5}'),
            ("put", "pose/raw", "hello", "--raw"),
            ("delete", "pose"),
        ):
            done = _cli("state", *args, *where)
            assert done.returncode == 0, done.stderr
        out, err = watch.communicate(timeout=30)
        changes = [json.loads(line) for line in out.splitlines()]
        assert [(c["key"], c["value"], c["deleted"]) for c in changes] == [
            ("pose", {"x": 1.5}, False),
            ("pose/raw", {"bytes_hex": b"hello".hex()}, False),
            ("pose", None, True),
        ], err
        got = _cli("state", "get", "--json", *where)
        assert got.returncode == 0, got.stderr
        assert {d["key"]: d["value"] for d in json.loads(got.stdout)} == {
            "mission": "docking",
            "pose/0": 0,
            "pose/raw": {"bytes_hex": b"hello".hex()},
        }
        one = _cli("state", "get", "mission", *where)
        assert one.stdout.strip() == '"docking"'
        missing = _cli("state", "get", "pose", *where)
        assert missing.returncode == 1 and "no key 'pose'" in missing.stderr
        bad = _cli("state", "put", "", "1", *where)
        assert bad.returncode == 1 and "state key" in bad.stderr
    finally:
        if queue is not None:
            queue.send_signal(signal.SIGINT)
            queue.wait(20)


def test_state_serve_refuses_pulsar() -> None:
    done = _cli("state", "serve", "--bus", "pulsar://127.0.0.1:1")
    assert done.returncode == 1 and "compacted topic" in done.stderr


async def test_a_zenoh_table_that_missed_writes_catches_up_from_the_service(tmp_path: Path) -> None:
    """Writes a table never heard of (made while it was cut off from them: here, stored while the
    service was down) reach it once a later change shows the gap in the revisions."""
    port = free_port()
    listen, connect = f"zenoh:?listen=tcp/127.0.0.1:{port}", f"zenoh://127.0.0.1:{port}"
    ns = "st" + uuid.uuid4().hex[:8]
    db = tmp_path / "state.db"
    service = Serve(listen, ns, db)
    try:
        async with open_bus(connect, namespace=ns, wait_s=10) as bus:
            table = await open_state(bus, "robot")
            await table.put("pose", 1)
            service.kill()
            missed = StateStore(db)  # written while no notification could reach the table
            missed.put("robot", [StateEntry("map", b'"warehouse-3"', True, time.time_ns())])
            missed.close()
            service = Serve(listen, ns, db)
            async with open_bus(connect, namespace=ns, wait_s=10) as other:
                writer = await open_state(other, "robot", StateOptions(request_timeout_s=15))
                await writer.put("pose", 2)  # revision 3: the table holds 1, so it asks for 2 on
            deadline = time.monotonic() + 10
            while await table.get("map") != "warehouse-3" or await table.get("pose") != 2:
                assert time.monotonic() < deadline, f"the table never caught up: {table.snapshot()}"
                await asyncio.sleep(0.02)
    finally:
        service.kill()


async def test_a_pulsar_table_rides_a_broker_restart(tmp_path: Path) -> None:
    """The broker is killed (``kill -9``) and restarted under an open table: a put made while it
    is down fails (or waits) and names why; once it is back, puts succeed and the table that was
    open before the crash follows a writer that opened after it."""
    from embodied_bus.testing.pulsar import PulsarStandalone

    broker = PulsarStandalone(tmp_path / "pulsar")
    await asyncio.to_thread(broker.start)
    ns = "st" + uuid.uuid4().hex[:8]
    try:
        async with open_bus(broker.url, namespace=ns) as bus:
            table = await open_state(bus, "robot", StateOptions(request_timeout_s=10))
            await table.put_many({f"k{i}": i for i in range(50)})
            await asyncio.to_thread(broker.restart, crash=True)
            deadline = time.monotonic() + 60
            while True:  # the client reconnects by itself; a put made before that fails
                try:
                    await table.put("k0", "after the restart")
                    break
                except (BusConnectionError, BusConfigError, EmbodiedBusError) as err:
                    assert time.monotonic() < deadline, f"no put succeeded after the restart: {err}"
                    await asyncio.sleep(0.5)
            async with open_bus(broker.url, namespace=ns) as other:
                late = await open_state(other, "robot", StateOptions(request_timeout_s=30))
                assert {k: e.value for k, e in late.snapshot().items()} == {
                    **{f"k{i}": i for i in range(50)},
                    "k0": "after the restart",
                }
                await late.put("k1", "from the late writer")
            deadline = time.monotonic() + 30
            while await table.get("k1") != "from the late writer":
                assert time.monotonic() < deadline, "the table opened before the crash stopped following"
                await asyncio.sleep(0.05)
    finally:
        await asyncio.to_thread(broker.cleanup)
