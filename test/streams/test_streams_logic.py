"""Transport-free stream logic: sequence tracking, bounded buffers, URL parsing."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from embodied_bus import Backpressure, BusClosedError, BusConfigError, HeaderError
from embodied_bus.engines.urls import PulsarSettings, ZenohSettings, parse_bus_url
from embodied_bus.engines.zenoh.shm import BodyBuffers
from embodied_bus.engines.zenoh.tuning import BODY_REUSE_MIN_BYTES
from embodied_bus.model import Header, Modality
from embodied_bus.model.batches import HeaderRun
from embodied_bus.model.header import validate_stream_name
from embodied_bus.model.qos import SubscriptionOptions
from embodied_bus.streams import BoundedBuffer, SequenceTracker, Subscription, Verdict
from embodied_bus.streams.backpressure import REFUSED, RESUME_FRACTION, STASH_MAX
from embodied_bus.streams.tracker import MAX_TRACKED_MISSING


def test_tracker_classifies_gaps_late_arrivals_and_duplicates() -> None:
    t = SequenceTracker()
    verdicts = [t.observe(1, s) for s in (1, 2, 5, 3, 3, 6, 4)]
    assert verdicts == [
        Verdict.IN_ORDER,
        Verdict.IN_ORDER,
        Verdict.GAP,
        Verdict.OUT_OF_ORDER,
        Verdict.DUPLICATE,
        Verdict.IN_ORDER,
        Verdict.OUT_OF_ORDER,
    ]
    assert (t.gaps, t.missing, t.out_of_order, t.duplicates) == (1, 0, 2, 1)


def test_tracker_scopes_sequences_per_publisher() -> None:
    t = SequenceTracker()
    assert t.observe(1, 10) is Verdict.IN_ORDER  # joining mid-stream is not a gap
    assert t.observe(2, 1) is Verdict.IN_ORDER
    assert t.observe(1, 11) is Verdict.IN_ORDER
    assert t.observe(2, 2) is Verdict.IN_ORDER
    assert t.publishers == 2 and t.gaps == 0


@given(st.permutations(list(range(1, 60))))
def test_any_arrival_order_is_accounted_without_false_duplicates(order: list[int]) -> None:
    t = SequenceTracker()
    # whatever comes first (a subscription joins anywhere; Pulsar redelivers older samples after
    # newer ones), nothing is mistaken for a duplicate, and every repeat is one
    assert all(t.observe(7, s) is not Verdict.DUPLICATE for s in order)
    assert t.missing == 0 and t.duplicates == 0
    assert all(t.observe(7, s) is Verdict.DUPLICATE for s in order)


def test_a_sample_older_than_the_first_one_seen_is_delivered_out_of_order_not_dropped() -> None:
    t = SequenceTracker()
    assert t.observe(1, 45) is Verdict.IN_ORDER  # a fresh sample reaches a new consumer first
    assert t.observe(1, 44) is Verdict.OUT_OF_ORDER  # then a redelivered older one
    assert t.observe(1, 44) is Verdict.DUPLICATE
    assert (t.out_of_order, t.duplicates, t.gaps) == (1, 1, 0)


def test_numbers_whose_fate_was_forgotten_are_delivered_rather_than_dropped() -> None:
    t = SequenceTracker()
    t.observe(1, 1)
    t.observe(1, MAX_TRACKED_MISSING + 100)  # a jump too long to remember every missing number
    assert t.observe(1, 50) is Verdict.OUT_OF_ORDER
    assert t.observe(1, 50) is Verdict.DUPLICATE
    top = 2 * MAX_TRACKED_MISSING
    t.observe(1, top)  # missing: the 3,995 numbers in between
    t.observe(1, top + 200)  # 199 more: the oldest remembered missing numbers are dropped
    forgotten, remembered = MAX_TRACKED_MISSING + 101, top + 100
    assert t.observe(1, forgotten) is Verdict.OUT_OF_ORDER
    assert t.observe(1, remembered) is Verdict.OUT_OF_ORDER
    assert t.observe(1, remembered) is Verdict.DUPLICATE
    assert t.observe(1, forgotten) is Verdict.DUPLICATE
    assert t.observe(1, top) is Verdict.DUPLICATE


async def test_drop_oldest_buffer_keeps_the_newest_items() -> None:
    buf: BoundedBuffer[int] = BoundedBuffer(3, Backpressure.DROP_OLDEST, asyncio.get_running_loop())
    dropped = [buf.put(i) for i in range(5)]
    assert dropped == [None, None, None, 0, 1]
    assert [await buf.get(1) for _ in range(3)] == [2, 3, 4]
    assert buf.dropped == 2


async def test_block_buffer_makes_the_producer_thread_wait_and_loses_nothing() -> None:
    buf: BoundedBuffer[int] = BoundedBuffer(2, Backpressure.BLOCK, asyncio.get_running_loop())
    done = threading.Event()

    def produce() -> None:
        for i in range(50):
            buf.put(i)
        done.set()

    th = threading.Thread(target=produce)
    th.start()
    got = []
    for _ in range(50):
        got.append(await buf.get(5))
        assert len(buf) <= 2
    th.join(5)
    assert got == list(range(50)) and done.is_set() and buf.dropped == 0


@pytest.mark.parametrize("policy", list(Backpressure))
async def test_a_closed_buffer_refuses_an_item_explicitly_even_an_equal_one_already_queued(
    policy: Backpressure,
) -> None:
    buf: BoundedBuffer[tuple[int, str]] = BoundedBuffer(1, policy, asyncio.get_running_loop())
    queued = (1, "a")
    assert buf.put(queued) is None
    waiting: list[object] = []

    def produce() -> None:  # under BLOCK this waits for room until the close
        waiting.append(buf.put((1, "a")))

    th = threading.Thread(target=produce)
    th.start()
    if policy is Backpressure.BLOCK:
        deadline = time.monotonic() + 5
        while not buf.waits and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        assert buf.waits == 1
        buf.close()
        th.join(5)
        assert waiting == [REFUSED]
    else:
        th.join(5)
        assert waiting == [queued]  # dropped to make room, and told which
        buf.close()
    assert buf.put((2, "b")) is REFUSED
    assert buf.dropped == (1 if policy is Backpressure.DROP_OLDEST else 0)


@given(
    st.lists(
        st.lists(st.tuples(st.integers(1, 2), st.integers(1, 40)), min_size=1, max_size=30),
        min_size=1,
        max_size=8,
    ),
    st.booleans(),
)
def test_a_batch_handed_over_at_once_is_accounted_as_the_same_samples_one_by_one(
    batches: list[list[tuple[int, int]]], runs: bool
) -> None:
    def header(pub: int, seq: int) -> Header:
        return Header(
            stream="s",
            modality=Modality.IMU,
            seq=seq,
            stamp_ns=1,
            bucket=0,
            bucket_width_ns=100,
            bucket_offset_ns=0,
            encoding="raw",
            frame_id="",
            publisher_id=pub,
            publish_ns=0,
        )

    async def run() -> None:
        loop = asyncio.get_running_loop()
        options = SubscriptionOptions(capacity=10_000, backpressure=Backpressure.BLOCK)
        one, many = Subscription("s", options, loop), Subscription("s", options, loop)
        columns = Subscription("s", options, loop)  # one publisher's batches as a HeaderRun
        for batch in batches:
            if runs:  # consecutive sequence numbers from one publisher: the one-pass path
                first, start = batch[0]
                batch = [(first, start + i) for i in range(len(batch))]
            items = [
                (
                    Header(
                        stream="s",
                        modality=Modality.IMU,
                        seq=q,
                        stamp_ns=1,
                        bucket=0,
                        bucket_width_ns=100,
                        bucket_offset_ns=0,
                        encoding="raw",
                        frame_id="",
                        publisher_id=pub,
                        publish_ns=0,
                    ),
                    bytes(q),
                )
                for pub, q in batch
            ]
            for h, payload in items:
                one.deliver(h, payload, None)
            many.deliver_batch(items)
            if len({pub for pub, _ in batch}) == 1:
                n = len(items)
                seqs = tuple(q for _, q in batch)
                payloads = [p for _, p in items]
                run_ = HeaderRun(items[0][0], seqs, (1,) * n, (0,) * n, (0,) * n, payloads, tuple(seqs))
                assert run_.pairs() == items
                columns.deliver_run(run_)
            else:
                columns.deliver_batch(items)
        assert many.counters() == one.counters() == columns.counters()

        def taken(sub: Subscription) -> list[tuple[int, int, bool]]:
            return [(x.header.publisher_id, x.seq, x.out_of_order) for x in iter(sub.recv_nowait, None)]

        got = taken(many)
        assert got == taken(one) == taken(columns)
        assert many.stats["s"].bytes == one.stats["s"].bytes == columns.stats["s"].bytes

    asyncio.run(run())


async def test_a_drop_oldest_buffer_given_many_at_once_keeps_the_newest_and_counts_the_rest() -> None:
    buf: BoundedBuffer[int] = BoundedBuffer(3, Backpressure.DROP_OLDEST, asyncio.get_running_loop())
    assert buf.put_many([0, 1]) == ([], [])
    dropped, refused = buf.put_many([2, 3, 4, 5, 6])
    assert sorted(dropped) == [0, 1, 2, 3] and refused == []
    assert [await buf.get(1) for _ in range(3)] == [4, 5, 6]
    assert buf.dropped == 4


async def test_a_block_buffer_given_many_at_once_wakes_the_consumer_waits_and_loses_nothing() -> None:
    buf: BoundedBuffer[int] = BoundedBuffer(4, Backpressure.BLOCK, asyncio.get_running_loop())
    done = threading.Event()

    def produce() -> None:
        for start in range(0, 100, 10):
            assert buf.put_many(list(range(start, start + 10))) == ([], [])
        done.set()

    th = threading.Thread(target=produce)
    th.start()
    got = []
    for _ in range(100):
        got.append(await buf.get(5))
        assert len(buf) <= 4
    th.join(5)
    assert got == list(range(100)) and done.is_set() and buf.dropped == 0
    buf.close()
    assert buf.put_many([1, 2]) == ([], [1, 2])  # closed: nothing is taken, nothing dropped


async def test_get_many_takes_up_to_the_limit_in_order_and_frees_room_for_a_blocked_producer() -> None:
    buf: BoundedBuffer[int] = BoundedBuffer(8, Backpressure.BLOCK, asyncio.get_running_loop())
    assert buf.get_many_nowait(5) == []
    with pytest.raises(TimeoutError):
        await buf.get_many(5, 0.05)
    n = 1000

    def produce() -> None:
        for start in range(0, n, 50):
            assert buf.put_many(list(range(start, start + 50))) == ([], [])

    th = threading.Thread(target=produce)
    th.start()
    got: list[int] = []
    while len(got) < n:
        batch = await buf.get_many(5, 5)
        assert 1 <= len(batch) <= 5 and len(buf) <= 8
        got += batch
    th.join(5)
    assert got == list(range(n)) and buf.dropped == 0
    waiter = asyncio.create_task(buf.get_many(3))
    await asyncio.sleep(0)
    buf.close()
    with pytest.raises(BusClosedError):
        await waiter


async def test_a_blocked_producer_resumes_once_a_quarter_of_the_buffer_is_free_not_per_slot() -> None:
    buf: BoundedBuffer[int] = BoundedBuffer(100, Backpressure.BLOCK, asyncio.get_running_loop())
    n = 2000

    def produce() -> None:
        assert buf.put_many(list(range(n // 2))) == ([], [])
        for i in range(n // 2, n):
            assert buf.put(i) is None

    th = threading.Thread(target=produce)
    th.start()
    got = []
    for _ in range(n):
        got.append(await buf.get(5))
        time.sleep(0.00005)  # work on the sample, letting the producer thread run
    th.join(5)
    assert got == list(range(n)) and buf.dropped == 0
    # woken per freed slot, a producer waits about once per item taken from a full buffer
    assert 0 < buf.waits <= 2 * (n // (100 // RESUME_FRACTION)), buf.waits


async def test_items_the_consumer_stashed_still_count_against_the_capacity_and_keep_their_order() -> None:
    capacity = 4 * STASH_MAX
    buf: BoundedBuffer[int] = BoundedBuffer(capacity, Backpressure.BLOCK, asyncio.get_running_loop())
    assert buf.put_many(list(range(capacity))) == ([], [])
    assert buf.get_nowait() == 0  # takes the next STASH_MAX into the consumer's stash
    assert len(buf) == capacity - 1
    finished = threading.Event()

    def produce() -> None:  # needs more room than one pop frees: waits
        assert buf.put_many(list(range(capacity, capacity + STASH_MAX))) == ([], [])
        finished.set()

    th = threading.Thread(target=produce)
    th.start()
    deadline = time.monotonic() + 5
    while not buf.waits and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    assert buf.waits == 1 and not finished.is_set() and len(buf) == capacity
    got = [0]
    while len(got) < capacity + STASH_MAX:  # popping the stash frees room and wakes it
        got.append(await buf.get(5))
        assert len(buf) <= capacity
    th.join(5)
    assert finished.is_set() and got == list(range(capacity + STASH_MAX))
    assert buf.get_many_nowait(10) == [] and len(buf) == 0


async def test_close_returns_stashed_items_first() -> None:
    buf: BoundedBuffer[int] = BoundedBuffer(4 * STASH_MAX, Backpressure.BLOCK, asyncio.get_running_loop())
    buf.put_many(list(range(STASH_MAX + 10)))
    assert buf.get_nowait() == 0
    assert buf.get_many_nowait(3) == [1, 2, 3]  # from the stash
    assert buf.close() == list(range(4, STASH_MAX + 10))


def test_the_zenoh_sender_assembles_large_batch_bodies_in_kept_buffers_without_reallocating() -> None:
    bodies = BodyBuffers(256 * 1024)
    allocated: dict[int, int] = {}
    # bodies of every size class, growing and shrinking within each, and small ones joined afresh
    for total in (200_000, 262_144, 131_073, 70_000, 150_000, 255_000, 65_536, 1_000, 100_000, 260_000):
        parts = [bytes([(total + i) % 251]) * n for i, n in enumerate(_split(total))]
        body = bodies.body(parts, total)
        assert body == b"".join(parts)
        if total < BODY_REUSE_MIN_BYTES:
            assert type(body) is bytes
            continue
        assert type(body) is bytearray
        assert allocated.setdefault(id(body), body.__alloc__()) == body.__alloc__()  # never reallocated
    assert len(allocated) == 3  # one kept buffer per size class: 256, 128 and 64 KiB


def _split(total: int) -> list[int]:
    sizes = [700 + (i * 53) % 900 for i in range(total // 700 + 1)]
    out, left = [], total
    for n in sizes:
        if left <= 0:
            break
        out.append(min(n, left))
        left -= out[-1]
    return out


async def test_get_times_out_and_close_wakes_a_waiting_consumer() -> None:
    buf: BoundedBuffer[int] = BoundedBuffer(2, Backpressure.BLOCK, asyncio.get_running_loop())
    with pytest.raises(TimeoutError):
        await buf.get(0.05)
    waiter = asyncio.create_task(buf.get())
    await asyncio.sleep(0)
    buf.close()
    with pytest.raises(BusClosedError):
        await asyncio.wait_for(waiter, 2)


@pytest.mark.parametrize("name", ["actions/state", "actions/dlq", "actions/q0/dock", "actions/q9/arm/pick"])
def test_stream_names_that_are_the_pulsar_action_queues_topics_are_refused_by_name(name: str) -> None:
    with pytest.raises(HeaderError, match=f"{name!r} is reserved"):
        validate_stream_name(name)


@pytest.mark.parametrize("name", ["actions", "actions/feedback", "actions/q10/x", "robot/actions/state"])
def test_other_stream_names_under_actions_are_free(name: str) -> None:
    assert validate_stream_name(name) == name


def test_default_url_is_an_embedded_zenoh_peer_without_scouting() -> None:
    s = parse_bus_url("zenoh:")
    assert isinstance(s, ZenohSettings)
    assert s.mode == "peer" and not s.multicast_scouting and not s.connect and not s.listen


def test_zenoh_url_options_are_parsed() -> None:
    s = parse_bus_url(
        "zenoh://10.0.0.2:7447?listen=tcp/0.0.0.0:7447&scouting=multicast&shm=1&ns=robot1&timeout=2"
    )
    assert isinstance(s, ZenohSettings)
    assert s.connect == ("tcp/10.0.0.2:7447",)
    assert s.listen == ("tcp/0.0.0.0:7447",)
    assert s.multicast_scouting and s.shm is True
    assert s.namespace == "robot1" and s.connect_timeout_s == 2.0
    r = parse_bus_url("zenoh:?mode=router&listen=tcp/0.0.0.0:7447")
    assert isinstance(r, ZenohSettings) and r.mode == "router"


def test_pulsar_urls_are_parsed() -> None:
    s = parse_bus_url(
        "pulsar+ssl://broker.example:6651?tls_ca=/ca.pem&token=abc&tenant=fleet", namespace="r2"
    )
    assert isinstance(s, PulsarSettings)
    assert s.service_url == "pulsar+ssl://broker.example:6651"
    assert s.tls_trust_certs_file == "/ca.pem" and s.token == "abc" and s.tenant == "fleet"
    assert s.namespace == "r2"
    d = parse_bus_url("pulsar://localhost")
    assert isinstance(d, PulsarSettings) and d.service_url == "pulsar://localhost:6650"
    cluster = parse_bus_url("pulsar://b1:6650,b2,[::1]:7?ns=r3")  # the brokers of one cluster
    assert isinstance(cluster, PulsarSettings)
    assert cluster.service_url == "pulsar://b1:6650,b2:6650,[::1]:7" and cluster.namespace == "r3"


@pytest.mark.parametrize(
    ("url", "pool_bytes"),
    [
        ("zenoh:", 32 << 20),  # embodied_bus's default, larger than Zenoh's 16 MiB
        ("zenoh:?shm_pool=64MiB", 64 << 20),
        ("zenoh:?shm_pool=1048576", 1 << 20),
        ("zenoh:?shm_pool=0", 16 << 20),  # 0: Zenoh's own default
    ],
)
def test_the_zenoh_shared_memory_pool_size_comes_from_the_url_or_the_default(
    url: str, pool_bytes: int
) -> None:
    from embodied_bus.engines.zenoh import build_zenoh_config

    cfg = build_zenoh_config(parse_bus_url(url))  # type: ignore[arg-type]
    assert cfg.get_json("transport/shared_memory/transport_optimization/pool_size") == str(pool_bytes)


@pytest.mark.parametrize(
    ("free_mib", "payload_mib", "pool_mib"),
    [
        (24 * 1024, 1, 32),  # a roomy /dev/shm: the default
        (24 * 1024, 8, 64),  # room for eight 8 MiB clouds
        (40, 1, 10),  # a container's nearly full 64 MiB: a quarter of what is free
        (40, 8, None),  # not even two clouds would fit: no pool, payloads go the ordinary way
    ],
)
def test_a_publishers_shared_memory_pool_fits_its_payloads_and_the_room_in_dev_shm(
    monkeypatch: pytest.MonkeyPatch, free_mib: int, payload_mib: int, pool_mib: int | None
) -> None:
    from embodied_bus.engines.zenoh import shm

    mib = 1 << 20
    monkeypatch.setattr(
        shm.os, "statvfs", lambda path: SimpleNamespace(f_bavail=free_mib * 256, f_frsize=4096)
    )
    got = shm.shm_pool_bytes(payload_mib * mib)
    assert got == (None if pool_mib is None else pool_mib * mib)


def test_a_zenoh_config_file_that_sets_the_shared_memory_pool_keeps_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from embodied_bus.engines.zenoh import build_zenoh_config

    path = tmp_path / "robot.json5"
    path.write_text("{transport: {shared_memory: {transport_optimization: {pool_size: 8388608}}}}")
    cfg = build_zenoh_config(parse_bus_url(f"zenoh:?config={path}"))  # type: ignore[arg-type]
    assert cfg.get_json("transport/shared_memory/transport_optimization/pool_size") == "8388608"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("kafka://localhost:9092", "unknown bus URL scheme 'kafka'"),
        ("zenoh:?colour=blue", "unknown zenoh URL option"),
        ("zenoh:?mode=satellite", "zenoh mode"),
        ("zenoh:?mode=client", "needs connect"),
        ("zenoh:?scouting=maybe", "scouting"),
        ("zenoh:?shm=perhaps", "shm"),
        ("zenoh:?shm_pool=lots", "shm_pool='lots' is not a size"),
        ("zenoh:?shm_pool=-5", "is not a size"),
        ("zenoh:?ns=robot one", "invalid namespace"),
        ("zenoh:?timeout=-1", "timeout"),
        ("pulsar://", "needs a host"),
        ("pulsar://h:6650?persist=1", "unknown pulsar URL option"),
        ("pulsar://h:66x", "bad port '66x'"),
        ("pulsar://a:6650,:6651", "needs a host"),
        ("", "non-empty"),
    ],
)
def test_bad_urls_get_a_clear_error(url: str, message: str) -> None:
    with pytest.raises(BusConfigError, match=message):
        parse_bus_url(url)


def test_a_batch_message_is_acknowledged_after_its_last_sample_from_any_thread() -> None:
    from embodied_bus.engines.base import SharedAck

    acked: list[int] = []
    shared = SharedAck(400, lambda: acked.append(1))
    threads = [threading.Thread(target=lambda: [shared() for _ in range(100)]) for _ in range(4)]
    for t in threads[:3]:
        t.start()
    for t in threads[:3]:
        t.join()
    assert acked == []  # 300 of 400 samples acknowledged
    threads[3].start()
    threads[3].join()
    assert acked == [1]


@given(st.lists(st.integers(0, 12_000), min_size=1, max_size=300))
def test_the_zenoh_sender_cuts_a_burst_into_the_same_puts_on_its_fast_and_general_paths(
    sizes: list[int],
) -> None:
    from embodied_bus.engines.zenoh.publisher import ZenohPublisher

    items = [(bytes([i % 251]) * n, b"h%d" % i, 1) for i, n in enumerate(sizes)]

    def puts(fast: bool) -> list[tuple[bytes, bytes]]:
        out: list[tuple[bytes, bytes]] = []
        fake = SimpleNamespace(
            put=lambda body, attachment: out.append((bytes(attachment), bytes(body))),
            shm_threshold=None,
            batches=0,
            bodies=BodyBuffers(256 * 1024),
        )
        fake.put_one = lambda body, att: ZenohPublisher.put_one(fake, body, att)  # type: ignore[arg-type]
        fake.put_run = lambda atts, bodies: ZenohPublisher.put_run(fake, atts, bodies)  # type: ignore[arg-type]
        if fast:
            atts = [att for _, att, _ in items]
            bodies = [body for body, _, _ in items]
            sizes = [len(a) + len(b) for a, b in zip(atts, bodies, strict=True)]
            assert ZenohPublisher.put_small(fake, atts, bodies, sizes) is None  # type: ignore[arg-type]
        else:
            bodies, atts = [body for body, _, _ in items], [att for _, att, _ in items]
            assert ZenohPublisher.put_mixed(fake, bodies, atts) is None  # type: ignore[arg-type]
        return out

    assert puts(fast=True) == puts(fast=False)


async def test_a_flush_returns_even_when_a_wake_up_is_lost_or_the_counts_disagree() -> None:
    """The Zenoh sender thread's ``wait_below`` (behind ``flush`` and a blocked ``publish``)
    looks again every SENDER_RECHECK_S and returns once the sender is idle with nothing queued:
    neither a lost wake-up nor a miscount can keep it waiting for good."""
    from embodied_bus.engines.zenoh.sender import SenderThread
    from embodied_bus.engines.zenoh.tuning import SENDER_RECHECK_S

    put: list[bytes] = []

    def put_all(bodies: list[bytes], atts: list[bytes], cols: object = None) -> None:
        put.extend(bodies)

    sender = SenderThread("t", put_all, 4, asyncio.get_running_loop())
    try:
        sender.wake_all = lambda: None  # type: ignore[method-assign]  # every wake-up lost
        for i in range(3):
            sender.push(b"x%d" % i, b"h", 2)
        await asyncio.wait_for(sender.wait_below(0), 5 * SENDER_RECHECK_S)
        assert put == [b"x0", b"x1", b"x2"] and sender.backlog() == 0
        sender.pushed_slots += 2  # counted, never queued
        await asyncio.wait_for(sender.wait_below(0), 5 * SENDER_RECHECK_S)
    finally:
        sender.close()


async def test_the_zenoh_sender_puts_every_payload_with_its_own_header_in_order_while_it_is_fed() -> None:
    """Payloads and headers wait in two queues (no tuple per sample); pushed from the loop while
    the sender thread drains them, every payload still goes out with its own header, in order,
    and the slot counts come back to zero (large payloads count one slot per SLOT_BYTES)."""
    from embodied_bus.engines.zenoh.sender import SenderThread, slot_count
    from embodied_bus.engines.zenoh.tuning import SLOT_BYTES

    assert slot_count([]) == 0 and slot_count([b"", b"x" * SLOT_BYTES]) == 2
    assert slot_count([b"x" * (SLOT_BYTES + 1), b"y"]) == 3
    got: list[tuple[bytes, bytes]] = []

    def put_all(bodies: list[bytes], atts: list[bytes], cols: object = None) -> None:
        assert len(bodies) == len(atts)
        got.extend(zip(bodies, atts, strict=True))

    sender = SenderThread("t", put_all, 1 << 30, asyncio.get_running_loop())
    want: list[tuple[bytes, bytes]] = []
    try:
        big = b"B" * (2 * SLOT_BYTES + 1)
        for i in range(3000):
            if i % 7 == 0:
                run = [(b"r%d.%d" % (i, k), b"R%d.%d" % (i, k)) for k in range(5)]
                sender.push_many([p for p, _ in run], [h for _, h in run])
                want.extend(run)
            else:
                payload = big + b"%d" % i if i % 101 == 0 else b"p%d" % i
                sender.push(payload, b"h%d" % i, len(payload))
                want.append((payload, b"h%d" % i))
            if i % 50 == 0:
                await asyncio.sleep(0)  # let the thread take some mid-stream
        with pytest.raises(ValueError, match="2 payloads but 1 headers"):
            sender.push_many([b"a", b"b"], [b"h"])
        await asyncio.wait_for(sender.wait_below(0), 10)
        assert got == want and sender.backlog() == 0
    finally:
        sender.close()


def test_stream_stats_compute_run_latencies_when_asked_and_keep_only_the_recent_runs() -> None:
    from embodied_bus.streams.stats import LATENCY_WINDOW, StreamStats

    st = StreamStats("s")
    assert st.latency_percentiles_ms() != st.latency_percentiles_ms()  # NaN: nothing yet
    seq = 1
    for k in range(40):  # 40 runs of 100 samples, each 1..100 ms old on arrival
        receive_ns = 10**18 + k * 10**9
        publish_ns = tuple(receive_ns - (i + 1) * 1_000_000 for i in range(100))
        assert st.observe_run(7, seq, [10] * 100, receive_ns, publish_ns)
        seq += 100
    assert st.received == 4000 and st.bytes == 40_000
    assert LATENCY_WINDOW <= st.latency_run_samples < LATENCY_WINDOW + 100
    p50, p99 = st.latency_percentiles_ms()
    assert 49.0 <= p50 <= 52.0 and 98.0 <= p99 <= 100.0
    assert not st.observe_run(7, 5, [10] * 3, 10**18, (1, 2, 3))  # not after the last seen
    for i in range(100):  # one by one: kept next to the runs
        st.observe(7, seq + i, 10, 500_000_000)
    assert st.latency_percentiles_ms()[1] == 500.0


def test_opening_a_zenoh_bus_leaves_zenohs_process_wide_logger_to_the_application() -> None:
    """zenoh-python writes its log lines to standard output; a bus that claimed the logger (it
    is first-come, process-wide) would put them among what the program prints there."""
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import asyncio, zenoh
        from embodied_bus import open_bus

        async def main() -> None:
            async with open_bus("zenoh:") as bus:
                await bus.publisher("s")
            zenoh.init_log_from_env_or("debug")  # the application's choice: takes effect
            config = zenoh.Config()
            config.insert_json5("scouting/multicast/enabled", "false")
            zenoh.open(config).close()

        asyncio.run(main())
        print("END")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "RUST_LOG"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False, env=env
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "END" and any("DEBUG" in line for line in lines[:-1])
