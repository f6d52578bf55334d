"""Record bus streams and fused frames to MCAP with ROS 2 schemas (Foxglove opens it).

* A ``cdr:<type>`` stream becomes channel ``/<stream>`` (message encoding ``cdr``, schema
  ``ros2msg`` generated from the typestore), log time = receive time, publish time = header stamp.
* A fused frame stream becomes one channel per member stream, ``/<frames stream>/<member>``, with
  the member's own type and stamps, plus ``/<frames stream>/meta`` (JSON: bucket, missing,
  skew, latency) as a ``std_msgs/msg/String``, so the file stays a plain ROS 2 MCAP.
* Other encodings (``npy``, ``raw``...) are stored schemaless with the encoding as message
  encoding, so nothing is lost even if Foxglove cannot draw them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

from embodied_bus.errors import EmbodiedBusError
from embodied_bus.fusion.codec import FRAME_ENCODING, decode_frame, frame_summary
from embodied_bus.model.sample import Sample
from embodied_bus.rosmsg.conversions import typestore

__all__ = ["McapRecorder", "RecorderError", "record"]


class RecorderError(EmbodiedBusError):
    """The MCAP file cannot be written."""


class McapRecorder:
    """Writes samples to an MCAP file; use as a context manager.

    Args:
        path: Output file (``.mcap``).
    """

    def __init__(self, path: str | Path) -> None:
        from mcap.writer import Writer

        self.path = Path(path)
        try:
            self._fh: IO[bytes] = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        except OSError as err:
            raise RecorderError(f"cannot write {str(path)!r}: {err}") from err
        self._writer = Writer(self._fh)
        self._writer.start(profile="ros2", library="embodied_bus")
        self._schemas: dict[str, int] = {}
        self._channels: dict[tuple[str, str], int] = {}
        self._json_schema: int | None = None
        #: Messages written per channel topic.
        self.counts: dict[str, int] = {}

    def _schema(self, typename: str) -> int:
        sid = self._schemas.get(typename)
        if sid is None:
            ts = typestore()
            if typename in ts.fielddefs:
                text = ts.generate_msgdef(typename, ros_version=2)[0]
                sid = self._writer.register_schema(name=typename, encoding="ros2msg", data=text.encode())
            else:
                sid = 0
            self._schemas[typename] = sid
        return sid

    def _channel(self, topic: str, encoding: str) -> int:
        key = (topic, encoding)
        cid = self._channels.get(key)
        if cid is None:
            if encoding.startswith("cdr:"):
                cid = self._writer.register_channel(
                    topic=topic, message_encoding="cdr", schema_id=self._schema(encoding[4:])
                )
            elif encoding == "json":
                if self._json_schema is None:
                    self._json_schema = self._writer.register_schema(
                        name="embodied_bus/FrameMeta", encoding="jsonschema", data=b'{"type": "object"}'
                    )
                cid = self._writer.register_channel(
                    topic=topic, message_encoding="json", schema_id=self._json_schema
                )
            else:
                cid = self._writer.register_channel(topic=topic, message_encoding=encoding, schema_id=0)
            self._channels[key] = cid
        return cid

    def _write(self, topic: str, encoding: str, payload: Any, log_ns: int, stamp_ns: int, seq: int) -> None:
        self._writer.add_message(
            self._channel(topic, encoding),
            log_time=log_ns,
            publish_time=stamp_ns,
            data=bytes(payload),
            sequence=seq & 0xFFFFFFFF,
        )
        self.counts[topic] = self.counts.get(topic, 0) + 1

    def write(self, sample: Sample) -> None:
        """Record one sample (a fused frame is recorded member by member, plus its metadata)."""
        h = sample.header
        topic = "/" + h.stream
        if h.encoding == FRAME_ENCODING:
            frame = decode_frame(sample.payload)
            for name, members in frame.members.items():
                for m in members:
                    mh = m.sample.header
                    self._write(
                        f"{topic}/{name}",
                        mh.encoding,
                        m.sample.payload,
                        sample.receive_ns,
                        mh.stamp_ns,
                        mh.seq,
                    )
            ts = typestore()
            meta = ts.serialize_cdr(
                ts.types["std_msgs/msg/String"](data=json.dumps(frame_summary(frame, sample.receive_ns))),
                "std_msgs/msg/String",
            )
            self._write(
                f"{topic}/meta",
                "cdr:std_msgs/msg/String",
                meta,
                sample.receive_ns,
                frame.reference_stamp_ns,
                h.seq,
            )
            return
        self._write(topic, h.encoding, sample.payload, sample.receive_ns, h.stamp_ns, h.seq)

    def close(self) -> None:
        """Finish the file (summary and index); idempotent."""
        if not self._fh.closed:
            self._writer.finish()  # type: ignore[no-untyped-call]
            self._fh.close()

    def __enter__(self) -> McapRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def record(
    bus: Any,
    path: str | Path,
    streams: list[str] | None,
    stop: Any,
    *,
    ready: Any = None,
    counts: dict[str, int] | None = None,
) -> dict[str, int]:
    """Record streams of ``bus`` (all streams if ``streams`` is None) until ``stop`` is set.

    Args:
        counts: Updated live with the messages written per MCAP topic (progress).

    Returns:
        Messages written per MCAP topic.
    """
    from embodied_bus.model.qos import Backpressure, SubscriptionOptions

    opts = SubscriptionOptions(capacity=65536, backpressure=Backpressure.BLOCK)
    sub = await bus.subscribe(tuple(streams) if streams else None, options=opts)
    if ready is not None:
        ready.set()
    with McapRecorder(path) as rec:
        if counts is not None:
            rec.counts = counts
        try:
            while not stop.is_set():
                try:
                    batch = await sub.recv_many(timeout_s=0.2)  # one hand-over per burst
                except TimeoutError:
                    continue
                for sample in batch:
                    rec.write(sample)
            while batch := sub.recv_many_nowait():  # what already arrived is kept
                for sample in batch:
                    rec.write(sample)
        finally:
            await sub.close()
    return dict(rec.counts)
