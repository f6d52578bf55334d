"""Publishers of sensor samples: stamp → bucket, sequence numbers, size checks."""

from __future__ import annotations

import asyncio
import operator
import random
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from embodied_bus.engines.base import EnginePublisher, FastSend, FastSendMany
from embodied_bus.errors import BusClosedError, HeaderError, PayloadTooLargeError
from embodied_bus.model.clock import BucketClock
from embodied_bus.model.encoding import ENCODING_NPY, encode_npy
from embodied_bus.model.header import Header, HeaderFlags, Modality
from embodied_bus.model.qos import PublisherOptions
from embodied_bus.model.sample import Payload

__all__ = ["PUBLISH_RUN", "Publisher"]

#: :meth:`Publisher.publish_many` hands samples to the engine in runs of at most this many,
#: awaiting room between runs under ``block`` (so a long sequence never floods the send queue).
PUBLISH_RUN = 256

_time_ns = time.time_ns
_NONE = HeaderFlags.NONE
#: Stamps are signed 64-bit nanosecond counts on the wire.
_STAMP_MIN_NS = -(1 << 63)
_STAMP_MAX_NS = (1 << 63) - 1


def _checked_stamp(stamp_ns: object, stream: str) -> int:
    """``stamp_ns`` as an int, if it is an integer in the wire's signed 64-bit range.

    Raises:
        ValueError: It is not (named with the stream).
    """
    try:
        value = operator.index(stamp_ns)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(
            f"stamp_ns on stream {stream!r} must be an integer (nanoseconds), not {type(stamp_ns).__name__}"
        ) from None
    if not _STAMP_MIN_NS <= value <= _STAMP_MAX_NS:
        raise ValueError(f"stamp_ns {value} on stream {stream!r} is outside the signed 64-bit range")
    return value


class _Static(NamedTuple):
    """What every sample of one publisher has in common (unpacked once per publish)."""

    stream: str
    modality: Modality
    width_ns: int
    offset_ns: int
    encoding: str
    frame_id: str
    publisher_id: int


