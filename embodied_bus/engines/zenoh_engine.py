"""Zenoh engine: an embedded peer (default), a client of a router, or a router itself.

Key layout: ``eb/<namespace>/s/<stream>``. The binary header rides in the Zenoh attachment and
the payload is passed through untouched.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import threading
import time
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from itertools import accumulate, repeat
from operator import add
from typing import Any, cast

import zenoh

from embodied_bus.engines._blocking import call_bounded, resolve_none
from embodied_bus.engines.base import (
    Engine,
    EnginePublisher,
    EngineSubscriber,
    FastSend,
    FastSendMany,
    GroupMembership,
    MembershipCallback,
    MessageSink,
    hand_over_batch,
)
from embodied_bus.engines.urls import DEFAULT_SHM_POOL_BYTES, ZenohSettings
from embodied_bus.errors import (
    BusClosedError,
    BusConfigError,
    BusConnectionError,
    HeaderError,
    PublishError,
)
from embodied_bus.model.qos import Backpressure, PublisherOptions, SubscriptionOptions
from embodied_bus.model.wire import (
    MAX_BATCH_SAMPLES,
    Header,
    HeaderFlags,
    HeaderPacker,
    decode_batch_runs,
    decode_header,
    encode_batch_parts,
    encode_column_batch,
    encode_header,
    encode_strings,
    is_batch,
    with_header_flags,
)

__all__ = ["ZenohEngine", "build_zenoh_config", "stream_key"]

#: Shared-memory pool of a publisher that writes large payloads into shared memory: at least
#: this many bytes ...
SHM_POOL_BYTES = 32 * 1024 * 1024
#: ... and room for this many of its first large payload (8 MiB clouds: 64 MiB; measured at
#: 8 MiB: 4 in flight sent 22 % of the samples the ordinary way, 8 about 3 %). Created at the
#: first such payload, in ``/dev/shm``, only if that has room for twice the pool; when the
#: pool is full a payload goes the ordinary way (Zenoh copies it), the publisher never waits.
SHM_POOL_SAMPLES = 8
#: ... but never more than this many bytes: memory a publisher maps for its pool stays bounded
#: whatever size its first large payload has.
SHM_POOL_MAX_BYTES = 128 * 1024 * 1024
#: Payloads larger than this go the ordinary way (Zenoh copies them once), not through the
#: pool: a rare huge sample costs its own size, not a pool sized for eight of it.
SHM_MAX_PAYLOAD_BYTES = 16 * 1024 * 1024
#: Payloads at least this large are copied out of Zenoh by the consuming thread, not by
#: Zenoh's receive thread. Zenoh reassembles messages above its 64 KiB batch into their own
#: buffer (or hands over a shared-memory segment), so holding one pins no receive batch; a
#: queued shared-memory sample holds its segment until it is taken or dropped (the publisher
#: then sends the ordinary way, it never waits for a segment).
LAZY_COPY_BYTES = 64 * 1024
#: Samples a BLOCK publisher may queue before ``publish`` awaits room ...
SENDER_HIGH_WATER = 1024
#: ... and bytes of payload: a queued sample counts as ``max(1, ceil(size / slot))`` samples,
#: slot = this / :data:`SENDER_HIGH_WATER` (64 KiB), so at most ~64 MiB wait (eight 8 MiB
#: clouds).
SENDER_HIGH_WATER_BYTES = 64 * 1024 * 1024
_SLOT_BYTES = SENDER_HIGH_WATER_BYTES // SENDER_HIGH_WATER
#: Longest wait of ``flush`` or a blocked ``publish`` for the sender thread's wake-up before it
#: looks at the sender's state again, seconds.
SENDER_RECHECK_S = 0.5
#: Allocation policy of the shared-memory pool: collect freed segments, never wait.
_SHM_ALLOC = zenoh.shm.GarbageCollect()
#: How long a request waits past its own timeout for Zenoh to say it is done, seconds (a
#: session closed under a query never does).
REQUEST_GRACE_S = 1.0
#: Samples (header and payload) up to this size that queue up behind a BLOCK publisher's
#: sender thread go out batched (wire format: a batch attachment); bytes.
BATCH_ITEM_MAX_BYTES = 16 * 1024
#: Most bytes in one batch (Zenoh fragments a message above its 64 KiB transport batch; one
#: put of 256 KiB still cost 9-20 % less CPU per 1 KiB sample than four of 64 KiB, measured).
BATCH_MAX_BYTES = 256 * 1024
#: Batch bodies of at least this many bytes are assembled in buffers the sender thread keeps
#: (see :class:`_BodyBuffers`); smaller ones are joined afresh.
BODY_REUSE_MIN_BYTES = 64 * 1024
#: Longest wait for the session to close, seconds (then it is left behind on a daemon thread).
CLOSE_TIMEOUT_S = 10.0

_logger = logging.getLogger("embodied_bus.zenoh")
_log_init = threading.Lock()
_log_done = False


def _init_logging() -> None:
    """Zenoh's own log lines, only when ``RUST_LOG`` asks for them: zenoh-python writes them to
    standard output, where they would corrupt what a program prints there (JSON, samples).
    A default level of "error" once put a shared-memory watchdog's "timer overrun" into the
    middle of a benchmark's JSON."""
    global _log_done
    with _log_init:
        if not _log_done:
            zenoh.try_init_log_from_env()  # type: ignore[no-untyped-call]
            _log_done = True


def stream_key(namespace: str, stream: str | None) -> str:
    """Zenoh key expression of a stream (``None``: every stream of the namespace)."""
    return f"eb/{namespace}/s/{stream}" if stream is not None else f"eb/{namespace}/s/**"


_SHM_POOL_KEY = "transport/shared_memory/transport_optimization/pool_size"
_SHM_ENABLED_KEY = "transport/shared_memory/enabled"


