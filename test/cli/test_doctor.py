"""The judgments of ``embodied-bus doctor``, transport-free (the command itself runs against
real engines in test_cli.py)."""

from __future__ import annotations

import pytest

from embodied_bus.actions import Backlog
from embodied_bus.cli.doctor import (
    PULSAR_SLOW_P50_MS,
    SHM_WANTED_BYTES,
    ZENOH_SLOW_P50_MS,
    Check,
    check_actions,
    check_round_trip,
    check_shm_room,
)


def test_a_slow_pulsar_round_trip_is_reported_with_the_broker_settings_that_fix_it() -> None:
    check = check_round_trip("pulsar", [PULSAR_SLOW_P50_MS * 3] * 20, 20)
    assert check.status == "warn"
    assert "managedLedgerNewEntriesCheckDelayInMillis=0" in check.detail
    assert "journalFlushWhenQueueEmpty=true" in check.detail


@pytest.mark.parametrize(("engine", "p50_ms"), [("pulsar", 0.6), ("zenoh", 0.15)])
def test_a_round_trip_at_the_engines_usual_speed_is_ok(engine: str, p50_ms: float) -> None:
    check = check_round_trip(engine, [p50_ms] * 99 + [p50_ms * 20], 100)
    assert check.status == "ok"
    assert f"p50 {p50_ms:.2f} ms" in check.detail and f"p99 {p50_ms * 20:.2f} ms" in check.detail


def test_a_slow_zenoh_round_trip_is_a_warning_not_a_failure() -> None:
    assert check_round_trip("zenoh", [ZENOH_SLOW_P50_MS * 2] * 10, 10).status == "warn"


def test_samples_that_did_not_come_back_fail_the_round_trip_and_are_counted() -> None:
    check = check_round_trip("zenoh", [0.1] * 7, 10)
    assert check.status == "fail" and check.detail.startswith("3 of 10 samples")


def test_dev_shm_smaller_than_the_pools_need_is_a_warning_naming_the_docker_option() -> None:
    small = check_shm_room(64 * 1024 * 1024)  # Docker's default
    assert small.status == "warn" and "--shm-size" in small.detail
    assert check_shm_room(SHM_WANTED_BYTES).status == "ok"
    assert check_shm_room(None).status == "skip"


def test_the_action_checks_list_executors_and_warn_about_kinds_nobody_runs() -> None:
    executors = {"arm": '{"kinds": ["pick", "place"]}', "odd": "not json", "base": '{"kinds": ["dock"]}'}
    backlog = {
        "backlog": {
            "pick/p5": {"queued": 2, "leased": 1, "retrying": 0, "dead": 0},
            "inspect/p0": {"queued": 0, "leased": 0, "retrying": 1, "dead": 2},
            "wave/p1": {"queued": 0, "leased": 0, "retrying": 0, "dead": 4},  # nothing waits
        }
    }
    queue, live, kinds = check_actions("zenoh", executors, Backlog.from_dict(backlog))
    assert queue == Check("action queue", "ok", queue.detail)
    assert "2 queued, 1 in flight, 1 retrying, 6 dead letter(s)" in queue.detail
    assert live.status == "ok" and live.detail == ("3 live: arm (pick, place), base (dock), odd (no kinds)")
    assert kinds.status == "warn" and "'inspect'" in kinds.detail and "'wave'" not in kinds.detail


def test_the_action_checks_skip_where_there_is_no_queue_or_executor() -> None:
    assert [c.status for c in check_actions("zenoh", {}, None)] == ["skip", "skip"]
    pulsar = check_actions("pulsar", {"x": '{"kinds": ["pick"]}'}, None)
    assert [c.status for c in pulsar] == ["ok", "ok"] and "no queue service needed" in pulsar[0].detail
