"""Tuning of the Pulsar engine: message sizes, send-queue bounds, batching, timeouts."""

from __future__ import annotations

import logging

_logger = logging.getLogger("embodied_bus.pulsar")


#: Pulsar's default ``maxMessageSize`` (5 MiB) less the client's metadata reserve (10 KiB).
PULSAR_MAX_MESSAGE_BYTES = 5 * 1024 * 1024 - 10 * 1024
#: Chunked messages that may be assembled at once per consumer (several producers interleave).
MAX_PENDING_CHUNKED = 64

#: A BLOCK publisher's ``publish`` starts to await once this many samples await the broker's
#: confirmation (the client's own send queue holds 1,000: the event loop never blocks in a full
#: one) ...
PULSAR_HIGH_WATER = 800
#: ... and resumes once no more than this many do.
PULSAR_LOW_WATER = 400
#: Unconfirmed payload bytes count as messages of this many bytes each (64 MiB / 800): a BLOCK
#: publisher of large samples awaits above ~64 MiB unconfirmed, not 800 messages (6 GiB of
#: 8 MiB clouds), and every send this large carries its own completion callback.
PULSAR_SLOT_BYTES = 64 * 1024 * 1024 // PULSAR_HIGH_WATER
#: Longest wait of a subscriber's receive, milliseconds: acknowledgements queued by the
#: application are sent at least this often.
ACK_FLUSH_MS = 100
#: Every this many sends of a publisher, one carries a completion callback (see
#: ``PulsarPublisher``).
CONFIRM_EVERY = 16
#: A BLOCK publisher on the event loop batches samples while at least this many of its sends
#: await the broker's confirmation (the broker is behind): the samples published meanwhile go
#: out as one message (see ``PulsarPublisher``). Below it, every sample is sent at once.
BATCH_WHEN_UNCONFIRMED = 64
#: A batch holds samples up to this size (header and payload), bytes ...
PULSAR_BATCH_ITEM_MAX_BYTES = 16 * 1024
#: ... and at most this many bytes, and samples of one bucket only (the message key).
PULSAR_BATCH_MAX_BYTES = 64 * 1024
#: Pause before asking a reader again while it reconnects after a seek, seconds.
SEEK_RETRY_S = 0.05
#: Longest wait for a client, producer, consumer or reader to close, seconds (one that cannot
#: reconnect after a broker crash can block its close; it is then left behind on a daemon thread).
CLOSE_TIMEOUT_S = 5.0


#: Heartbeat period of group members, seconds.
GROUP_HEARTBEAT_S = 0.25
#: A member unheard of for this long has left, seconds.
GROUP_EXPIRY_S = 3.0