_LISTEN_KEY = "listen/endpoints"
#: What Zenoh listens on when nobody said (a plaintext port on every interface, for peers).
_DEFAULT_LISTEN = zenoh.Config().get_json(_LISTEN_KEY)


def _secured(settings: ZenohSettings) -> bool:
    """TLS settings or a config file (access control, TLS): a plaintext default listener would
    be a side door around them. Plain peers keep Zenoh's default and mesh with each other."""
    return bool(settings.tls_ca or settings.tls_cert or settings.mtls or settings.config_file)


def _check_tls_endpoints(settings: ZenohSettings) -> None:
    """A bus with TLS settings listens and connects on TLS endpoints only.

    Raises:
        BusConfigError: A plaintext endpoint beside TLS settings (named).
    """
    if not (settings.tls_ca or settings.tls_cert or settings.mtls):
        return
    plain = [e for e in (*settings.listen, *settings.connect) if not e.startswith(("tls/", "quic/"))]
    if plain:
        raise BusConfigError(
            f"a TLS bus uses tls/ (or quic/) endpoints only; remove the plaintext endpoint(s) {plain} "
            "or open a second bus for them"
        )


def build_zenoh_config(settings: ZenohSettings) -> zenoh.Config:
    """Translate settings into a Zenoh config.

    Raises:
        BusConfigError: The config file cannot be read or a value is rejected by Zenoh.
    """
    try:
        cfg = zenoh.Config.from_file(settings.config_file) if settings.config_file else zenoh.Config()
        cfg.insert_json5("mode", json.dumps(settings.mode))
        cfg.insert_json5("scouting/multicast/enabled", json.dumps(settings.multicast_scouting))
        _check_tls_endpoints(settings)
        if settings.listen:
            cfg.insert_json5("listen/endpoints", json.dumps(list(settings.listen)))
        elif (
            _secured(settings) and settings.mode != "router" and cfg.get_json(_LISTEN_KEY) == _DEFAULT_LISTEN
        ):
            # a secured peer or client listens only where it is told: Zenoh's own default would
            # open a plaintext port on every interface beside its TLS endpoints or access control
            cfg.insert_json5(_LISTEN_KEY, "[]")
        if settings.connect:
            cfg.insert_json5("connect/endpoints", json.dumps(list(settings.connect)))
            cfg.insert_json5("connect/timeout_ms", str(int(settings.connect_timeout_s * 1000)))
            cfg.insert_json5("connect/exit_on_failure", "true")
        if settings.shm is not None:
            cfg.insert_json5("transport/shared_memory/enabled", json.dumps(settings.shm))
        pool = settings.shm_pool_bytes
        if pool is None:
            engine_default = zenoh.Config().get_json(_SHM_POOL_KEY)
            if settings.config_file is None or cfg.get_json(_SHM_POOL_KEY) == engine_default:
                pool = DEFAULT_SHM_POOL_BYTES  # the config file did not choose one
        if pool:
            cfg.insert_json5(_SHM_POOL_KEY, str(pool))
        tls = "transport/link/tls/"
        if settings.tls_ca:
            cfg.insert_json5(tls + "root_ca_certificate", json.dumps(settings.tls_ca))
        if settings.tls_cert and settings.tls_key:
            cfg.insert_json5(tls + "listen_certificate", json.dumps(settings.tls_cert))
            cfg.insert_json5(tls + "listen_private_key", json.dumps(settings.tls_key))
            if settings.mtls:
                cfg.insert_json5(tls + "connect_certificate", json.dumps(settings.tls_cert))
                cfg.insert_json5(tls + "connect_private_key", json.dumps(settings.tls_key))
        if settings.mtls:
            cfg.insert_json5(tls + "enable_mtls", "true")
    except zenoh.ZError as err:
        raise BusConfigError(f"invalid Zenoh configuration: {err}") from err
    except OSError as err:
        raise BusConfigError(f"cannot read Zenoh config file {settings.config_file!r}: {err}") from err
    return cfg


#: Stamps, buckets and publish times of the template samples a sender thread took, in order.
_Columns = tuple[list[int], list[int], list[int]]
#: Bytes of an encoded header before its tail (the string lengths and strings): see
#: :class:`HeaderPacker`.
_HEADER_FIXED_BYTES = 62


