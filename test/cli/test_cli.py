"""The embodied-bus command line, run as real processes over real Zenoh sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from processes import helper_env

from embodied_bus import __version__
from embodied_bus.testing.ports import free_port

CLI = [sys.executable, "-m", "embodied_bus.cli.main"]
ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, check=False)


def test_version_is_printed() -> None:
    out = run("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"embodied-bus {__version__}"


def test_unknown_bus_scheme_exits_with_a_clear_error() -> None:
    out = run("echo", "imu", "--bus", "mqtt://localhost", "--count", "1")
    assert out.returncode == 1
    assert "unknown bus URL scheme 'mqtt'" in out.stderr


def test_an_executor_prefetch_below_one_or_a_negative_queue_bound_is_refused_by_name() -> None:
    out = run("executor", "--handlers", "action_handlers:HANDLERS", "--prefetch", "0")
    assert out.returncode == 2
    assert "--prefetch: must be at least 1, got 0" in out.stderr
    out = run("executor", "--handlers", "action_handlers:HANDLERS", "--concurrency", "two")
    assert out.returncode == 2 and "--concurrency: not a whole number: 'two'" in out.stderr
    out = run("queue", "--keep-ended", "-1")
    assert out.returncode == 2 and "--keep-ended: must be at least 0, got -1" in out.stderr


def test_an_executor_given_another_engines_queue_options_exits_naming_them() -> None:
    """``--prefetch`` is Pulsar's, ``--seal``/``--trust`` the Zenoh queue service's."""
    env = helper_env()
    bus = f"zenoh:?listen=tcp/127.0.0.1:{free_port()}"
    base = [*CLI, "executor", "--handlers", "action_handlers:HANDLERS", "--bus", bus, "--prefetch", "2"]
    out = subprocess.run(base, capture_output=True, text=True, timeout=60, env=env, check=False)
    assert out.returncode != 0
    assert "PulsarQueueOptions do not apply to the action queue of a Zenoh bus" in out.stderr, out.stderr
    both = [*base, "--seal", "missing.pem"]
    out = subprocess.run(both, capture_output=True, text=True, timeout=60, env=env, check=False)
    assert out.returncode != 0
    assert "--prefetch is for the Pulsar queue and --seal/--trust for the Zenoh queue service" in out.stderr


def test_echo_prints_header_fields_of_samples_from_pub() -> None:
    port = free_port()
    echo = subprocess.Popen(
        [
            *CLI,
            "echo",
            "lidar/top",
            "--bus",
            f"zenoh:?listen=tcp/127.0.0.1:{port}",
            "--ns",
            "clitest",
            "--count",
            "3",
            "--json",
            "--timeout",
            "30",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pub = run(
            "pub",
            "lidar/top",
            "--bus",
            f"zenoh://127.0.0.1:{port}",
            "--ns",
            "clitest",
            "--modality",
            "lidar",
            "--frame-id",
            "lidar_top",
            "--size",
            "2048",
            "--rate",
            "20",
            "--count",
            "40",
            "--wait-subscriber",
            "20",
        )
        assert pub.returncode == 0, pub.stderr
        out, err = echo.communicate(timeout=60)
    finally:
        echo.kill()
    assert echo.returncode == 0, err
    lines = [json.loads(x) for x in out.splitlines()]
    assert len(lines) == 3
    assert [x["seq"] for x in lines] == sorted(x["seq"] for x in lines)
    first = lines[0]
    assert first["stream"] == "lidar/top" and first["modality"] == "lidar"
    assert first["frame_id"] == "lidar_top" and first["size"] == 2048
    assert first["bucket"] == first["stamp_ns"] // 100_000_000


def test_streams_lists_live_streams_with_rate_and_gaps() -> None:
    port = free_port()
    listing = subprocess.Popen(
        [
            *CLI,
            "streams",
            "--bus",
            f"zenoh:?listen=tcp/127.0.0.1:{port}",
            "--ns",
            "clitest2",
            "--duration",
            "4",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pub = run(
            "pub",
            "imu",
            "--bus",
            f"zenoh://127.0.0.1:{port}",
            "--ns",
            "clitest2",
            "--modality",
            "imu",
            "--rate",
            "100",
            "--count",
            "250",
            "--wait-subscriber",
            "20",
        )
        assert pub.returncode == 0, pub.stderr
        out, err = listing.communicate(timeout=60)
    finally:
        listing.kill()
    assert listing.returncode == 0, err
    doc = json.loads(out)
    (row,) = doc["streams"]
    assert row["stream"] == "imu" and row["received"] > 50 and row["gaps"] == 0
    assert row["latency_p50_ms"] is not None


def test_fuse_writes_one_json_line_per_frame(tmp_path) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    frames_out = tmp_path / "frames.jsonl"
    fuse = subprocess.Popen(
        [
            *CLI,
            "fuse",
            "--config",
            "config/fusion.yaml",
            "--bus",
            f"zenoh:?listen=tcp/127.0.0.1:{port}",
            "--ns",
            "clifuse",
            "--frames-out",
            str(frames_out),
            "--duration",
            "6",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pubs = [
            run(
                "pub",
                stream,
                "--bus",
                f"zenoh://127.0.0.1:{port}",
                "--ns",
                "clifuse",
                "--rate",
                str(rate),
                "--count",
                str(count),
                "--size",
                "64",
                "--wait-subscriber",
                "20",
                "--spec",
                "config/fusion.yaml",
            )
            for stream, rate, count in (("camera/front", 30, 30), ("lidar/top", 10, 10))
        ]
        out, err = fuse.communicate(timeout=60)
    finally:
        fuse.kill()
    assert fuse.returncode == 0, err
    assert all(p.returncode == 0 for p in pubs)
    lines = [json.loads(x) for x in frames_out.read_text().splitlines()]
    assert lines and all(
        {"bucket", "members", "missing", "max_skew_ms", "end_to_end_ms"} <= set(x) for x in lines
    )
    assert any("lidar/top" in x["members"] for x in lines)
    summary = json.loads(out)
    assert summary["frames"] == len(lines)


def test_the_demo_replays_fuses_records_and_draws_in_short_mode(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = run("demo", "--rate", "8", "--json", "--out", str(tmp_path), timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["replayed"]["messages"] == {"/scan": 178, "/imu_data": 356, "/position_gps": 356}
    assert doc["fusion"]["frames"] >= 170 and doc["fusion"]["completeness_pct"] >= 80
    png = tmp_path / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from embodied_bus.replay import RecordedMessage, read_recording

    recorded = [m for m in read_recording(tmp_path / "demo.mcap") if isinstance(m, RecordedMessage)]
    topics = {m.topic for m in recorded}
    assert {"/scan", "/imu", "/gps", "/frames/demo/scan"} <= topics
    frames = [json.loads(x) for x in (tmp_path / "frames.jsonl").read_text().splitlines()]
    assert len(frames) == doc["fusion"]["frames"]
    actions = doc["actions"]
    assert actions["submitted"] == actions["succeeded"] + 1  # every navigate_to done, one poison
    assert actions["retried"] and all(
        r["executors"][0] == "exec-flaky" != r["executors"][-1] for r in actions["retried"]
    )  # retried elsewhere after a failure
    (poison,) = actions["dead_letters"]
    assert poison["kind"] == "inspect" and len(poison["reasons"]) == 3
    assert all("poison" in r for r in poison["reasons"])


def test_the_demo_replays_only_the_first_seconds_asked_for_and_refuses_a_bad_duration(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = run("demo", "--rate", "8", "--duration", "3", "--json", "--out", str(tmp_path), timeout=120)
    assert out.returncode == 0, out.stderr
    scans = json.loads(out.stdout)["replayed"]["messages"]["/scan"]
    assert 25 <= scans <= 35, scans  # 3 s of a 10 Hz laser, not the recording's 178
    bad = run("demo", "--duration", "0")
    assert bad.returncode == 2 and "expected seconds > 0" in bad.stderr


def test_the_synthetic_demo_still_runs() -> None:
    out = run("demo", "--synthetic", "--duration", "2", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["streams"]
    assert {r["stream"] for r in rows} == {"lidar/top", "camera/front", "gps", "imu"}
    assert all(r["received"] > 0 and r["gaps"] == 0 for r in rows)


def test_top_shows_streams_and_fusion_and_fuse_serves_prometheus_metrics() -> None:
    import urllib.request

    port, mport = free_port(), free_port()
    fuse = subprocess.Popen(
        [
            *CLI,
            "fuse",
            "--config",
            "config/fusion.yaml",
            "--bus",
            f"zenoh:?listen=tcp/127.0.0.1:{port}",
            "--ns",
            "clitop",
            "--duration",
            "8",
            "--json",
            "--metrics-port",
            str(mport),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    top = subprocess.Popen(
        [*CLI, "top", "--bus", f"zenoh://127.0.0.1:{port}", "--ns", "clitop", "--duration", "5", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pub = run(
            "pub",
            "lidar/top",
            "--bus",
            f"zenoh://127.0.0.1:{port}",
            "--ns",
            "clitop",
            "--rate",
            "20",
            "--count",
            "40",
            "--wait-subscriber",
            "20",
            "--spec",
            "config/fusion.yaml",
        )
        assert pub.returncode == 0, pub.stderr
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read().decode()
        top_out, _ = top.communicate(timeout=60)
        fuse.communicate(timeout=60)
    finally:
        top.kill()
        fuse.kill()
    assert "embodied_bus_fusion_frames_total" in metrics
    last = json.loads(top_out.splitlines()[-1])
    assert any(r["stream"] == "lidar/top" for r in last["streams"])
    assert (
        last["fusion"] and last["fusion"][0]["pipeline"] == "frames/fused" and last["fusion"][0]["frames"] > 0
    )


def test_top_shows_the_action_backlog_of_a_zenoh_queue_service(tmp_path) -> None:  # type: ignore[no-untyped-def]
    port, db = free_port(), str(tmp_path / "q.db")
    queue = subprocess.Popen(
        [*CLI, "queue", "--bus", f"zenoh:?listen=tcp/127.0.0.1:{port}", "--ns", "clitopq", "--db", db],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert queue.stdout is not None
        assert "action queue serving" in queue.stdout.readline()
        bus = ["--bus", f"zenoh://127.0.0.1:{port}", "--ns", "clitopq"]
        sent = run("send", "dock", *bus, "--priority", "3", "--payload", '{"station": 2}')
        assert sent.returncode == 0, sent.stderr
        top = run("top", *bus, "--duration", "2", "--json")
        assert top.returncode == 0, top.stderr
        screen = run("top", *bus, "--duration", "1")
    finally:
        queue.kill()
        queue.communicate(timeout=30)
    actions = json.loads(top.stdout.splitlines()[-1])["actions"]
    assert actions["backlog"]["dock/p3"]["queued"] == 1
    assert actions["totals"] == {"queued": 1}
    assert "dock/p3" in screen.stdout and "queued" in screen.stdout


def test_top_reads_the_action_backlog_from_the_pulsar_state_log(pulsar_url: str) -> None:
    ns = f"clitopp{time.monotonic_ns()}"
    bus = ["--bus", pulsar_url, "--ns", ns]
    sent = run("send", "dock", *bus, "--priority", "3", "--payload", '{"station": 2}')
    assert sent.returncode == 0, sent.stderr
    top = run("top", *bus, "--duration", "6", "--interval", "1", "--json")
    assert top.returncode == 0, top.stderr
    lines = [json.loads(line) for line in top.stdout.splitlines()]
    actions = lines[-1]["actions"]  # read in the background: there by the end
    assert actions is not None, lines
    assert actions["backlog"]["dock/p3"]["queued"] == 1
    assert actions["totals"] == {"queued": 1}


async def test_retry_policy_writes_the_pulsar_queues_policies_and_refuses_bad_ones(pulsar_url: str) -> None:
    from embodied_bus import open_bus
    from embodied_bus.actions.pulsar import PulsarQueue

    ns = f"clipol{time.monotonic_ns()}"
    bus = ["--bus", pulsar_url, "--ns", ns]
    out = run("retry-policy", *bus, "--max-attempts", "7", "--retry", "dock=1", "--retry", "pick=2:0.5")
    assert out.returncode == 0, out.stderr
    assert "every kind: RetryPolicy(max_attempts=7" in out.stdout and "dock: " in out.stdout
    async with open_bus(pulsar_url, namespace=ns) as b:
        queue = PulsarQueue(b.engine)  # type: ignore[arg-type]
        try:
            await queue.start()
            await queue.state.sync()
            got = {k: queue.state.policies.for_kind(k) for k in ("dock", "pick", "other")}
        finally:
            await queue.close()
    assert (got["dock"].max_attempts, got["pick"].max_attempts, got["other"].max_attempts) == (1, 2, 7)
    assert got["pick"].initial_backoff_s == 0.5
    bad = run("retry-policy", *bus, "--retry", "dock=often")
    assert bad.returncode == 1 and "--retry 'dock=often': expected KIND=ATTEMPTS[:BACKOFF_S]" in bad.stderr
    none = run("retry-policy", *bus)
    assert none.returncode == 1 and "give --max-attempts/--backoff" in none.stderr


def test_retry_policy_on_zenoh_says_it_is_the_queue_services_configuration() -> None:
    out = run("retry-policy", "--retry", "dock=1", "--connect-timeout", "5")
    assert out.returncode == 1 and "queue service's configuration" in out.stderr, out.stderr


def test_top_says_when_no_action_queue_answers() -> None:
    port = free_port()
    out = run("top", "--bus", f"zenoh:?listen=tcp/127.0.0.1:{port}", "--ns", "clitopn", "--duration", "1")
    assert out.returncode == 0, out.stderr
    assert "actions: no action queue service answered" in out.stdout


def _checks(out: subprocess.CompletedProcess[str]) -> dict[str, dict[str, str]]:
    return {c["name"]: c for c in json.loads(out.stdout)}


def test_doctor_passes_on_an_embedded_zenoh_bus_and_times_a_round_trip() -> None:
    out = run("doctor", "--bus", "zenoh:", "--ns", "doctortest", "--samples", "20", "--json")
    assert out.returncode == 0, out.stderr
    checks = _checks(out)
    assert checks["bus"]["status"] == "ok"
    assert checks["eclipse-zenoh"]["status"] == "ok"
    assert checks["zenoh links"]["status"] == "ok"  # alone, and nothing asked it to connect
    assert checks["round trip"]["status"] in ("ok", "warn")  # warn only on a very busy machine
    assert "20 samples of 1 KiB" in checks["round trip"]["detail"]


def test_doctor_fails_naming_the_broker_it_could_not_reach() -> None:
    port = free_port()
    out = run("doctor", "--bus", f"pulsar://127.0.0.1:{port}", "--timeout", "1", "--json")
    assert out.returncode == 1
    bus = _checks(out)["bus"]
    assert bus["status"] == "fail" and f"pulsar://127.0.0.1:{port}" in bus["detail"]
    assert "round trip" not in _checks(out)


def test_doctor_checks_a_pulsar_broker_end_to_end(pulsar_url: str) -> None:
    out = run("doctor", "--bus", pulsar_url, "--ns", "doctortest", "--samples", "20", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    checks = _checks(out)
    assert checks["pulsar-client"]["status"] == "ok" and checks["bus"]["status"] == "ok"
    assert checks["round trip"]["status"] in ("ok", "warn")
    assert "/dev/shm" not in checks  # Zenoh's concern only


def test_an_unknown_event_loop_in_the_environment_is_refused_by_name() -> None:
    out = subprocess.run(
        [*CLI, "doctor", "--samples", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "EMBODIED_BUS_LOOP": "trio"},
    )
    assert out.returncode == 1
    assert "EMBODIED_BUS_LOOP='trio': must be one of auto, uvloop, asyncio" in out.stderr


def test_doctor_sends_its_round_trip_through_the_router_of_the_url() -> None:
    port = free_port()
    router = subprocess.Popen(
        [*CLI, "router", "--listen", f"tcp/127.0.0.1:{port}"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert router.stdout is not None and "router listening" in router.stdout.readline()
        out = run("doctor", "--bus", f"zenoh://127.0.0.1:{port}", "--samples", "20", "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        checks = _checks(out)
        assert checks["zenoh links"]["detail"].startswith("1 router(s)")
        assert "through the URL's endpoints" in checks["round trip"]["detail"]
    finally:
        router.terminate()
        router.wait(10)


def test_the_actions_view_sums_kinds_and_derives_rates_that_never_go_negative() -> None:
    from embodied_bus.actions import Backlog
    from embodied_bus.cli.actions import ActionsView

    view = ActionsView()
    reply = {
        "backlog": {
            "pick/p5": {"queued": 2, "leased": 1, "retrying": 0, "dead": 0},
            "pick/p0": {"queued": 3, "leased": 0, "retrying": 1, "dead": 1},
        },
        "stats": {"queued": 5, "running": 1, "retrying": 1, "dead": 1, "succeeded": 10},
        "redeliveries": 4,
        "pruned": 0,
    }
    first = view.update(Backlog.from_dict(reply), 100.0)
    assert first["kinds"] == {"pick": {"queued": 5, "leased": 1, "retrying": 1, "dead": 1, "blocked": 0}}
    assert (first["queued"], first["in_flight"], first["dead_letters"], first["ended"]) == (5, 1, 1, 11)
    assert first["rates"] == {"ended_per_s": None, "redeliveries_per_s": None}
    later = {**reply, "stats": {**reply["stats"], "succeeded": 6}, "redeliveries": 8, "pruned": 24}
    second = view.update(Backlog.from_dict(later), 102.0)  # 20 more ended, 24 of all of them pruned meanwhile
    assert second["rates"] == {"ended_per_s": 10.0, "redeliveries_per_s": 2.0}
    forgot = {**reply, "stats": {"succeeded": 1}, "redeliveries": 0, "pruned": 0}
    third = view.update(
        Backlog.from_dict(forgot), 103.0
    )  # a Pulsar view that forgot old actions: no negative rate
    assert third["rates"] == {"ended_per_s": 0.0, "redeliveries_per_s": 0.0}
    text = ActionsView.text(second)
    assert "pick/p5" in text and "in flight 1" in text and "ended 31 (10/s)" in text and "(2/s)" in text


def test_a_fusion_worker_that_cannot_run_ends_its_process_with_the_error_instead_of_idling() -> None:
    """Key_Shared slots need Pulsar: on Zenoh the worker's task fails at once, and ``fuse`` (with
    no --duration) exits non-zero naming why instead of staying up with nothing to fuse."""
    t0 = time.monotonic()
    out = run("fuse", "--config", str(ROOT / "config" / "fusion.yaml"), "--scale-out", "key-shared",
              "--bus", "zenoh:", "--ns", "idle", timeout=60)  # fmt: skip
    assert out.returncode == 1 and "key_shared_ranges is a Pulsar option" in out.stderr, out.stderr
    assert time.monotonic() - t0 < 30


def _peak_rss_mb(pid: int) -> float:
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    return int(status["VmHWM"].split()[0]) / 1024


async def test_one_huge_sample_costs_a_fusion_worker_a_bounded_multiple_of_its_size() -> None:
    """A 50 MiB lidar sample is received, fused into a frame and published: the fusion worker's
    peak memory grows by at most 6 times the sample (it holds a few copies while it works; no
    shared-memory pool sized for eight such samples)."""
    import asyncio

    from embodied_bus import Backpressure, PublisherOptions, open_bus
    from embodied_bus.fusion import load_spec

    port = free_port()
    proc = subprocess.Popen(
        [*CLI, "fuse", "--config", str(ROOT / "config" / "fusion.yaml"), "--json",
         "--bus", f"zenoh:?listen=tcp/127.0.0.1:{port}", "--ns", "huge"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        async with open_bus(f"zenoh://127.0.0.1:{port}", namespace="huge", wait_s=30) as bus:
            pub = await bus.publisher(
                "lidar/top",
                clock=load_spec(ROOT / "config" / "fusion.yaml").clock,
                options=PublisherOptions(backpressure=Backpressure.BLOCK),
            )
            assert await pub.wait_for_subscribers(30)
            await asyncio.sleep(0.5)
            before = _peak_rss_mb(proc.pid)
            await pub.publish(b"\x01" * (50 << 20), stamp_ns=time.time_ns())
            await pub.flush()
            await asyncio.sleep(3.0)
            grown = _peak_rss_mb(proc.pid) - before
    finally:
        proc.send_signal(2)
        out, err = proc.communicate(timeout=60)
    summary = json.loads(out)
    assert summary["samples"] == 1 and summary["frames"] == 1, err
    assert grown <= 6 * 50, f"the worker's peak memory grew by {grown:.0f} MiB for one 50 MiB sample"
