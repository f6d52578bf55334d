"""Tuning of the Zenoh engine: queue bounds, batch sizes, shared-memory pools, timeouts."""

from __future__ import annotations

import zenoh

#: Shared-memory pool of a publisher that writes large payloads into shared memory: at least
#: this many bytes ...
SHM_POOL_BYTES = 32 * 1024 * 1024
#: ... and room for this many of its first large payload (8 MiB clouds: 64 MiB; with fewer,
#: a burst of large samples finds the pool full and goes the ordinary way). Created at the
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
SLOT_BYTES = SENDER_HIGH_WATER_BYTES // SENDER_HIGH_WATER
#: Longest wait of ``flush`` or a blocked ``publish`` for the sender thread's wake-up before it
#: looks at the sender's state again, seconds.
SENDER_RECHECK_S = 0.5
#: Allocation policy of the shared-memory pool: collect freed segments, never wait.
SHM_ALLOC = zenoh.shm.GarbageCollect()
#: How long a request waits past its own timeout for Zenoh to say it is done, seconds (a
#: session closed under a query never does).
REQUEST_GRACE_S = 1.0
#: Samples (header and payload) up to this size that queue up behind a BLOCK publisher's
#: sender thread go out batched (wire format: a batch attachment); bytes.
BATCH_ITEM_MAX_BYTES = 16 * 1024
#: Most bytes in one batch (Zenoh fragments a message above its 64 KiB transport batch, and
#: one put of 256 KiB still costs less CPU per small sample than four of 64 KiB).
BATCH_MAX_BYTES = 256 * 1024
#: Batch bodies of at least this many bytes are assembled in buffers the sender thread keeps
#: (see :class:`BodyBuffers`); smaller ones are joined afresh.
BODY_REUSE_MIN_BYTES = 64 * 1024
#: Longest wait for the session to close, seconds (then it is left behind on a daemon thread).
CLOSE_TIMEOUT_S = 10.0
