"""The Apache Pulsar standalone harness itself: the guard against a flapping bookie registration."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from embodied_bus.testing import pulsar as harness
from embodied_bus.testing.pulsar import PulsarStandalone

EVENT = (
    "2026-12-03T02:00:12,209+0000 [Thread-2] INFO  org.apache.pulsar.metadata.bookkeeper."
    "PulsarRegistrationClient - Bookie 127.0.0.1:46871 deleted. path: /ledgers/available/127.0.0.1:46871\n"
)


def broker_with_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> PulsarStandalone:
    monkeypatch.setattr(harness, "REGISTRATION_WATCH_S", 0.5)
    broker = PulsarStandalone(tmp_path / "data", home=tmp_path / "home")
    broker.log_path = tmp_path / "standalone.out"
    broker.log_path.write_text(EVENT * 5000)  # events from before the watch do not count
    return broker


def append_during_watch(path: Path, events: int) -> threading.Thread:
    def run() -> None:
        for _ in range(events):
            with open(path, "a") as log:
                log.write(EVENT)
            time.sleep(0.001)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_registration_deleted_and_recreated_in_a_loop_is_seen_as_flapping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = broker_with_log(tmp_path, monkeypatch)
    writer = append_during_watch(broker.log_path, 200)
    try:
        assert broker.registration_flapping()
    finally:
        writer.join()


def test_a_registration_that_settled_is_not_flapping(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broker = broker_with_log(tmp_path, monkeypatch)
    writer = append_during_watch(broker.log_path, 2)  # one re-registration: delete, create
    try:
        assert not broker.registration_flapping()
    finally:
        writer.join()


# The dev broker (`python -m embodied_bus.testing.pulsar run`) with a stand-in for the Java
# process, so that what is tested is the harness's own shutdown, in a real child process.
_DEV_BROKER = """
import subprocess, sys
from pathlib import Path
from embodied_bus.testing import pulsar as h
home, pid_file, broker_s = sys.argv[1:4]
h.ensure_pulsar_distribution = lambda *a, **k: Path(home)
def start(self, timeout_s=180.0):
    self.data_dir.mkdir(parents=True, exist_ok=True)
    (self.data_dir / "journal").write_bytes(bytes(4096))
    self.proc = subprocess.Popen(["sleep", broker_s], start_new_session=True)
    Path(pid_file).write_text(str(self.proc.pid))
h.PulsarStandalone.start = start
sys.exit(h.main(["run"]))
"""


@pytest.mark.parametrize(
    ("how", "exit_code"),
    [("sigterm", 128 + signal.SIGTERM), ("sighup", 128 + signal.SIGHUP), ("broker exits", 1)],
)
def test_the_dev_broker_removes_its_data_directory_however_it_stops(
    tmp_path: Path, how: str, exit_code: int
) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    pid_file = tmp_path / "broker.pid"
    broker_s = "1" if how == "broker exits" else "600"
    child = subprocess.Popen(
        [sys.executable, "-c", _DEV_BROKER, str(tmp_path), str(pid_file), broker_s],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().startswith("pulsar://127.0.0.1:")
        (data_dir,) = tmp.glob("eb-pulsar-*")
        assert (data_dir / "journal").exists()
        if how == "sigterm":
            child.send_signal(signal.SIGTERM)
        elif how == "sighup":
            child.send_signal(signal.SIGHUP)
        assert child.wait(30) == exit_code
    finally:
        child.kill()
        child.wait(10)
    assert not data_dir.exists(), "the data directory was left behind"
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)  # the broker process is gone too


def test_a_broker_refuses_to_start_on_a_nearly_full_disk_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "eb-pulsar-left-behind").mkdir()
    broker = PulsarStandalone(tmp_path / "eb-pulsar-new", home=tmp_path / "home")
    full = SimpleNamespace(total=252 * 1024**3, used=251 * 1024**3, free=600 * 1024**2)
    monkeypatch.setattr(harness.shutil, "disk_usage", lambda path: full)
    message = r"not enough free disk .* 0\.6 GiB of 252 GiB free .* 2 broker data"
    with pytest.raises(RuntimeError, match=message):
        broker.start(timeout_s=1)
    assert broker.proc is None  # nothing was launched


def test_the_test_broker_runs_with_the_low_latency_settings(pulsar_broker: PulsarStandalone | None) -> None:
    """The session's broker took :data:`LOW_LATENCY_CONF`: the broker's own key as its runtime
    configuration reports it, the bookie's in the configuration it was started with."""
    if pulsar_broker is None:
        pytest.skip("EMBODIED_BUS_PULSAR_URL points at a broker this session did not start")
    url = f"{pulsar_broker.web_url}/admin/v2/brokers/configuration/runtime"
    with urllib.request.urlopen(url, timeout=10) as r:
        runtime = json.load(r)
    assert runtime["managedLedgerNewEntriesCheckDelayInMillis"] == "0"
    conf = (pulsar_broker.data_dir / "standalone.conf").read_text().splitlines()
    assert "journalFlushWhenQueueEmpty=true" in conf
    assert "journalFlushWhenQueueEmpty=false" not in conf
