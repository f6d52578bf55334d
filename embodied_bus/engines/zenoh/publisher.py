"""A Zenoh publisher: one put per sample, or batches and shared memory where they pay."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from itertools import repeat
from operator import add
from typing import Any, cast

import zenoh

from embodied_bus.engines.base import (
    EnginePublisher,
    FastSend,
    FastSendMany,
)
from embodied_bus.engines.zenoh.connection import ZenohConnection
from embodied_bus.engines.zenoh.sender import HEADER_FIXED_BYTES, Columns, SenderThread, batch_cuts
from embodied_bus.engines.zenoh.shm import SHM_DIR, BodyBuffers, shm_pool_bytes
from embodied_bus.engines.zenoh.tuning import (
    BATCH_ITEM_MAX_BYTES,
    BATCH_MAX_BYTES,
    SENDER_HIGH_WATER,
    SHM_ALLOC,
    SHM_MAX_PAYLOAD_BYTES,
    SLOT_BYTES,
)
from embodied_bus.errors import (
    BusClosedError,
    PublishError,
)
from embodied_bus.model.batches import MAX_BATCH_SAMPLES, encode_batch_parts, encode_column_batch
from embodied_bus.model.header import (
    Header,
    HeaderFlags,
    HeaderPacker,
    encode_header,
    encode_strings,
    with_header_flags,
)
from embodied_bus.model.qos import Backpressure, PublisherOptions

_logger = logging.getLogger("embodied_bus.zenoh")


class ZenohPublisher(EnginePublisher):
    def __init__(self, engine: ZenohConnection, key: str, options: PublisherOptions) -> None:
        self._engine = engine
        block = options.backpressure is Backpressure.BLOCK
        cc = zenoh.CongestionControl.BLOCK if block else zenoh.CongestionControl.DROP
        self._pub = engine.session.declare_publisher(
            key, congestion_control=cc, reliability=zenoh.Reliability.RELIABLE
        )
        self.put = self._pub.put
        self.sender = (
            SenderThread(key.rsplit("/", 1)[-1], self._put_all, SENDER_HIGH_WATER, asyncio.get_running_loop())
            if block
            else None
        )
        if self.sender is not None:  # one call less per publish
            self.backlog = self.sender.backlog  # type: ignore[method-assign]
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
        self.shm_threshold = options.shm_threshold_bytes if shm else None
        self._shm: Any = None
        self._shm_lock = threading.Lock()
        self._closed = False
        self.bodies = BodyBuffers(BATCH_MAX_BYTES)  # by whichever thread runs _put_all
        # the template of fast_sender's samples (pack, head, mid, tail), for the sender thread
        self._template: tuple[Callable[..., bytes], bytes, bytes, bytes] | None = None
        self._tail_key: tuple[str, str, str] = ("", "", "")
        self._tail = encode_strings("", "", "")

    def _put_all(
        self, bodies: list[Any], atts: Sequence[bytes | int], cols: Columns | None = None
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
            header_bytes = HEADER_FIXED_BYTES + len(self._template[3])
            if len(cols[0]) == len(atts) and max(sizes) <= BATCH_ITEM_MAX_BYTES - header_bytes:
                return self._put_columns(bodies, cast(Sequence[int], atts), cols, sizes)
            encoded = self._encoded(atts, cols)
        if len(encoded) > 1:
            sizes = list(map(add, map(len, encoded), map(len, bodies)))
            if max(sizes) <= BATCH_ITEM_MAX_BYTES:  # the usual burst
                return self.put_small(encoded, bodies, sizes)
        return self.put_mixed(bodies, encoded)

    def _encoded(self, atts: Sequence[bytes | int], cols: Columns) -> list[bytes]:
        """``atts`` with each template sample's seq replaced by its encoded header."""
        assert self._template is not None
        pack, head, mid, tail = self._template
        stamps, buckets, pubs = map(iter, cols)
        return [
            a if isinstance(a, bytes) else pack(head, a, next(stamps), next(buckets), mid, next(pubs), tail)
            for a in atts
        ]

    def _put_columns(
        self, bodies: list[Any], seqs: Sequence[int], cols: Columns, sizes: list[int]
    ) -> BaseException | None:
        """:meth:`_put_all` for small samples of the template only: runs go as column batches
        (:func:`encode_column_batch`: one encoded header and four columns, not a header per
        sample)."""
        assert self._template is not None
        pack, head, mid, tail = self._template
        stamps, buckets, pubs = cols
        error: BaseException | None = None
        for i, j in batch_cuts(sizes):
            try:
                first = pack(head, seqs[i], stamps[i], buckets[i], mid, pubs[i], tail)
                if j - i == 1:
                    self.put_one(bodies[i], first)
                else:
                    att, body = encode_column_batch(
                        first, seqs[i:j], stamps[i:j], buckets[i:j], pubs[i:j], bodies[i:j], self.bodies.body
                    )
                    self.put(body, attachment=att)
                    self.batches += 1
            except BaseException as err:
                error = err
        return error

    def put_small(
        self, atts: Sequence[bytes], bodies: Sequence[Any], sizes: list[int]
    ) -> BaseException | None:
        """:meth:`_put_all` for samples of at most :data:`BATCH_ITEM_MAX_BYTES` each (header
        and payload ``sizes``): the runs are cut with C-level calls."""
        error: BaseException | None = None
        for i, j in batch_cuts(sizes):
            error = self.put_run(atts[i:j], bodies[i:j]) or error
        return error

    def put_mixed(self, bodies: Sequence[Any], atts: Sequence[bytes]) -> BaseException | None:
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
                error = self.put_run(run_atts, run_bodies) or error
                run_atts, run_bodies, run_bytes = [], [], 0
            run_atts.append(att)
            run_bodies.append(body)
            run_bytes += size
            if size > BATCH_ITEM_MAX_BYTES:
                error = self.put_run(run_atts, run_bodies) or error
                run_atts, run_bodies, run_bytes = [], [], 0
        if run_atts:
            error = self.put_run(run_atts, run_bodies) or error
        return error

    def put_run(self, atts: Sequence[bytes], bodies: Sequence[Any]) -> BaseException | None:
        """One Zenoh put: a lone sample as itself (a large one through shared memory), several
        as a batch. Returns its error."""
        try:
            if len(atts) == 1:
                self.put_one(bodies[0], atts[0])
            else:
                att, body = encode_batch_parts(atts, bodies, self.bodies.body)
                self.put(body, attachment=att)
                self.batches += 1
        except BaseException as err:
            return err
        return None

    def put_one(self, payload: bytes | bytearray, attachment: bytes) -> None:
        """Put one sample; a payload of at least the shared-memory threshold is written into
        this publisher's pool (one copy; Zenoh copies a ``bytes`` payload once more into its
        own pool on the way to a process of this host), or put the ordinary way if the pool is
        full or cannot be had."""
        threshold = self.shm_threshold
        if threshold is not None and threshold <= len(payload) <= SHM_MAX_PAYLOAD_BYTES:
            buf = self._shm_copy(payload)
            if buf is not None:
                self.put(buf, attachment=with_header_flags(attachment, HeaderFlags.SHM))
                self.shm_sent += 1
                return
        self.put(payload, attachment=attachment)

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
                        self.shm_threshold = None  # large payloads go the ordinary way
                        return None
                provider = self._shm
        try:
            buf = provider.alloc(size, policy=SHM_ALLOC)
        except zenoh.ZError:
            self.shm_full += 1
            return None
        buf[0:size] = payload
        return buf

    def _open_shm_pool(self, payload_bytes: int) -> Any:
        """A shared-memory provider sized for payloads of this size, or None (logged once)."""
        pool = shm_pool_bytes(payload_bytes)
        if pool is None:
            why = f"{SHM_DIR} has too little room"
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
        sender = self.sender
        threshold = self.shm_threshold
        if sender is None or sender.backlog() or (threshold is not None and len(payload) >= threshold):
            return self.send(header, payload)
        if self._closed:
            raise BusClosedError(f"publisher for {header.stream!r} is closed")
        key = (header.stream, header.encoding, header.frame_id)
        if key != self._tail_key:
            self._tail = encode_strings(*key)
            self._tail_key = key
        try:
            self.put(payload, attachment=encode_header(header, self._tail))
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
        stream, sender = template.stream, self.sender
        if sender is None:
            put = self.put
            put_one = self.put_one
            threshold = self.shm_threshold if self.shm_threshold is not None else 1 << 62

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
        append_payload, append_att = sender.payloads.append, sender.atts.append
        append_stamp, append_bucket = sender._stamps.append, sender._buckets.append
        append_pub = sender._pubs.append

        def queue(seq: int, stamp_ns: int, bucket: int, publish_ns: int, payload: bytes) -> int:
            if self._closed:
                raise BusClosedError(f"publisher for {stream!r} is closed")
            if sender.error is not None:
                self._raise(stream, sender)
            size = len(payload)
            if size > SLOT_BYTES:
                push(payload, pack(head, seq, stamp_ns, bucket, mid, publish_ns, tail), size)
            else:  # SenderThread.push of a one-slot sample, inlined (one call less per sample)
                # the thread encodes it (see SenderThread.__init__); the seq goes last
                append_payload(payload)
                append_stamp(stamp_ns)
                append_bucket(bucket)
                append_pub(publish_ns)
                append_att(seq)
                sender.pushed_slots += 1
                if sender._idle:
                    wake()
            return sender.pushed_slots - sender.sent_slots  # backlog(), inlined

        return queue

    def fast_sender_many(self, template: Header) -> FastSendMany | None:
        pack, head, mid, tail = self._template = self._packer_parts(template)
        stream, sender = template.stream, self.sender

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
        sender = self.sender
        if sender is not None:
            if sender.error is not None:
                self._raise(header.stream, sender)
            sender.push(payload, att, len(payload))
            return True
        try:
            self.put_one(payload, att)
        except zenoh.ZError as err:
            raise PublishError(f"zenoh put on {header.stream!r} failed: {err}") from err
        return True

    def _raise(self, stream: str, sender: SenderThread) -> None:
        err, sender.error = sender.error, None
        raise PublishError(f"zenoh put on {stream!r} failed: {err}") from err

    def backlog(self) -> int:
        return 0 if self.sender is None else self.sender.backlog()

    async def wait_writable(self) -> None:
        if self.sender is not None:
            await self.sender.wait_below(self.sender.high_water // 2)

    def has_subscribers(self) -> bool:
        status = self._pub.matching_status
        return bool(getattr(status, "matching", status))

    async def flush(self) -> None:
        if self.sender is not None:
            await self.sender.wait_below(0)
            if self.sender.error is not None:
                self._raise(self._pub.key_expr.__str__(), self.sender)

    async def close(self) -> None:
        if not self._closed:
            try:
                await self.flush()
            finally:
                self._closed = True
                if self.sender is not None:
                    await asyncio.to_thread(self.sender.close)
                try:
                    self._pub.undeclare()  # type: ignore[no-untyped-call]
                except zenoh.ZError:
                    pass