def _batch_cuts(sizes: list[int]) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of consecutive runs of samples of these sizes (bytes), each of at most
    :data:`BATCH_MAX_BYTES` and :data:`MAX_BATCH_SAMPLES` (a sample larger than that alone),
    cut with C-level calls."""
    ends = list(accumulate(sizes))
    n = len(sizes)
    i = 0
    while i < n:
        start = ends[i - 1] if i else 0
        j = bisect_right(ends, start + BATCH_MAX_BYTES, i + 1, min(n, i + MAX_BATCH_SAMPLES))
        yield i, j
        i = j


def _slots(payloads: Sequence[Any]) -> int:
    """Sender-queue slots of these payloads: one per sample, or one per :data:`_SLOT_BYTES` of
    a larger payload."""
    sizes = list(map(len, payloads))
    if max(sizes, default=0) <= _SLOT_BYTES:
        return len(sizes)
    return sum((size + _SLOT_BYTES - 1) // _SLOT_BYTES or 1 for size in sizes)


def _take(items: list[Any], n: int) -> list[Any]:
    """Remove and return the first ``n`` of ``items`` (two C-level calls: another thread may
    append meanwhile, never remove)."""
    taken = items[:n]
    del items[:n]
    return taken


class _SenderThread:
    """Runs blocking ``put`` calls off the event loop (Zenoh congestion control BLOCK).

    A BLOCK put waits while the transport queue is full. On the loop thread that could stall
    the very consumer that would free it (publisher and subscriber in one process), so BLOCK
    publishers hand samples to this named thread; the asyncio side awaits room when more than
    ``high_water`` samples are queued. Whatever queued up while the thread was putting goes
    out in one call of ``put_all`` (which may batch small samples: no waiting is added).
    """

    def __init__(
        self,
        name: str,
        put_all: Callable[[list[Any], list[bytes | int], _Columns | None], BaseException | None],
        high_water: int,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._put_all = put_all
        self._loop = loop
        self.high_water = high_water
        # the queued samples' payloads and headers, in queues of their own (no tuple per
        # sample). A header is the encoded header, or (a sample of the publisher's template,
        # :meth:`_ZenohPublisher.fast_sender`) its seq, with its stamp, bucket and publish time
        # in the three column queues. A sample's header (or seq) is appended last, so every
        # header the thread counts has its payload and columns queued
        self._payloads: list[Any] = []
        self._atts: list[bytes | int] = []
        self._stamps: list[int] = []
        self._buckets: list[int] = []
        self._pubs: list[int] = []
        # slots pushed (by the publishing thread) and sent (by this thread): each has one writer
        self._pushed_slots = 0
        self._sent_slots = 0
        self._cond = threading.Condition(threading.Lock())
        self._idle = False
        self._waiters: list[asyncio.Future[None]] = []
        self._closed = False
        self._miscounted = False  # warned once that the counts disagree with an idle sender
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"eb-zenoh-put-{name}", daemon=True)
        self._thread.start()

    def push(self, payload: Any, attachment: bytes, size: int) -> None:
        # No lock while the thread is busy: ``deque.append`` is atomic, and the thread checks
        # for items under the lock before it waits (so an item appended before ``_idle`` is
        # set is seen, and one appended after finds ``_idle`` set and notifies). Taking the
        # lock on every push made the publishing loop queue behind the sender thread.
        self._payloads.append(payload)
        self._atts.append(attachment)
        self._pushed_slots += (size + _SLOT_BYTES - 1) // _SLOT_BYTES or 1  # the publisher's thread only
        if self._idle:
            self.wake()

    def wake(self) -> None:
        """Wake the thread if it is idle (call after appending to ``_atts``: see :meth:`push`)."""
        with self._cond:
            if self._idle:
                # woken once: later pushes find it already woken
                self._idle = False
                self._cond.notify()

    def push_many(self, payloads: Sequence[Any], attachments: Sequence[bytes]) -> None:
        """:meth:`push` for a run of samples, in order (one wake-up for the run)."""
        if len(payloads) != len(attachments):
            raise ValueError(f"{len(payloads)} payloads but {len(attachments)} headers")
        self._payloads.extend(payloads)
        self._atts.extend(attachments)
        self._pushed_slots += _slots(payloads)
        if self._idle:
            self.wake()

    def push_columns(
        self,
        payloads: Sequence[Any],
        seqs: Sequence[int],
        stamps_ns: Sequence[int],
        buckets: Sequence[int],
        publish_ns: Sequence[int],
    ) -> None:
        """:meth:`push_many` for samples of the publisher's template, given by their seq,
        stamp, bucket and publish time (encoded by the thread, as columns where it can)."""
        n = len(payloads)
        if not len(seqs) == len(stamps_ns) == len(buckets) == len(publish_ns) == n:
            raise ValueError(f"{n} payloads but columns of other lengths")
        self._payloads.extend(payloads)
        self._stamps.extend(stamps_ns)
        self._buckets.extend(buckets)
        self._pubs.extend(publish_ns)
        self._atts.extend(seqs)
        self._pushed_slots += _slots(payloads)
        if self._idle:
            self.wake()

    def backlog(self) -> int:
        """Slots (a sample, or one per :data:`_SLOT_BYTES` of its payload) queued or being put."""
        return self._pushed_slots - self._sent_slots

    def _run(self) -> None:
        atts, payloads = self._atts, self._payloads
        while True:
            if not atts:
                with self._cond:
                    self._idle = True  # before the check: a push after it sees the flag
                    while not atts and not self._closed:
                        self._cond.wait()
                    self._idle = False
                    if not atts and self._closed:
                        self._wake_all()
                        return
            # the pushing thread may append meanwhile (taken next round); every header counted
            # here has its payload queued already
            n = len(atts)
            batch_atts, bodies = _take(atts, n), _take(payloads, n)
            kinds = set(map(type, batch_atts))
            k = n if kinds == {int} else 0 if int not in kinds else sum(type(a) is int for a in batch_atts)
            cols: _Columns | None = None
            if k:
                cols = (_take(self._stamps, k), _take(self._buckets, k), _take(self._pubs, k))
            try:
                err = self._put_all(bodies, batch_atts, cols)
            except BaseException as bug:  # encoding failed (publish checks what it queues): a bug
                _logger.exception("sender %s could not encode %d samples", self._thread.name, n)
                err = bug
            if err is not None:  # reported on the next publish or flush
                self.error = err
            self._sent_slots += _slots(bodies)
            with self._cond:
                self._wake_all()

    def _wake_all(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            self._loop.call_soon_threadsafe(resolve_none, fut)

    async def wait_below(self, limit: int) -> None:
        """Wait until at most ``limit`` slots are queued or being put, the sender is idle with
        nothing queued (everything pushed has been put, whatever the counts say), or it closed.
        Each wait for a wake-up lasts at most :data:`SENDER_RECHECK_S`: a wake-up that never
        comes costs that much, never a flush that waits for good."""
        while True:
            with self._cond:
                if self.backlog() <= limit or self._closed:
                    return
                if self._idle and not self._atts:
                    if not self._miscounted:
                        self._miscounted = True
                        name, queued = self._thread.name, self.backlog()
                        _logger.warning("sender %s idle with %d slots counted as queued", name, queued)
                    return
                fut: asyncio.Future[None] = self._loop.create_future()
                self._waiters.append(fut)
            try:
                async with asyncio.timeout(SENDER_RECHECK_S):
                    await fut
            except TimeoutError:
                pass  # look again

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(10.0)


_SHM_DIR = "/dev/shm"


def _shm_pool_bytes(payload_bytes: int) -> int | None:
    """Size of a publisher's shared-memory pool for payloads of this size: see
    :data:`SHM_POOL_SAMPLES`; smaller (a quarter of the free room) where ``/dev/shm`` is
    small, e.g. a container's 64 MiB, so that pools never fill it (a process that writes into a
    full ``/dev/shm`` gets SIGBUS); None if not even two payloads would fit."""
    want = min(SHM_POOL_MAX_BYTES, max(SHM_POOL_BYTES, SHM_POOL_SAMPLES * payload_bytes))
    try:
        st = os.statvfs(_SHM_DIR)
    except OSError:  # no /dev/shm to look at (not Linux): Zenoh decides
        return want
    free = st.f_bavail * st.f_frsize
    if free >= 2 * want:
        return want
    room = free // 4
    return room if room >= 2 * payload_bytes else None


class _BodyBuffers:
    """Assembles the bodies of large batches in buffers that one sender thread keeps.

    A fresh ``bytes`` of ~256 KiB per batch, freed once Zenoh has copied it, made glibc give
    the sender thread's arena back to the kernel (``madvise(MADV_DONTNEED)`` at every free)
    and fault it in again for the next batch: ~80,000 page faults a second at 1 KiB samples,
    in some runs and not others. Here the payloads are written into a staging ``BytesIO``
    that keeps its buffer, then copied into a ``bytearray`` of the body's exact length whose
    allocation is kept too: a length between half and all of a buffer's size is reached by
    resizing within its allocation (CPython reallocates a ``bytearray`` only to grow past it or
    to shrink below half of it). zenoh-python copies a ``bytearray`` during ``put``, so the
    buffer is free again when ``put`` returns. Used by one thread: a ``block`` publisher's
    sender thread, or the thread that publishes runs to a ``drop_oldest`` publisher (which has
    no sender thread: its runs are put by ``publish_many`` on the event loop).
    """

    def __init__(self, max_bytes: int) -> None:
        caps: list[int] = []
        cap = max_bytes
        while cap >= BODY_REUSE_MIN_BYTES:
            caps.append(cap)
            cap //= 2
        self._caps = caps  # largest first; a body of n bytes uses the smallest cap >= n
        self._bufs: dict[int, bytearray] = {}
        self._staging = io.BytesIO()

    def body(self, parts: Sequence[bytes | bytearray], n: int) -> bytes | bytearray:
        """The concatenation of ``parts`` (``n`` bytes in all), in a kept buffer when one fits
        (valid until the next call), else as a new ``bytes``."""
        caps = self._caps
        if not caps or n < BODY_REUSE_MIN_BYTES or n > caps[0]:
            return b"".join(parts)
        # the smallest cap >= n; n > cap / 2 then holds (the smallest cap is under twice
        # BODY_REUSE_MIN_BYTES), so resizing to n never reallocates
        cap = min(c for c in caps if c >= n)
        buf = self._bufs.get(cap)
        if buf is None:
            buf = self._bufs[cap] = bytearray(cap)
        staging = self._staging
        staging.seek(0)
        staging.writelines(parts)
        view = staging.getbuffer()
        try:
            have = len(buf)
            if n < have:
                del buf[n:]  # within the allocation: no realloc (n > cap / 2)
            elif n > have:
                buf[have:] = view[have:n]  # grows within the allocation (n <= cap)
            keep = min(n, have)
            buf[:keep] = view[:keep]  # same length: a copy only
        finally:
            view.release()
        return buf


class _ZenohPublisher(EnginePublisher):
    def __init__(self, engine: ZenohEngine, key: str, options: PublisherOptions) -> None:
        self._engine = engine
        block = options.backpressure is Backpressure.BLOCK
        cc = zenoh.CongestionControl.BLOCK if block else zenoh.CongestionControl.DROP
        self._pub = engine.session.declare_publisher(
            key, congestion_control=cc, reliability=zenoh.Reliability.RELIABLE
        )
        self._put = self._pub.put
        self._sender = (
            _SenderThread(
                key.rsplit("/", 1)[-1], self._put_all, SENDER_HIGH_WATER, asyncio.get_running_loop()
            )
            if block
            else None
        )
        if self._sender is not None:  # one call less per publish
            self.backlog = self._sender.backlog  # type: ignore[method-assign]
        # ``publish`` awaits room above this backlog (the sender's mark: with the base class's
        # 256, every publish between 256 and 512 queued samples awaited a wait that returned
        # at once, ~2 µs per sample)
        self.high_water = SENDER_HIGH_WATER
        #: Batches sent (several samples in one Zenoh put, see :meth:`_put_all`).
        self.batches = 0
        #: Samples sent through this publisher's shared-memory pool, and large ones that found
        #: it full and went the ordinary way.
        self.shm_sent = 0
        self.shm_full = 0
        shm = options.shm if options.shm is not None else engine.shm_enabled
        self._shm_threshold = options.shm_threshold_bytes if shm else None
        self._shm: Any = None
        self._shm_lock = threading.Lock()
        self._closed = False
        self._bodies = _BodyBuffers(BATCH_MAX_BYTES)  # by whichever thread runs _put_all
        # the template of fast_sender's samples (pack, head, mid, tail), for the sender thread
        self._template: tuple[Callable[..., bytes], bytes, bytes, bytes] | None = None
        self._tail_key: tuple[str, str, str] = ("", "", "")
        self._tail = encode_strings("", "", "")

    def _put_all(
        self, bodies: list[Any], atts: Sequence[bytes | int], cols: _Columns | None = None
    ) -> BaseException | None:
        """Put queued samples in order (sender thread); runs of small ones go as batches of up
        to :data:`BATCH_MAX_BYTES` (one Zenoh put, one receive callback). Returns the last
        error, if any put failed.

        Args:
            bodies: The payloads.
            atts: Their encoded headers, or for samples of the template their seq.
            cols: The template samples' stamps, buckets and publish times, in order.
        """
        encoded: Sequence[bytes]
        if cols is None:
            encoded = cast(Sequence[bytes], atts)  # no template samples among them
        else:
            assert self._template is not None  # set with the fast sender that queued them
            sizes = list(map(len, bodies))
            header_bytes = _HEADER_FIXED_BYTES + len(self._template[3])
            if len(cols[0]) == len(atts) and max(sizes) <= BATCH_ITEM_MAX_BYTES - header_bytes:
                return self._put_columns(bodies, cast(Sequence[int], atts), cols, sizes)
            encoded = self._encoded(atts, cols)
        if len(encoded) > 1:
            sizes = list(map(add, map(len, encoded), map(len, bodies)))
            if max(sizes) <= BATCH_ITEM_MAX_BYTES:  # the usual burst
                return self._put_small(encoded, bodies, sizes)
        return self._put_mixed(bodies, encoded)

    def _encoded(self, atts: Sequence[bytes | int], cols: _Columns) -> list[bytes]:
        """``atts`` with each template sample's seq replaced by its encoded header."""
        assert self._template is not None
        pack, head, mid, tail = self._template
        stamps, buckets, pubs = map(iter, cols)
        return [
            a if isinstance(a, bytes) else pack(head, a, next(stamps), next(buckets), mid, next(pubs), tail)
            for a in atts
        ]

    def _put_columns(
        self, bodies: list[Any], seqs: Sequence[int], cols: _Columns, sizes: list[int]
    ) -> BaseException | None:
        """:meth:`_put_all` for small samples of the template only: runs go as column batches
        (:func:`encode_column_batch`: one encoded header and four columns, not a header per
        sample)."""
        assert self._template is not None
        pack, head, mid, tail = self._template
        stamps, buckets, pubs = cols
        error: BaseException | None = None
        for i, j in _batch_cuts(sizes):
            try:
                first = pack(head, seqs[i], stamps[i], buckets[i], mid, pubs[i], tail)
                if j - i == 1:
                    self._put_one(bodies[i], first)
                else:
                    att, body = encode_column_batch(
                        first, seqs[i:j], stamps[i:j], buckets[i:j], pubs[i:j], bodies[i:j], self._bodies.body
                    )
                    self._put(body, attachment=att)
                    self.batches += 1
            except BaseException as err:
                error = err
        return error

    def _put_small(
        self, atts: Sequence[bytes], bodies: Sequence[Any], sizes: list[int]
    ) -> BaseException | None:
        """:meth:`_put_all` for samples of at most :data:`BATCH_ITEM_MAX_BYTES` each (header
        and payload ``sizes``): the runs are cut with C-level calls."""
        error: BaseException | None = None
        for i, j in _batch_cuts(sizes):
            error = self._put_run(atts[i:j], bodies[i:j]) or error
        return error

    def _put_mixed(self, bodies: Sequence[Any], atts: Sequence[bytes]) -> BaseException | None:
        """:meth:`_put_all` for samples of any size: a large one goes alone."""
        error: BaseException | None = None
        run_atts: list[bytes] = []
        run_bodies: list[Any] = []
        run_bytes = 0
        for body, att in zip(bodies, atts, strict=True):
            size = len(att) + len(body)
            if run_atts and (
                size > BATCH_ITEM_MAX_BYTES
                or run_bytes + size > BATCH_MAX_BYTES
                or len(run_atts) >= MAX_BATCH_SAMPLES
            ):
                error = self._put_run(run_atts, run_bodies) or error
                run_atts, run_bodies, run_bytes = [], [], 0
            run_atts.append(att)
            run_bodies.append(body)
            run_bytes += size
            if size > BATCH_ITEM_MAX_BYTES:
                error = self._put_run(run_atts, run_bodies) or error
                run_atts, run_bodies, run_bytes = [], [], 0
        if run_atts:
            error = self._put_run(run_atts, run_bodies) or error
        return error

    def _put_run(self, atts: Sequence[bytes], bodies: Sequence[Any]) -> BaseException | None:
        """One Zenoh put: a lone sample as itself (a large one through shared memory), several
        as a batch. Returns its error."""
        try:
            if len(atts) == 1:
                self._put_one(bodies[0], atts[0])
            else:
                att, body = encode_batch_parts(atts, bodies, self._bodies.body)
                self._put(body, attachment=att)
                self.batches += 1
        except BaseException as err:
            return err
        return None

    def _put_one(self, payload: bytes | bytearray, attachment: bytes) -> None:
        """Put one sample; a payload of at least the shared-memory threshold is written into
        this publisher's pool (one copy; Zenoh copies a ``bytes`` payload once more into its
        own pool on the way to a process of this host), or put the ordinary way if the pool is
        full or cannot be had."""
        threshold = self._shm_threshold
        if threshold is not None and threshold <= len(payload) <= SHM_MAX_PAYLOAD_BYTES:
            buf = self._shm_copy(payload)
            if buf is not None:
                self._put(buf, attachment=with_header_flags(attachment, HeaderFlags.SHM))
                self.shm_sent += 1
                return
        self._put(payload, attachment=attachment)

    def _shm_copy(self, payload: bytes | bytearray) -> Any:
        """``payload`` copied into a segment of this publisher's pool, or None when no segment
        is free (never waits: a subscriber that holds segments must not stall the publisher)."""
        size = len(payload)
        provider = self._shm
        if provider is None:
            with self._shm_lock:
                if self._shm is None:
                    self._shm = self._open_shm_pool(size)
                    if self._shm is None:
                        self._shm_threshold = None  # large payloads go the ordinary way
                        return None
                provider = self._shm
        try:
            buf = provider.alloc(size, policy=_SHM_ALLOC)
        except zenoh.ZError:
            self.shm_full += 1
            return None
        buf[0:size] = payload
        return buf

    def _open_shm_pool(self, payload_bytes: int) -> Any:
        """A shared-memory provider sized for payloads of this size, or None (logged once)."""
        pool = _shm_pool_bytes(payload_bytes)
        if pool is None:
            why = f"{_SHM_DIR} has too little room"
        else:
            try:
                return zenoh.shm.ShmProvider.default_backend(pool)
            except zenoh.ZError as err:
                why = str(err)
        _logger.warning(
            "no shared-memory pool for %s (%s): its large payloads go the ordinary way",
            self._pub.key_expr,
            why,
        )
        return None

    def send_from_thread(self, header: Header, payload: bytes | bytearray) -> bool:
        sender = self._sender
        threshold = self._shm_threshold
        if sender is None or sender.backlog() or (threshold is not None and len(payload) >= threshold):
            return self.send(header, payload)
        if self._closed:
            raise BusClosedError(f"publisher for {header.stream!r} is closed")
        key = (header.stream, header.encoding, header.frame_id)
        if key != self._tail_key:
            self._tail = encode_strings(*key)
            self._tail_key = key
        try:
            self._put(payload, attachment=encode_header(header, self._tail))
        except zenoh.ZError as err:
            raise PublishError(f"zenoh put on {header.stream!r} failed: {err}") from err
        return True

    def _packer_parts(self, template: Header) -> tuple[Callable[..., bytes], bytes, bytes, bytes]:
        """``template``'s :class:`HeaderPacker` as (pack, head, mid, tail), for the fast senders
        to inline (one Python call less per sample)."""
        packer = HeaderPacker(template)
        return packer.pack, packer.head, packer.mid, packer.tail

    def fast_sender(self, template: Header) -> FastSend | None:
        pack, head, mid, tail = self._template = self._packer_parts(template)
        stream, sender = template.stream, self._sender
        if sender is None:
            put = self._put
            put_one = self._put_one
            threshold = self._shm_threshold if self._shm_threshold is not None else 1 << 62

            def put_now(seq: int, stamp_ns: int, bucket: int, publish_ns: int, payload: bytes) -> int:
                if self._closed:
                    raise BusClosedError(f"publisher for {stream!r} is closed")
                att = pack(head, seq, stamp_ns, bucket, mid, publish_ns, tail)
                try:
                    if len(payload) < threshold:
                        put(payload, attachment=att)
                    else:
                        put_one(payload, att)
                except zenoh.ZError as err:
                    raise PublishError(f"zenoh put on {stream!r} failed: {err}") from err
                return 0  # no backlog: put in this thread (drop_oldest: Zenoh drops, not this)

            return put_now
        push, wake = sender.push, sender.wake
        append_payload, append_att = sender._payloads.append, sender._atts.append
        append_stamp, append_bucket = sender._stamps.append, sender._buckets.append
        append_pub = sender._pubs.append

        def queue(seq: int, stamp_ns: int, bucket: int, publish_ns: int, payload: bytes) -> int:
            if self._closed:
                raise BusClosedError(f"publisher for {stream!r} is closed")
            if sender.error is not None:
                self._raise(stream, sender)
            size = len(payload)
            if size > _SLOT_BYTES:
                push(payload, pack(head, seq, stamp_ns, bucket, mid, publish_ns, tail), size)
            else:  # _SenderThread.push of a one-slot sample, inlined (one call less per sample)
                # the thread encodes it (see _SenderThread.__init__); the seq goes last
                append_payload(payload)
                append_stamp(stamp_ns)
                append_bucket(bucket)
                append_pub(publish_ns)
                append_att(seq)
                sender._pushed_slots += 1
                if sender._idle:
                    wake()
            return sender._pushed_slots - sender._sent_slots  # backlog(), inlined

        return queue

    def fast_sender_many(self, template: Header) -> FastSendMany | None:
        pack, head, mid, tail = self._template = self._packer_parts(template)
        stream, sender = template.stream, self._sender

        def send_run(
            seqs: range,
            stamps_ns: Sequence[int],
            buckets: Sequence[int],
            publish_ns: int,
            payloads: Sequence[bytes],
        ) -> int:
            if self._closed:
                raise BusClosedError(f"publisher for {stream!r} is closed")
            if sender is not None:
                if sender.error is not None:
                    self._raise(stream, sender)
                # the sender thread encodes them (as columns where it can)
                sender.push_columns(payloads, seqs, stamps_ns, buckets, [publish_ns] * len(seqs))
                return len(seqs)
            # drop_oldest: every header packed by one C-level loop, put now, in batches (Zenoh
            # drops what its queue has no room for)
            atts = list(
                map(
                    pack,
                    repeat(head),
                    seqs,
                    stamps_ns,
                    buckets,
                    repeat(mid),
                    repeat(publish_ns),
                    repeat(tail),
                )
            )
            err = self._put_all(list(payloads), atts)
            if err is not None:
                raise PublishError(f"zenoh put on {stream!r} failed: {err}") from err
            return len(atts)

        return send_run

    def send(self, header: Header, payload: bytes | bytearray) -> bool:
        if self._closed:
            raise BusClosedError(f"publisher for {header.stream!r} is closed")
        key = (header.stream, header.encoding, header.frame_id)
        if key != self._tail_key:
            self._tail = encode_strings(*key)
            self._tail_key = key
        att = encode_header(header, self._tail)
        sender = self._sender
        if sender is not None:
            if sender.error is not None:
                self._raise(header.stream, sender)
            sender.push(payload, att, len(payload))
            return True
        try:
            self._put_one(payload, att)
        except zenoh.ZError as err:
            raise PublishError(f"zenoh put on {header.stream!r} failed: {err}") from err
        return True

    def _raise(self, stream: str, sender: _SenderThread) -> None:
        err, sender.error = sender.error, None
        raise PublishError(f"zenoh put on {stream!r} failed: {err}") from err

    def backlog(self) -> int:
        return 0 if self._sender is None else self._sender.backlog()

    async def wait_writable(self) -> None:
        if self._sender is not None:
            await self._sender.wait_below(self._sender.high_water // 2)

    def has_subscribers(self) -> bool:
        status = self._pub.matching_status
        return bool(getattr(status, "matching", status))

    async def flush(self) -> None:
        if self._sender is not None:
            await self._sender.wait_below(0)
            if self._sender.error is not None:
                self._raise(self._pub.key_expr.__str__(), self._sender)

    async def close(self) -> None:
        if not self._closed:
            try:
                await self.flush()
            finally:
                self._closed = True
                if self._sender is not None:
                    await asyncio.to_thread(self._sender.close)
                try:
                    self._pub.undeclare()  # type: ignore[no-untyped-call]
                except zenoh.ZError:
                    pass


class _ShmPayload:
    """A received payload in a shared-memory segment (an :class:`EngineBuffer`): copied out
    with ``bytes(ZShm)``, which skips the zero-filling ``ZBytes.to_bytes`` does first (15-25 %
    less time per 1 MiB, measured)."""

    __slots__ = ("_shm", "_size")

    def __init__(self, shm: Any, size: int) -> None:
        self._shm = shm
        self._size = size

    def __len__(self) -> int:
        return self._size

    def to_bytes(self) -> bytes:
        return bytes(self._shm)


class _ZenohSubscriber(EngineSubscriber):
    def __init__(self, engine: ZenohEngine, key: str, sink: MessageSink) -> None:
        deliver = sink.deliver
        reject = sink.reject

        def decoded(raw: bytes, sample: zenoh.Sample, what: str) -> Header | None:
            """The header, or None after counting the sample as malformed."""
            try:
                return decode_header(raw)
            except HeaderError as err:
                reject(HeaderError(f"{what} on {sample.key_expr}: {err}"), None)
                return None

        def on_sample(sample: zenoh.Sample) -> None:
            att = sample.attachment
            if att is None:
                reject(HeaderError(f"sample on {sample.key_expr} has no header attachment"), None)
                return
            raw_att = att.to_bytes()
            if is_batch(raw_att):
                body = sample.payload.to_bytes()
                hand_over_batch(sink, str(sample.key_expr), lambda: decode_batch_runs(raw_att, body), None)
                return
            header = decoded(raw_att, sample, "sample")
            if header is None:
                return
            payload = sample.payload
            size = len(payload)
            if size < LAZY_COPY_BYTES:
                deliver(header, payload.to_bytes(), None)
            else:
                # Copied when the application takes it, in its own thread: a large buffer is
                # then allocated and freed by one thread (no page-fault churn across threads),
                # and a sample dropped by drop_oldest is never copied at all.
                shm = payload.as_shm()
                deliver(header, payload if shm is None else _ShmPayload(shm, size), None)

        self._sub = engine.session.declare_subscriber(key, on_sample)
        self._closed = False

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._sub.undeclare()  # type: ignore[no-untyped-call]
            except zenoh.ZError:
                pass


class _ZenohMulti(EngineSubscriber):
    def __init__(self, subs: list[_ZenohSubscriber]) -> None:
        self._subs = subs

    async def close(self) -> None:
        for sub in self._subs:
            await sub.close()


class _ZenohGroup(GroupMembership):
    """Membership through liveliness tokens ``eb/<ns>/@group/<group>/<member>/<value>``."""

    def __init__(self, engine: ZenohEngine, group: str, on_change: MembershipCallback) -> None:
        self._engine = engine
        self._prefix = prefix = f"eb/{engine.settings.namespace}/@group/{group}"
        self._members: dict[str, str] = {}
        self._lock = threading.Lock()
        self._token: Any = None
        n = len(prefix.split("/"))

        def on_token(sample: zenoh.Sample) -> None:
            parts = str(sample.key_expr).split("/")
            if len(parts) != n + 2:
                return
            mid, val = parts[n], parts[n + 1]
            joined = sample.kind == zenoh.SampleKind.PUT
            with self._lock:
                if joined:
                    self._members[mid] = val
                elif self._members.get(mid) == val:
                    del self._members[mid]
                else:
                    return
            on_change(mid, val, joined)

        self._sub = engine.session.liveliness().declare_subscriber(f"{prefix}/**", on_token, history=True)

    def members(self) -> dict[str, str]:
        with self._lock:
            return dict(self._members)

    async def announce(self, member: str, value: str) -> None:
        for what, v in (("member", member), ("value", value)):
            if not v or any(c in v for c in "/*$#?@"):
                raise BusConfigError(f"invalid group {what} {v!r}")
        self._token = self._engine.session.liveliness().declare_token(f"{self._prefix}/{member}/{value}")

    async def leave(self) -> None:
        try:
            if self._token is not None:
                self._token.undeclare()
            self._sub.undeclare()  # type: ignore[no-untyped-call]
        except zenoh.ZError:
            pass


class ZenohEngine(Engine):
    """A Zenoh session used as a bus engine.

    Open with :meth:`open`; the session is closed by :meth:`close`.
    """

    name = "zenoh"

    def __init__(self, settings: ZenohSettings, session: zenoh.Session, *, shm_enabled: bool = True) -> None:
        self.settings = settings
        self.session = session
        #: Whether the session's shared-memory transport is on (publishers' default for
        #: writing large payloads into their own pools).
        self.shm_enabled = shm_enabled and settings.shm is not False
        self._closed = False

    @classmethod
    async def open(cls, settings: ZenohSettings) -> ZenohEngine:
        """Open the session.

        Raises:
            BusConnectionError: None of the ``connect`` endpoints answered in time, or a listen
                endpoint could not be bound.
        """
        _init_logging()
        cfg = build_zenoh_config(settings)
        shm_enabled = cfg.get_json(_SHM_ENABLED_KEY) != "false"
        try:
            session = await call_bounded(
                lambda: zenoh.open(cfg), settings.connect_timeout_s + 5.0, name="eb-zenoh-open"
            )
        except zenoh.ZError as err:
            where = ", ".join(settings.connect or settings.listen) or "the default endpoints"
            raise BusConnectionError(
                f"cannot open Zenoh session ({settings.mode}) with {where} within "
                f"{settings.connect_timeout_s:g} s: {err}"
            ) from err
        except TimeoutError as err:
            raise BusConnectionError(
                f"opening the Zenoh session did not finish within {settings.connect_timeout_s + 5:g} s"
            ) from err
        return cls(settings, session, shm_enabled=shm_enabled)

    def key(self, stream: str | None) -> str:
        """Key expression of a stream in this namespace."""
        return stream_key(self.settings.namespace, stream)

    def _check(self) -> None:
        if self._closed:
            raise BusClosedError("the Zenoh bus is closed")

    async def create_publisher(self, stream: str, options: PublisherOptions) -> EnginePublisher:
        self._check()
        return _ZenohPublisher(self, self.key(stream), options)

    async def create_subscriber(
        self, stream: str | tuple[str, ...] | None, sink: MessageSink, options: SubscriptionOptions
    ) -> EngineSubscriber:
        self._check()
        if options.key_shared_ranges is not None:
            raise BusConfigError("key_shared_ranges is a Pulsar option; on Zenoh use the ownership ring")
        if isinstance(stream, tuple):
            return _ZenohMulti([_ZenohSubscriber(self, self.key(s), sink) for s in stream])
        return _ZenohSubscriber(self, self.key(stream), sink)

    def _svc_key(self, name: str) -> str:
        return f"eb/{self.settings.namespace}/@svc/{name}"

    def serve(self, name: str, handler: Callable[[bytes], bytes]) -> Any:
        self._check()

        def on_query(query: zenoh.Query) -> None:
            payload = query.payload.to_bytes() if query.payload is not None else b""
            try:
                answer = handler(payload)
            except Exception as err:  # a failing handler must not kill the queryable
                answer = json.dumps({"error": f"{type(err).__name__}: {err}"}).encode()
            query.reply(query.key_expr, answer)

        return self.session.declare_queryable(
            self._svc_key(name), zenoh.handlers.Callback(on_query, indirect=False), complete=True
        )

    async def request(self, name: str, payload: bytes, timeout_s: float) -> bytes | None:
        self._check()
        loop = asyncio.get_running_loop()
        key = self._svc_key(name)

        async def ask(budget_s: float) -> bytes | None:
            # Callback-based get: no thread per request, so many concurrent requests (executors,
            # planners) do not queue behind a small thread pool.
            fut: asyncio.Future[bytes | None] = loop.create_future()

            def settle(value: bytes | None) -> None:
                if not fut.done():
                    fut.set_result(value)

            def on_reply(reply: zenoh.Reply) -> None:
                if reply.ok is not None:
                    loop.call_soon_threadsafe(settle, reply.ok.payload.to_bytes())

            def on_done() -> None:
                loop.call_soon_threadsafe(settle, None)

            # indirect=False: the two callbacks only hand the answer to the loop, so they run on
            # Zenoh's own thread instead of a Python thread started for every request.
            try:
                self.session.get(
                    key,
                    zenoh.handlers.Callback(on_reply, on_done, indirect=False),
                    payload=payload,
                    timeout=budget_s,
                )
            except zenoh.ZError as err:
                self._check()  # closed meanwhile: BusClosedError
                raise BusConnectionError(f"zenoh query {key!r} failed: {err}") from err
            # bounded here too: a session closed while the query runs never calls on_done
            try:
                async with asyncio.timeout(budget_s + REQUEST_GRACE_S):
                    return await fut
            except TimeoutError:
                self._check()
                return None

        # Right after connecting, the service may not be routed yet and a query returns at once
        # with no reply: ask again until the timeout.
        deadline = time.monotonic() + timeout_s
        while True:
            answer = await ask(max(0.05, deadline - time.monotonic()))
            if answer is not None or time.monotonic() >= deadline:
                return answer
            await asyncio.sleep(0.05)

    def notify(self, topic: str, payload: bytes, *, block: bool = False) -> None:
        self._check()
        cc = zenoh.CongestionControl.BLOCK if block else zenoh.CongestionControl.DROP  # DROP: put's default
        self.session.put(f"eb/{self.settings.namespace}/@n/{topic}", payload, congestion_control=cc)

    def listen(self, topic: str, callback: Callable[[str, bytes], None]) -> Any:
        self._check()
        prefix = f"eb/{self.settings.namespace}/@n/"

        def on_sample(sample: zenoh.Sample) -> None:
            callback(str(sample.key_expr)[len(prefix) :], sample.payload.to_bytes())

        return self.session.declare_subscriber(
            prefix + topic, zenoh.handlers.Callback(on_sample, indirect=False)
        )

    async def watch_group(self, group: str, on_change: MembershipCallback) -> GroupMembership:
        self._check()
        if not group or any(c in group for c in "*$#?@"):
            raise BusConfigError(f"invalid group name {group!r}")
        return _ZenohGroup(self, group, on_change)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                await call_bounded(self.session.close, CLOSE_TIMEOUT_S, name="eb-zenoh-close")
            except TimeoutError:
                _logger.warning("the Zenoh session did not close within %g s; left behind", CLOSE_TIMEOUT_S)