class Publisher:
    """Publishes the samples of one stream; create with :meth:`embodied_bus.Bus.publisher`.

    Sequence numbers start at 1 and increase by one per accepted sample. A sample dropped by
    the engine under ``drop_oldest`` still consumes its number, so subscribers see the gap.
    """

    def __init__(
        self,
        engine_pub: EnginePublisher,
        *,
        stream: str,
        modality: Modality,
        encoding: str,
        frame_id: str,
        clock: BucketClock,
        options: PublisherOptions,
    ) -> None:
        self._pub = engine_pub
        self._stream = stream
        self._modality = modality
        self._encoding = encoding
        self._frame_id = frame_id
        self._clock = clock
        self.options = options
        self._publisher_id = random.getrandbits(64)
        self._seq = 0
        self._closed = False
        limit = options.max_payload_bytes
        if engine_pub.max_payload_bytes is not None:
            limit = min(limit, engine_pub.max_payload_bytes)
        self._limit = limit
        self._high_water = engine_pub.high_water
        self._backlog = engine_pub.backlog
        # The publisher's own samples (its encoding and frame_id, a sensor stamp, bytes) go
        # through the engine's specialised sender if it has one: ~2x cheaper per sample.
        pub_id = self._publisher_id
        self._static = _Static(stream, modality, clock.width_ns, clock.offset_ns, encoding, frame_id, pub_id)
        template = Header(
            stream=stream,
            modality=modality,
            seq=1,
            stamp_ns=0,
            bucket=0,
            bucket_width_ns=clock.width_ns,
            bucket_offset_ns=clock.offset_ns,
            encoding=encoding,
            frame_id=frame_id,
            publisher_id=pub_id,
            publish_ns=0,
        )
        try:
            self._fast: FastSend | None = engine_pub.fast_sender(template)
            self._fast_many: FastSendMany | None = engine_pub.fast_sender_many(template)
        except HeaderError:  # names too long: send() names the error on the first publish
            self._fast = None
            self._fast_many = None
        #: Samples the engine dropped (drop_oldest with a full queue).
        self.dropped = 0
        #: Samples handed to the engine.
        self.sent = 0

    @property
    def stream(self) -> str:
        """Stream name."""
        return self._stream

    @property
    def engine_publisher(self) -> EnginePublisher:
        """The engine's publisher underneath (engine-level tools and tests: hand-made headers,
        its batch and backlog counters)."""
        return self._pub

    @property
    def modality(self) -> Modality:
        """Sensor kind of the stream."""
        return self._modality

    @property
    def encoding(self) -> str:
        """Encoding of samples published without an ``encoding`` of their own."""
        return self._encoding

    @property
    def frame_id(self) -> str:
        """frame_id of samples published without a ``frame_id`` of their own."""
        return self._frame_id

    @property
    def clock(self) -> BucketClock:
        """Maps stamps to buckets."""
        return self._clock

    @property
    def publisher_id(self) -> int:
        """Random 64-bit id of this publisher (scopes its sequence numbers)."""
        return self._publisher_id

    @property
    def seq(self) -> int:
        """Sequence number of the last published sample (0 before the first)."""
        return self._seq

    def publish_nowait(
        self,
        payload: Payload,
        *,
        stamp_ns: int,
        encoding: str | None = None,
        frame_id: str | None = None,
        stamp_fallback: bool = False,
    ) -> Header:
        """Publish one sample without awaiting (the asyncio methods wrap this).

        Args:
            payload: bytes-like, or a NumPy array (sent as ``npy`` unless ``encoding`` says
                otherwise, in which case its raw bytes are sent).
            stamp_ns: Sensor stamp in UTC nanoseconds. 0 means "no stamp": the current time is
                used and the header carries ``STAMP_FALLBACK``.
            encoding: Overrides the publisher's encoding for this sample.
            frame_id: Overrides the publisher's frame_id for this sample.
            stamp_fallback: ``stamp_ns`` is not a sensor stamp but a substitute (e.g. a
                recording's log time for a zero header stamp): flag it ``STAMP_FALLBACK``.

        Returns:
            The header that was sent.

        Raises:
            PayloadTooLargeError: The payload exceeds the publisher's or engine's limit.
            PublishError: The engine refused the sample.
        """
        return self._publish(payload, stamp_ns, encoding, frame_id, stamp_fallback, False)

    def _payload_bytes(self, payload: Payload, encoding: str | None) -> bytes | bytearray:
        """The bytes a payload is sent as (an array as npy or raw, as the encoding says).

        Raises:
            TypeError: A payload of another type.
            PayloadTooLargeError: Above the publisher's limit.
        """
        data: bytes | bytearray
        if type(payload) is bytes:
            data = payload
        elif isinstance(payload, np.ndarray):
            enc = encoding or self._encoding
            data = encode_npy(payload) if enc == ENCODING_NPY else payload.tobytes()
        elif isinstance(payload, memoryview):
            data = payload.tobytes()
        elif isinstance(payload, (bytes, bytearray)):
            data = payload
        else:
            raise TypeError(
                f"payload must be bytes, bytearray, memoryview or numpy array, not {type(payload).__name__}"
            )
        if len(data) > self._limit:
            raise PayloadTooLargeError(
                f"payload of {len(data)} bytes on stream {self._stream!r} exceeds the limit of "
                f"{self._limit} bytes"
                + (
                    " (Pulsar without chunking; enable PublisherOptions(chunking=True))"
                    if self._pub.max_payload_bytes is not None and self._limit == self._pub.max_payload_bytes
                    else " (PublisherOptions.max_payload_bytes)"
                )
            )
        return data

    def _publish(
        self,
        payload: Payload,
        stamp_ns: int,
        encoding: str | None,
        frame_id: str | None,
        stamp_fallback: bool,
        from_thread: bool,
    ) -> Header:
        fast = self._fast
        if (  # the usual sample (publish inlines this branch: keep the two in step)
            fast is not None
            and type(payload) is bytes
            and encoding is None
            and frame_id is None
            and type(stamp_ns) is int
            and 0 < stamp_ns <= _STAMP_MAX_NS
            and not stamp_fallback
            and not from_thread
            and len(payload) <= self._limit
            and not self._closed
        ):
            stream, mod, width_ns, offset_ns, enc, frame, pub_id = self._static
            seq = self._seq + 1
            now_ns = _time_ns()
            bucket = (stamp_ns - offset_ns) // width_ns
            accepted = fast(seq, stamp_ns, bucket, now_ns, payload) >= 0
            self._seq = seq
            if accepted:
                self.sent += 1
            else:
                self.dropped += 1
            return Header(
                stream=stream,
                modality=mod,
                seq=seq,
                stamp_ns=stamp_ns,
                bucket=bucket,
                bucket_width_ns=width_ns,
                bucket_offset_ns=offset_ns,
                encoding=enc,
                frame_id=frame,
                publisher_id=pub_id,
                publish_ns=now_ns,
                flags=_NONE,
            )
        if self._closed:
            raise BusClosedError(f"publisher for {self._stream!r} is closed")
        data = self._payload_bytes(payload, encoding)
        stamp_ns = _checked_stamp(stamp_ns, self._stream)
        flags = HeaderFlags.STAMP_FALLBACK if stamp_fallback else HeaderFlags.NONE
        now_ns = time.time_ns()
        if stamp_ns == 0:
            stamp_ns = now_ns
            flags = HeaderFlags.STAMP_FALLBACK
        seq = self._seq + 1
        clock = self._clock
        header = Header(
            stream=self._stream,
            modality=self._modality,
            seq=seq,
            stamp_ns=stamp_ns,
            bucket=(stamp_ns - clock.offset_ns) // clock.width_ns,
            bucket_width_ns=clock.width_ns,
            bucket_offset_ns=clock.offset_ns,
            encoding=encoding or self._encoding,
            frame_id=self._frame_id if frame_id is None else frame_id,
            publisher_id=self._publisher_id,
            publish_ns=now_ns,
            flags=flags,
        )
        accepted = (self._pub.send_from_thread if from_thread else self._pub.send)(header, data)
        self._seq = seq
        if accepted:
            self.sent += 1
        else:
            self.dropped += 1
        return header

    def publish_from_thread(
        self,
        payload: Payload,
        *,
        stamp_ns: int,
        encoding: str | None = None,
        frame_id: str | None = None,
        stamp_fallback: bool = False,
    ) -> Header:
        """Publish from a worker thread (never the event loop thread), e.g. a fast replay loop.

        Under ``BLOCK`` it waits in the calling thread until the engine accepts the sample,
        skipping the hand-off to a sender thread. One thread per publisher.
        """
        return self._publish(payload, stamp_ns, encoding, frame_id, stamp_fallback, True)

    async def publish(
        self,
        payload: Payload,
        *,
        stamp_ns: int,
        encoding: str | None = None,
        frame_id: str | None = None,
        stamp_fallback: bool = False,
    ) -> Header:
        """Publish one sample (see :meth:`publish_nowait`); use :meth:`flush` to wait for it.

        Under ``BLOCK`` this awaits while the engine's send queue is full, without blocking
        the event loop.
        """
        fast = self._fast
        if (  # the usual sample, as _publish sends it, inlined (one Python call less per sample)
            fast is not None
            and type(payload) is bytes
            and encoding is None
            and frame_id is None
            and type(stamp_ns) is int
            and 0 < stamp_ns <= _STAMP_MAX_NS
            and not stamp_fallback
            and len(payload) <= self._limit
            and not self._closed
        ):
            stream, mod, width_ns, offset_ns, enc, frame, pub_id = self._static
            seq = self._seq + 1
            now_ns = _time_ns()
            bucket = (stamp_ns - offset_ns) // width_ns
            backlog = fast(seq, stamp_ns, bucket, now_ns, payload)
            self._seq = seq
            if backlog >= 0:
                self.sent += 1
            else:
                self.dropped += 1
            if backlog > self._high_water:
                await self._pub.wait_writable()
            return Header(
                stream=stream,
                modality=mod,
                seq=seq,
                stamp_ns=stamp_ns,
                bucket=bucket,
                bucket_width_ns=width_ns,
                bucket_offset_ns=offset_ns,
                encoding=enc,
                frame_id=frame,
                publisher_id=pub_id,
                publish_ns=now_ns,
                flags=_NONE,
            )
        header = self._publish(payload, stamp_ns, encoding, frame_id, stamp_fallback, False)
        if self._backlog() > self._high_water:
            await self._pub.wait_writable()
        return header

    async def publish_many(self, payloads: Sequence[Payload], *, stamps_ns: Sequence[int]) -> range:
        """Publish several samples of this stream, in order: what :meth:`publish` does for each
        (each gets its own header, sequence number and bucket), with one hand-over to the
        engine per run of up to :data:`PUBLISH_RUN` samples instead of one per sample.

        For producers that have samples at hand faster than one by one: a replay at full
        speed, a driver that reads a burst from its device, a high-rate IMU. ``bytes``
        payloads with sensor stamps take the engine's batch path (on Zenoh: every header
        packed in one C-level loop, one wake-up of the sender thread per run, and runs of
        small samples in one Zenoh put); anything else goes sample by sample as
        :meth:`publish` sends it. Under ``block`` this awaits room between runs; under
        ``drop_oldest`` the engine may drop samples (they keep their numbers: subscribers
        see the gap).

        Args:
            payloads: The samples' payloads (as :meth:`publish` takes them).
            stamps_ns: Their sensor stamps, UTC nanoseconds, one per payload (0: no stamp,
                as in :meth:`publish`).

        Returns:
            The sequence numbers the samples got (empty for no samples).

        Raises:
            ValueError: ``payloads`` and ``stamps_ns`` differ in length.
            PayloadTooLargeError: A payload exceeds the limit (the samples before it are sent).
            PublishError: The engine refused a sample.
        """
        n = len(payloads)
        if len(stamps_ns) != n:
            raise ValueError(f"publish_many on {self._stream!r}: {n} payloads but {len(stamps_ns)} stamps_ns")
        first = self._seq + 1
        for start in range(0, n, PUBLISH_RUN):
            run = payloads[start : start + PUBLISH_RUN]
            stamps = stamps_ns[start : start + PUBLISH_RUN]
            if not self._publish_run(run, stamps):
                for payload, stamp_ns in zip(run, stamps, strict=True):
                    self._publish(payload, stamp_ns, None, None, False, False)
                    if self._backlog() > self._high_water:
                        await self._pub.wait_writable()
            if self._backlog() > self._high_water:
                await self._pub.wait_writable()
        return range(first, self._seq + 1)

    def _publish_run(self, payloads: Sequence[Payload], stamps_ns: Sequence[int]) -> bool:
        """Send a run through the engine's batch path if it qualifies; False if it does not
        (nothing sent then)."""
        many = self._fast_many
        if (
            many is None
            or self._closed
            or not payloads
            or set(map(type, payloads)) != {bytes}
            or set(map(type, stamps_ns)) != {int}
            or min(stamps_ns) <= 0
            or max(stamps_ns) > _STAMP_MAX_NS
            or max(map(len, payloads)) > self._limit  # type: ignore[arg-type]
        ):
            return False
        width_ns, offset_ns = self._static.width_ns, self._static.offset_ns
        n = len(payloads)
        first = self._seq + 1
        buckets = [(stamp_ns - offset_ns) // width_ns for stamp_ns in stamps_ns]
        accepted = many(range(first, first + n), stamps_ns, buckets, _time_ns(), payloads)  # type: ignore[arg-type]
        self._seq = first + n - 1
        self.sent += accepted
        self.dropped += n - accepted
        return True

    async def publish_array(self, array: np.ndarray[Any, Any], *, stamp_ns: int) -> Header:
        """Publish a NumPy array as an ``npy`` blob (one copy into the message)."""
        return await self.publish(array, stamp_ns=stamp_ns, encoding=ENCODING_NPY)

    async def wait_for_subscribers(self, timeout_s: float = 5.0) -> bool:
        """Wait until a subscriber matches this stream (Zenoh discovery takes a moment).

        Returns:
            True if one matched within ``timeout_s`` seconds, else False.
        """
        deadline = time.monotonic() + timeout_s
        while not self._pub.has_subscribers():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.005)
        return True

    async def flush(self) -> None:
        """Wait until the engine accepted every sample published so far (Pulsar: persisted)."""
        await self._pub.flush()

    async def close(self) -> None:
        """Flush and release the publisher; idempotent."""
        if not self._closed:
            self._closed = True
            await self._pub.close()
