#!/usr/bin/env python3
"""Action-queue benchmark on both backends: end-to-end actions/s (submit → result) with
4 executors and a no-op handler, submit→start latency p50/p99, and the redelivery delay after a
nack and after an executor crash (its session closes without a goodbye). Zenoh always (embedded;
the queue service in its own process as `embodied-bus queue`, or in this one with
``--one-process``); with ``--pulsar URL`` also the Pulsar backend and raw pulsar-client
Shared-subscription throughput (4 consumers with the executors' receiver queue size, ack per
message) in the same run, with the ratio. Prints one JSON document.

With Pulsar it also measures, in the same run, what an action costs at the least in raw
pulsar-client (``raw_pulsar_floors``, see :func:`raw_pulsar_floor`): the same four consumers
answering each message with a reply the planner reads (``request_reply``), and also persisting a
start record before the reply and a result record after it (``durable_request_reply``: what
counting attempts across crashes and keeping results for an absent planner take). Their ratios
to the raw baseline are the ceiling any action queue could reach on that broker and machine.

With ``--executor-processes`` the four no-op executors run as separate ``embodied-bus executor``
processes (the deployed layout), and submit→start is taken from the start time they return.

Pulsar latency depends on two broker settings that are not Pulsar's defaults (see
``LOW_LATENCY_CONF`` in ``embodied_bus/testing/pulsar.py``): ``--pulsar auto`` starts a broker
that has them (and stops it after); against a broker of your own, the figures are that
broker's.

``--loop`` chooses the event loop (default ``auto``: uvloop if installed, as ``embodied-bus``
runs; ``asyncio`` for asyncio's own); the JSON says which ran.

``--prefetch N`` gives the Pulsar executors ``Executor(backend=PulsarQueueOptions(N))`` (default
2) and the raw baseline's consumers the same receiver queue size.

With the broker's process id (``--broker-pid``, or ``--pulsar auto``) the raw baseline also
reports the broker's CPU per message, and ``pulsar_ratio.cpu_per_action_in_raw_messages`` is
the CPU of one action (this process and the broker) in raw messages' worth of CPU (this
process's and the broker's per raw message). On a machine whose cores both sides keep busy the
throughput ratio stays near its inverse.

Usage: python bench/actions.py [--quick] [--one-process] [--executor-processes] [--loop auto|uvloop|asyncio]
       [--pulsar auto|pulsar://127.0.0.1:6650 [--pulsar-only] [--broker-pid PID] [--prefetch N]]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from embodied_bus import open_bus  # noqa: E402
from embodied_bus.actions import Action, Executor, Planner, QueueService, RetryPolicy  # noqa: E402
from embodied_bus.actions.model import encode_action  # noqa: E402
from embodied_bus.actions.pulsar import RECEIVER_QUEUE_SIZE  # noqa: E402
from embodied_bus.actions.queue import EXECUTOR_GROUP, PulsarQueueOptions  # noqa: E402
from embodied_bus.cli.actions import at_least_one  # noqa: E402  (the CLI's --prefetch check)
from embodied_bus.loop import LOOP_CHOICES, LOOP_ENV, loop_runner  # noqa: E402
from embodied_bus.testing.ports import free_port  # noqa: E402


def cpu_s() -> float:
    """CPU time (user + system) of this process, seconds."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def proc_cpu_s(pid: int) -> float | None:
    """CPU time (user + system) of process ``pid`` from /proc, seconds; None without /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


async def actions_bench(
    n_actions: int,
    pulsar_url: str | None = None,
    *,
    service_process: bool = True,
    executor_processes: bool = False,
    broker_pid: int | None = None,
    prefetch: int | None = None,
) -> dict[str, Any]:
    """One backend: Zenoh (a queue service in its own process, or in this one) or, with
    ``pulsar_url``, Pulsar (no service)."""
    if pulsar_url is None:
        port = free_port()
        url_a, url_b = f"zenoh:?listen=tcp/127.0.0.1:{port}", f"zenoh://127.0.0.1:{port}"
    else:
        url_a = url_b = pulsar_url
    ns = "bench" + uuid.uuid4().hex[:6]
    stop = asyncio.Event()
    started: dict[str, int] = {}
    tmp = Path(tempfile.mkdtemp(prefix="eb-bench-actions-"))
    policy = RetryPolicy(max_attempts=5, initial_backoff_s=0.0, max_backoff_s=0.0, jitter=0.0)
    live: set[str] = set()

    def on_member(member: str, _value: str, joined: bool) -> None:
        (live.add if joined else live.discard)(member)

    service_proc = None
    if pulsar_url is None and service_process:
        # the production layout: the queue service in its own process (`embodied-bus queue`)
        cmd = [sys.executable, "-m", "embodied_bus.cli.main", "queue", "--bus", url_a, "--ns", ns]
        cmd += ["--db", str(tmp / "q.db"), "--max-attempts", "5", "--backoff", "0"]
        service_proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert service_proc.stdout is not None
        while "action queue serving" not in service_proc.stdout.readline():
            pass
        url_a = url_b
    async with open_bus(url_a, namespace=ns) as svc_bus, open_bus(url_b, namespace=ns) as bus:
        tasks = []
        if pulsar_url is None and service_proc is None:
            ready = asyncio.Event()
            service = QueueService(svc_bus, tmp / "q.db", policy)
            tasks.append(asyncio.create_task(service.run(stop, ready)))
            await ready.wait()
        group = await svc_bus.engine.watch_group(EXECUTOR_GROUP, on_member)

        async def noop(action: Action, ctx: Any) -> None:
            started.setdefault(action.id, time.time_ns())

        nack_seen: dict[str, list[int]] = {}

        async def flaky(action: Action, ctx: Any) -> str:
            nack_seen.setdefault(action.id, []).append(time.time_ns())
            if ctx.attempt == 1:
                raise RuntimeError("first try fails")
            return "ok"

        restarted: dict[str, int] = {}

        async def finish(action: Action, ctx: Any) -> None:
            restarted.setdefault(action.id, time.time_ns())

        executors = []
        ex_procs: list[subprocess.Popen[bytes]] = []
        options = PulsarQueueOptions(prefetch) if prefetch else None
        for i in range(4):
            if executor_processes:  # the noop executors as separate processes
                cmd = [sys.executable, "-m", "embodied_bus.cli.main", "executor", "--bus", url_b]
                cmd += ["--ns", ns, "--handlers", "noop_handlers:HANDLERS", "--name", f"bench-{i}"]
                cmd += ["--concurrency", "8"] + (["--prefetch", str(prefetch)] if prefetch else [])
                env = {**os.environ, "PYTHONPATH": str(ROOT / "bench")}
                ex_procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL))
                ex = Executor(bus, f"bench-flaky-{i}", concurrency=8, backend=options)
            else:
                ex = Executor(bus, f"bench-{i}", concurrency=8, backend=options)
                ex.handler("noop")(noop)
            ex.handler("flaky")(flaky)
            executors.append(ex)
            tasks.append(asyncio.create_task(ex.run(stop)))
        while len(live) < (8 if executor_processes else 4):
            await asyncio.sleep(0.05)
        planner = Planner(bus)
        if pulsar_url is not None:  # the queue's policy: a record in its state log (Zenoh: the service's)
            await planner.set_policy(policy)

        # submit -> start latency, one at a time (no queueing)
        latencies = []
        for _ in range(min(200, n_actions)):
            submitted_ns = time.time_ns()
            h = await planner.submit("noop")
            done = await h.result(timeout_s=30)
            start_ns = done.result if executor_processes else started[h.id]
            latencies.append((start_ns - submitted_ns) / 1e6)

        # end-to-end throughput: batches submitted, all results awaited
        others = [p.pid for p in ex_procs] + ([service_proc.pid] if service_proc else [])
        c0, c0_others = cpu_s(), [proc_cpu_s(pid) for pid in others]
        b0 = proc_cpu_s(broker_pid) if broker_pid else None
        t0 = time.perf_counter()
        handles = []
        for i in range(0, n_actions, 100):
            handles += await planner.submit_many([Action("noop") for _ in range(min(100, n_actions - i))])
        await asyncio.gather(*(h.result(timeout_s=120) for h in handles))
        rate = n_actions / (time.perf_counter() - t0)
        c1, c1_others = cpu_s(), [proc_cpu_s(pid) for pid in others]
        b1 = proc_cpu_s(broker_pid) if broker_pid else None
        cpu = {"bench_process": round((c1 - c0) / n_actions * 1e3, 4)}
        if b0 is not None and b1 is not None:
            cpu["broker"] = round((b1 - b0) / n_actions * 1e3, 4)
        before = [c for c in c0_others if c is not None]
        after = [c for c in c1_others if c is not None]
        if others and len(before) == len(after) == len(others):
            spent = sum(after) - sum(before)
            cpu["queue_service_and_executor_processes"] = round(spent / n_actions * 1e3, 4)

        # redelivery delay after a nack
        nack_delays = []
        for _ in range(20):
            h = await planner.submit("flaky")
            await h.result(timeout_s=30)
            t = nack_seen[h.id]
            nack_delays.append((t[1] - t[0]) / 1e6)

        # redelivery delay after a crash: an executor whose session vanishes mid-action
        crash_delays = []
        for _ in range(5 if n_actions <= 2000 else 10):
            async with open_bus(url_b, namespace=ns) as doomed_bus:
                doomed = Executor(doomed_bus, f"doomed-{uuid.uuid4().hex[:4]}")
                holding = asyncio.Event()

                async def hang(action: Action, ctx: Any, holding: asyncio.Event = holding) -> None:
                    holding.set()
                    await asyncio.sleep(3600)

                doomed.handler("crashy")(hang)
                dstop = asyncio.Event()
                dtask = asyncio.create_task(doomed.run(dstop))
                while doomed.name not in live:
                    await asyncio.sleep(0.01)
                h = await planner.submit("crashy")
                await holding.wait()
                rescuer = Executor(bus, f"rescuer-{uuid.uuid4().hex[:4]}")
                rescuer.handler("crashy")(finish)
                rstop = asyncio.Event()
                rtask = asyncio.create_task(rescuer.run(rstop))
                while rescuer.name not in live:
                    await asyncio.sleep(0.01)
                # a crash as the others see it: the engine session drops without a goodbye from
                # the executor (liveliness token gone on Zenoh, consumer disconnect on Pulsar)
                crashed_ns = time.time_ns()
                await doomed_bus.close()
                dtask.cancel()
            done = await h.result(timeout_s=30)
            assert done.status.value == "succeeded", done
            crash_delays.append((restarted[h.id] - crashed_ns) / 1e6)
            rstop.set()
            await rtask

        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for p in ex_procs:
            p.send_signal(signal.SIGINT)
        for p in ex_procs:
            p.wait(20)
        await planner.close()
        await group.leave()
    if service_proc is not None:
        service_proc.send_signal(signal.SIGINT)
        service_proc.wait(20)
    return {
        "actions": n_actions,
        "executors": 4,
        **({"prefetch": prefetch or RECEIVER_QUEUE_SIZE} if pulsar_url else {}),
        "layout": (
            "no queue service (Pulsar); 4 noop executors each in its own process, planner in this one"
            if pulsar_url and executor_processes
            else "no queue service (Pulsar); planner and 4 executors in this one"
            if pulsar_url
            else "queue service and 4 noop executors each in its own process; planner in this one"
            if service_proc and executor_processes
            else "queue service in its own process; planner and 4 executors in this one"
            if service_proc
            else "queue service, planner and executors in one process"
        ),
        "actions_per_s": round(rate, 1),
        # CPU per action while the throughput ran, ms (Pulsar: the broker's own only with
        # --broker-pid; with --executor-processes, theirs is under
        # queue_service_and_executor_processes)
        "cpu_ms_per_action": cpu,
        "submit_to_start_ms": {"p50": pct(latencies, 50), "p99": pct(latencies, 99)},
        "redelivery_after_nack_ms": {"p50": pct(nack_delays, 50), "p99": pct(nack_delays, 99)},
        "redelivery_after_crash_ms": {"p50": pct(crash_delays, 50), "max": pct(crash_delays, 100)},
    }


#: Raw pulsar-client messages per action of ours: the baseline then runs about as long as ours.
RAW_MESSAGES_PER_ACTION = 6


def _drive_raw(
    threads: list[Any],
    producer: Any,
    body: bytes,
    n: int,
    done: Any,
    finished: Any,
    client: Any,
    broker_pid: int | None,
    what: str,
) -> tuple[float, float, float | None]:
    """Start ``threads``, send ``n`` messages of ``body``, wait until ``done`` was released ``n``
    times, then stop the threads and close ``client``.

    Returns:
        (per second, CPU ms of this process per message, the broker's or None).
    """
    c0 = cpu_s()
    b0 = proc_cpu_s(broker_pid) if broker_pid else None
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for _ in range(n):
        producer.send_async(body, None)
    producer.flush()
    for _ in range(n):
        if not done.acquire(timeout=60):
            raise RuntimeError(f"{what}: a message did not arrive within 60 s")
    rate = n / (time.perf_counter() - t0)
    cpu_ms = (cpu_s() - c0) / n * 1e3
    b1 = proc_cpu_s(broker_pid) if broker_pid else None
    finished.set()
    for t in threads:
        t.join(2)
    client.close()
    broker_ms = (b1 - b0) / n * 1e3 if b0 is not None and b1 is not None else None
    return rate, cpu_ms, broker_ms


def raw_pulsar_shared(
    url: str, n: int, receiver_queue_size: int | None = None, broker_pid: int | None = None
) -> dict[str, Any]:
    import threading

    import pulsar

    from embodied_bus.engines.pulsar.logs import native_logger

    queue_size = receiver_queue_size or RECEIVER_QUEUE_SIZE

    # the logger embodied_bus's clients use (native, on stderr): the C++ client keeps the first
    # client's logger for every later client of the process, and pulsar.ConsoleLogger writes
    # to stdout, where this script's JSON goes
    client = pulsar.Client(url, logger=native_logger())
    topic = f"persistent://public/default/eb-bench-actions-{uuid.uuid4().hex[:8]}"
    # the executors' receiver queue (raw measures the same with 1 and 2)
    consumers = [
        client.subscribe(
            topic,
            "workers",
            consumer_type=pulsar.ConsumerType.Shared,
            receiver_queue_size=queue_size,
        )
        for _ in range(4)
    ]
    # block, not fail, when 1,000 sends are pending (a failed send_async without a callback is
    # silently lost, and the baseline would wait for messages that were never published)
    producer = client.create_producer(topic, batching_enabled=False, block_if_queue_full=True)
    done = threading.Semaphore(0)
    finished = threading.Event()

    def work(c: Any) -> None:
        while not finished.is_set():
            try:
                msg = c.receive(timeout_millis=200)
            except pulsar.Timeout:
                continue
            except pulsar.AlreadyClosed:  # the client closed under us
                return
            c.acknowledge(msg)
            done.release()

    threads = [threading.Thread(target=work, args=(c,), daemon=True) for c in consumers]
    rate, cpu_ms, broker_ms = _drive_raw(
        threads, producer, b"{}", n, done, finished, client, broker_pid, "raw Pulsar baseline"
    )
    return {
        "messages": n,
        "consumers": 4,
        "receiver_queue_size": queue_size,
        "msgs_per_s": round(rate, 1),
        "cpu_ms_per_msg": round(cpu_ms, 4),  # this process
        **({"broker_cpu_ms_per_msg": round(broker_ms, 4)} if broker_ms is not None else {}),
    }


#: Raw pulsar-client request/reply exchanges per action of ours, for the floors below.
RAW_EXCHANGES_PER_ACTION = 3


def raw_pulsar_floor(
    url: str,
    n: int,
    receiver_queue_size: int | None = None,
    broker_pid: int | None = None,
    *,
    durable: bool = False,
) -> dict[str, Any]:
    """What an action costs at the least in raw pulsar-client, no embodied_bus involved.

    The raw Shared baseline's four consumers (same receiver queue, one thread each), but each
    message is a request to answer: the consumer sends a reply to a non-persistent topic that
    a fifth consumer (the planner) reads, then acks. With ``durable`` the consumer first
    persists a start record on a state topic and runs the "handler" (the reply) only once the
    broker confirms it, then persists a result record too: the least an action needs whose
    attempts survive a consumer crash and whose result a planner that was away can fetch (as
    the issue asks). Records go through a batching producer (1 ms), as embodied_bus batches
    its state records. The request body is an action envelope of a no-op action.

    Returns:
        ``exchanges_per_s`` (requests answered end to end per second), CPU per exchange of
        this process and, with ``broker_pid``, of the broker.
    """
    import threading

    import pulsar

    from embodied_bus.engines.pulsar.logs import native_logger

    queue_size = receiver_queue_size or RECEIVER_QUEUE_SIZE
    client = pulsar.Client(url, logger=native_logger())
    tag = uuid.uuid4().hex[:8]
    queue = f"persistent://public/default/eb-bench-floor-{tag}"
    replies = f"non-persistent://public/default/eb-bench-floor-replies-{tag}"
    state = f"persistent://public/default/eb-bench-floor-state-{tag}"
    consumers = [
        client.subscribe(
            queue, "workers", consumer_type=pulsar.ConsumerType.Shared, receiver_queue_size=queue_size
        )
        for _ in range(4)
    ]
    planner = client.subscribe(replies, "planner", receiver_queue_size=1000)
    reply_producers = [
        client.create_producer(replies, batching_enabled=False, block_if_queue_full=True) for _ in consumers
    ]
    state_producers = [
        client.create_producer(
            state, batching_enabled=True, batching_max_publish_delay_ms=1, block_if_queue_full=True
        )
        for _ in consumers
    ]
    producer = client.create_producer(queue, batching_enabled=False, block_if_queue_full=True)
    body = encode_action(Action("noop", {"i": 0}))
    done = threading.Semaphore(0)
    finished = threading.Event()

    def plan() -> None:
        while not finished.is_set():
            try:
                planner.receive(timeout_millis=200)
            except pulsar.Timeout:
                continue
            except pulsar.AlreadyClosed:
                return
            done.release()

    def work(i: int, c: Any) -> None:
        reply, records = reply_producers[i], state_producers[i]
        while not finished.is_set():
            try:
                msg = c.receive(timeout_millis=200)
            except pulsar.Timeout:
                continue
            except pulsar.AlreadyClosed:
                return
            if not durable:
                reply.send_async(msg.data(), None)
                c.acknowledge(msg)
                continue

            def started(_result: Any, _mid: Any, msg: Any = msg, c: Any = c) -> None:  # client thread
                records.send_async(msg.data(), None)  # the result record
                reply.send_async(msg.data(), None)
                c.acknowledge(msg)

            records.send_async(msg.data(), started)  # the start record, persisted before the reply

    threads = [threading.Thread(target=plan, daemon=True)]
    threads += [threading.Thread(target=work, args=(i, c), daemon=True) for i, c in enumerate(consumers)]
    rate, cpu_ms, broker_ms = _drive_raw(
        threads, producer, body, n, done, finished, client, broker_pid, "raw Pulsar floor"
    )
    return {
        "exchanges": n,
        "consumers": 4,
        "receiver_queue_size": queue_size,
        "durable_records": durable,
        "exchanges_per_s": round(rate, 1),
        "cpu_ms_per_exchange": round(cpu_ms, 4),  # this process
        **({"broker_cpu_ms_per_exchange": round(broker_ms, 4)} if broker_ms is not None else {}),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--one-process", action="store_true", help="host the Zenoh queue service in this process")
    p.add_argument(
        "--executor-processes",
        action="store_true",
        help="run the 4 no-op executors as separate `embodied-bus executor` processes",
    )
    p.add_argument(
        "--pulsar",
        default=None,
        help="Pulsar broker URL for the Pulsar backend and the raw Shared-subscription baseline, or "
        "'auto': start an Apache Pulsar standalone with the project's broker settings "
        "(embodied_bus.testing.pulsar), warm it up, and stop it after",
    )
    p.add_argument("--pulsar-only", action="store_true", help="skip the Zenoh backend (needs --pulsar)")
    p.add_argument(
        "--broker-pid",
        type=int,
        default=None,
        help="process id of the Pulsar broker (on this host): its CPU per action is reported too",
    )
    p.add_argument(
        "--prefetch",
        type=at_least_one,
        default=None,
        metavar="N",
        help="Pulsar: the executors' prefetch per priority level (PulsarQueueOptions(N); default 2); "
        "the raw baseline's consumers then use the same receiver queue size",
    )
    p.add_argument(
        "--loop",
        choices=LOOP_CHOICES,
        default="auto",
        help="event loop of this process and of the queue service and executor processes: "
        "auto (uvloop if installed, as the command line runs; the default), uvloop or asyncio",
    )
    args = p.parse_args()
    loop_name, run = loop_runner(args.loop)
    os.environ[LOOP_ENV] = args.loop  # the `embodied-bus queue` and `executor` processes

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # so a broker started with --pulsar auto is stopped and deleted

    signal.signal(signal.SIGTERM, terminate)
    if args.pulsar_only and not args.pulsar:
        p.error("--pulsar-only needs --pulsar URL")
    n = 1000 if args.quick else 5000
    out: dict[str, Any] = {"event_loop": loop_name}
    if not args.pulsar_only:
        zenoh = run(
            actions_bench(n, service_process=not args.one_process, executor_processes=args.executor_processes)
        )
        zenoh["targets"] = {
            "actions_per_s": 2000,
            "submit_to_start_p50_ms": 2.0,
            "redelivery_after_crash_ms": 1000,
        }
        out["zenoh"] = zenoh
    if args.pulsar:
        url, broker_pid = args.pulsar, args.broker_pid
        with contextlib.ExitStack() as stack:
            if url == "auto":
                from embodied_bus.testing.pulsar import PulsarStandalone

                broker = stack.enter_context(PulsarStandalone())  # started; cleaned up on exit
                url = broker.url
                if broker_pid is None and broker.proc is not None:
                    broker_pid = broker.proc.pid  # the JVM (bin/pulsar execs it)
                # a fresh broker's JVM is cold: the first seconds of work run slower. Both sides
                # are warmed, neither reported: with the raw baseline's traffic, and with a round
                # of actions (raw traffic alone leaves the broker's action path cold)
                raw_pulsar_shared(url, RAW_MESSAGES_PER_ACTION * n, args.prefetch, broker_pid)
                for durable in (False, True):
                    raw_pulsar_floor(
                        url, RAW_EXCHANGES_PER_ACTION * n, args.prefetch, broker_pid, durable=durable
                    )
                run(actions_bench(n, url, broker_pid=broker_pid, prefetch=args.prefetch))
                out["pulsar_broker"] = "started by the bench (embodied_bus.testing.pulsar), warmed up"
            ours = run(
                actions_bench(
                    n,
                    url,
                    executor_processes=args.executor_processes,
                    broker_pid=broker_pid,
                    prefetch=args.prefetch,
                )
            )
            # raw runs about as long as ours (a short burst reads higher than the same client
            # sustained over seconds)
            raw = raw_pulsar_shared(url, RAW_MESSAGES_PER_ACTION * n, args.prefetch, broker_pid)
            # what an action costs at the least in raw pulsar-client (see raw_pulsar_floor)
            floors = {
                "request_reply": raw_pulsar_floor(
                    url, RAW_EXCHANGES_PER_ACTION * n, args.prefetch, broker_pid
                ),
                "durable_request_reply": raw_pulsar_floor(
                    url, RAW_EXCHANGES_PER_ACTION * n, args.prefetch, broker_pid, durable=True
                ),
            }
        out["pulsar"] = ours
        out["raw_pulsar_shared"] = raw
        out["raw_pulsar_floors"] = floors
        out["pulsar_ratio"] = {
            "actions_per_s_vs_raw_msgs_per_s": round(ours["actions_per_s"] / raw["msgs_per_s"], 3),
            "target": 0.5,
            # the same ratio for raw pulsar-client code doing the least an action needs: the
            # ceiling of any action queue on this broker and machine
            "raw_request_reply_vs_raw_msgs_per_s": round(
                floors["request_reply"]["exchanges_per_s"] / raw["msgs_per_s"], 3
            ),
            "raw_durable_request_reply_vs_raw_msgs_per_s": round(
                floors["durable_request_reply"]["exchanges_per_s"] / raw["msgs_per_s"], 3
            ),
            "actions_per_s_vs_raw_durable_request_reply": round(
                ours["actions_per_s"] / floors["durable_request_reply"]["exchanges_per_s"], 3
            ),
        }
        cpu = ours["cpu_ms_per_action"]
        if "broker" in cpu and "broker_cpu_ms_per_msg" in raw:
            # Where both sides keep the machine's cores busy, the ratio cannot exceed the
            # inverse of this: the CPU (this process and the broker) of one action, counted in
            # raw messages' worth of CPU
            others_ms = cpu.get("queue_service_and_executor_processes", 0)
            ours_ms = cpu["bench_process"] + cpu["broker"] + others_ms
            raw_ms = raw["cpu_ms_per_msg"] + raw["broker_cpu_ms_per_msg"]
            out["pulsar_ratio"]["cpu_per_action_in_raw_messages"] = round(ours_ms / raw_ms, 2)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
