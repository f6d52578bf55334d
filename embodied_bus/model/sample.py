"""A received (or to-be-published) sensor sample."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from embodied_bus.errors import EncodingError
from embodied_bus.model.encoding import ENCODING_NPY, decode_npy
from embodied_bus.model.header import Header, Modality

__all__ = ["Payload", "Sample"]

#: What a publisher accepts as a payload.
Payload = bytes | bytearray | memoryview | np.ndarray


class Sample(msgspec.Struct, gc=False):
    """One sample of a stream as seen by a subscriber.

    A ``msgspec.Struct`` that the garbage collector does not track (built in C and never
    scanned: a subscription buffers thousands of samples at high rates, and scanning them
    is a noticeable share of a small-sample stream's CPU). Nothing the bus puts in a sample refers
    back to it; don't make a reference cycle through one (e.g. an ``ack_fn`` that refers to its
    own sample), or the cycle is freed only when broken.

    Attributes:
        header: The decoded wire header.
        payload: The payload bytes, untouched by the bus.
        receive_ns: Wall-clock time the subscriber got it, UTC nanoseconds.
        out_of_order: True if it arrived after a later sample of the same publisher.
        ack_fn: With ``SubscriptionOptions(auto_ack=False)``: acknowledges the sample to the
            engine (Pulsar); call it through :meth:`ack` once the sample is fully processed.
    """

    header: Header
    payload: bytes | memoryview
    receive_ns: int
    out_of_order: bool = False
    ack_fn: Callable[[], None] | None = None

    def __repr__(self) -> str:
        return (
            f"Sample(header={self.header!r}, payload={self.payload!r}, receive_ns={self.receive_ns!r}, "
            f"out_of_order={self.out_of_order!r})"
        )

    def ack(self) -> None:
        """Acknowledge the sample (no-op if it was acknowledged on receipt or the engine has
        no acknowledgements)."""
        fn = self.ack_fn
        if fn is not None:
            self.ack_fn = None
            fn()

    @property
    def stream(self) -> str:
        """Stream name."""
        return self.header.stream

    @property
    def modality(self) -> Modality:
        """Sensor kind."""
        return self.header.modality

    @property
    def seq(self) -> int:
        """Per-publisher sequence number (starts at 1)."""
        return self.header.seq

    @property
    def stamp_ns(self) -> int:
        """Sensor stamp in UTC nanoseconds."""
        return self.header.stamp_ns

    @property
    def bucket(self) -> int:
        """Time-bucket id."""
        return self.header.bucket

    @property
    def latency_ns(self) -> int:
        """Publish-to-receive latency in nanoseconds (wall clocks of both hosts)."""
        return self.receive_ns - self.header.publish_ns

    def as_array(self) -> np.ndarray[Any, Any]:
        """Return the payload as a NumPy array viewing the payload (``npy`` encoding only).

        Raises:
            EncodingError: The encoding is not ``npy`` or the blob is malformed.
        """
        if self.header.encoding != ENCODING_NPY:
            raise EncodingError(f"stream {self.header.stream!r} carries {self.header.encoding!r}, not npy")
        return decode_npy(self.payload)
