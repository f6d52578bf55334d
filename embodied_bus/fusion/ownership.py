"""Which fusion worker publishes which bucket.

Both engines keep a live group of workers (:class:`OwnershipRing`: Zenoh liveliness tokens,
Pulsar heartbeats on a non-persistent topic) and deal work out by rendezvous hashing.

Pulsar (Key_Shared): the hash space of the bucket key is cut into :data:`DEFAULT_SLOTS` slots;
each worker consumes its slots (:func:`slot_ranges`) from every modality topic with one
Key_Shared STICKY consumer, so one worker gets all samples of a bucket. Samples are acknowledged
only after their bucket's frame is out; when slots move, the old owner closes its consumer (between
two samples) and its unacknowledged samples (open buckets) are redelivered whole to the new
owner, which reads the frames stream to its end before publishing a handed-over bucket, so a
bucket whose frame a crashed owner published but did not acknowledge is not published again.

Zenoh ring: every worker receives every sample and assembles every bucket, and
exactly one, the owner, publishes each frame. Owners come from rendezvous hashing over the live
members of a liveliness group. A member joins *from* a future bucket it announces in its token
(current event time + a margin), so the others learn of it before ownership changes and no
bucket is published twice. When a member dies, the survivors publish the frames it owned but
had not published (they watch the frames stream), so no bucket is lost.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import Mapping

from embodied_bus.bus import Bus
from embodied_bus.engines.base import GroupMembership
from embodied_bus.engines.capabilities import membership

__all__ = [
    "COLD_START",
    "DEFAULT_SLOTS",
    "OwnershipRing",
    "bucket_slot",
    "in_ranges",
    "rendezvous_owner",
    "slot_ranges",
]

#: Announced by workers that start before any data flows and find no other member.
COLD_START = "min"
#: Slices of the Key_Shared hash space [0, 65535] dealt out to Pulsar workers.
DEFAULT_SLOTS = 16


def _murmur3_32(data: bytes, seed: int = 0) -> int:
    """MurmurHash3 x86 32-bit, as Pulsar hashes sticky keys."""
    c1, c2, mask = 0xCC9E2D51, 0x1B873593, 0xFFFFFFFF
    h = seed
    n = len(data) - len(data) % 4
    for i in range(0, n, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * c1) & mask
        k = ((k << 15) | (k >> 17)) & mask
        h ^= (k * c2) & mask
        h = ((h << 13) | (h >> 19)) & mask
        h = (h * 5 + 0xE6546B64) & mask
    k = int.from_bytes(data[n:], "little") if n < len(data) else 0
    if k:
        k = (k * c1) & mask
        k = ((k << 15) | (k >> 17)) & mask
        h ^= (k * c2) & mask
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & mask
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & mask
    return h ^ (h >> 16)


def bucket_slot(bucket: int) -> int:
    """Where Pulsar Key_Shared puts the samples of a bucket in the hash space [0, 65535]
    (their key is the bucket id in decimal; the broker takes Murmur3-32 of it modulo 65536)."""
    return _murmur3_32(str(bucket).encode()) & 0xFFFF


def in_ranges(slot: int, ranges: tuple[tuple[int, int], ...]) -> bool:
    """Whether ``slot`` lies in one of the inclusive ``ranges``."""
    return any(lo <= slot <= hi for lo, hi in ranges)


def _score(member: str, bucket: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{member}:{bucket}".encode(), digest_size=8).digest(), "big")


def rendezvous_owner(bucket: int, members: Mapping[str, int | None]) -> str | None:
    """Owner of a bucket among members (member id -> first bucket it may own, None = any).

    Highest-random-weight hashing: adding or removing a member moves only the buckets it wins
    or held. Deterministic on every worker with the same member view. A bucket before every
    member's first one (its owner left: a worker that started first and died) goes to the
    members as if they owned it from the start, so its frames are taken over, not lost.
    """
    best: tuple[int, str] | None = None
    for m, start in members.items():
        if start is not None and start > bucket:
            continue
        cand = (_score(m, bucket), m)
        if best is None or cand > best:
            best = cand
    if best is None and members:
        best = max((_score(m, bucket), m) for m in members)
    return None if best is None else best[1]


def slot_ranges(
    worker: str, members: Mapping[str, int | None], slots: int = DEFAULT_SLOTS
) -> tuple[tuple[int, int], ...]:
    """Inclusive Key_Shared hash ranges of the slots a worker owns among ``members``."""
    width = 65536 // slots
    mine = [s for s in range(slots) if rendezvous_owner(s, {m: None for m in members}) == worker]
    ranges: list[tuple[int, int]] = []
    for s in mine:
        lo, hi = s * width, 65535 if s == slots - 1 else (s + 1) * width - 1
        if ranges and ranges[-1][1] + 1 == lo:
            ranges[-1] = (ranges[-1][0], hi)
        else:
            ranges.append((lo, hi))
    return tuple(ranges)


class OwnershipRing:
    """A live group of fusion workers and the bucket ownership it implies.

    Args:
        bus: The worker's bus.
        group: Group name (the fusion pipeline's name).
        worker_id: This worker's id (default: random).
    """

    def __init__(self, bus: Bus, group: str, worker_id: str | None = None) -> None:
        self.bus = bus
        self.group = group
        self.worker_id = worker_id or uuid.uuid4().hex[:12]
        self._handle: GroupMembership | None = None
        self._watch: GroupMembership | None = None  # watching on after leaving
        self._members: dict[str, int | None] = {}
        self.departures: asyncio.Queue[str] = asyncio.Queue()
        #: Set whenever a member joins or leaves.
        self.changed = asyncio.Event()
        self.joined_from: int | None = None
        self._joined = False
        self._loop = asyncio.get_running_loop()

    def _on_change(self, member: str, value: str, joined: bool) -> None:
        start = None if value == COLD_START else int(value)
        if joined:
            self._loop.call_soon_threadsafe(self._arrive, member, start)
        else:
            self._loop.call_soon_threadsafe(self._depart, member)

    def _arrive(self, member: str, start: int | None) -> None:
        self._members[member] = start
        self.changed.set()

    def _depart(self, member: str) -> None:
        self._members.pop(member, None)
        self.departures.put_nowait(member)
        self.changed.set()

    async def watch(self, settle_s: float = 0.3) -> list[str]:
        """Start watching the group; return the members seen after ``settle_s`` seconds."""
        if self._handle is None:
            self._handle = await membership(
                self.bus.engine, "an ownership ring of fusion workers"
            ).watch_group(self.group, self._on_change)
        await asyncio.sleep(settle_s)
        return [m for m in self._members if m != self.worker_id]

    async def join(self, from_bucket: int | None) -> None:
        """Announce this worker, owning buckets from ``from_bucket`` on (None: from the start)."""
        if self._handle is None:
            await self.watch(0.0)
        assert self._handle is not None
        self.joined_from = from_bucket
        await self._handle.announce(self.worker_id, COLD_START if from_bucket is None else str(from_bucket))
        self._members[self.worker_id] = from_bucket
        self._joined = True

    @property
    def joined(self) -> bool:
        """Whether this worker announced itself."""
        return self._joined

    async def refresh(self) -> None:
        """Ask the group who is alive now and add those this view missed."""
        if self._handle is not None:
            await self._handle.refresh()
            await asyncio.sleep(0)  # the arrivals it found are taken in (call_soon_threadsafe)

    def members(self) -> dict[str, int | None]:
        """Live workers and the bucket each owns from."""
        return dict(self._members)

    def owner(self, bucket: int) -> str | None:
        """The worker that publishes ``bucket``."""
        return rendezvous_owner(bucket, self.members())

    def owns(self, bucket: int) -> bool:
        """Whether this worker publishes ``bucket``."""
        return self._joined and self.owner(bucket) == self.worker_id

    async def leave(self, *, keep_watching: bool = False) -> None:
        """Leave the group (others take over from then on).

        Args:
            keep_watching: Go on tracking the other members (:meth:`members`, :attr:`changed`)
                until :meth:`close`, e.g. to see whether anyone is left to take over.
        """
        if keep_watching and self._watch is None:
            self._watch = await membership(
                self.bus.engine, "an ownership ring of fusion workers"
            ).watch_group(self.group, self._on_change)
        if self._handle is not None:
            await self._handle.leave()
        self._handle = None
        self._joined = False

    async def close(self) -> None:
        """Leave the group if still in it and stop watching it."""
        await self.leave()
        if self._watch is not None:
            await self._watch.leave()
            self._watch = None
