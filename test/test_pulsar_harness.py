"""The Apache Pulsar standalone harness itself: the guard against a flapping bookie registration."""

from __future__ import annotations

import threading
import time
from pathlib import Path

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
        assert broker._registration_flapping()
    finally:
        writer.join()


def test_a_registration_that_settled_is_not_flapping(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broker = broker_with_log(tmp_path, monkeypatch)
    writer = append_during_watch(broker.log_path, 2)  # one re-registration: delete, create
    try:
        assert not broker._registration_flapping()
    finally:
        writer.join()
