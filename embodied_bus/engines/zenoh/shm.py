"""Shared-memory pools and kept buffers for large payloads."""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from typing import Any

from embodied_bus.engines.zenoh.tuning import (
    BODY_REUSE_MIN_BYTES,
    SHM_POOL_BYTES,
    SHM_POOL_MAX_BYTES,
    SHM_POOL_SAMPLES,
)

SHM_DIR = "/dev/shm"


def shm_pool_bytes(payload_bytes: int) -> int | None:
    """Size of a publisher's shared-memory pool for payloads of this size: see
    :data:`SHM_POOL_SAMPLES`; smaller (a quarter of the free room) where ``/dev/shm`` is
    small, e.g. a container's 64 MiB, so that pools never fill it (a process that writes into a
    full ``/dev/shm`` gets SIGBUS); None if not even two payloads would fit."""
    want = min(SHM_POOL_MAX_BYTES, max(SHM_POOL_BYTES, SHM_POOL_SAMPLES * payload_bytes))
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:  # no /dev/shm to look at (not Linux): Zenoh decides
        return want
    free = st.f_bavail * st.f_frsize
    if free >= 2 * want:
        return want
    room = free // 4
    return room if room >= 2 * payload_bytes else None


class BodyBuffers:
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


class ShmPayload:
    """A received payload in a shared-memory segment (an :class:`EngineBuffer`): copied out
    with ``bytes(ZShm)``, which skips the zero-filling ``ZBytes.to_bytes`` does first."""

    __slots__ = ("_shm", "_size")

    def __init__(self, shm: Any, size: int) -> None:
        self._shm = shm
        self._size = size

    def __len__(self) -> int:
        return self._size

    def to_bytes(self) -> bytes:
        return bytes(self._shm)
