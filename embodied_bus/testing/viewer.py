"""A minimal Foxglove WebSocket protocol client, for tests and benchmarks of the live view.

It speaks the subprotocol foxglove-sdk announces (``foxglove.sdk.v1``): it records the
server's advertisements and status messages, subscribes and unsubscribes by topic, and hands out
message data (opcode 1: subscription id u32, log time u64 ns, payload) per topic. Needs the
``websockets`` package.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

__all__ = ["SUBPROTOCOL", "ViewerClient", "ViewerMessage"]

#: The subprotocol of foxglove-sdk's WebSocket server.
SUBPROTOCOL = "foxglove.sdk.v1"
_MESSAGE_DATA = 0x01
_DATA_HEAD = struct.Struct("<BIQ")


@dataclass(frozen=True, slots=True)
class ViewerMessage:
    """One message received on a subscribed channel.

    Attributes:
        topic: Channel topic.
        log_time_ns: The message time the server sent (the sensor stamp for streams).
        payload: Message bytes in the channel's encoding.
    """

    topic: str
    log_time_ns: int
    payload: bytes


class ViewerClient:
    """Connect with :meth:`connect`; close with :meth:`close` (or ``async with``).

    Args:
        max_queue: Frames the WebSocket library buffers before it stops reading the socket
            (a small value and no :meth:`next_message` calls make a viewer that never reads).
    """

    def __init__(self, url: str, *, max_queue: int | None = 1024) -> None:
        self.url = url
        self._max_queue = max_queue
        self._ws: Any = None
        self._reader: asyncio.Task[None] | None = None
        #: Advertised channels by topic (the ``advertise`` entries).
        self.channels: dict[str, dict[str, Any]] = {}
        #: Status messages received (``level``, ``message``), oldest first.
        self.statuses: list[dict[str, Any]] = []
        self.server_info: dict[str, Any] | None = None
        self._by_sub: dict[int, str] = {}
        self._subs: dict[str, int] = {}
        self._next_sub = 1
        self._messages: defaultdict[str, asyncio.Queue[ViewerMessage]] = defaultdict(asyncio.Queue)
        self._changed = asyncio.Event()

    async def connect(self, *, read: bool = True) -> ViewerClient:
        """Open the connection; with ``read=False`` nothing is read after the handshake."""
        import websockets
        from websockets.typing import Subprotocol

        self._ws = await websockets.connect(
            self.url, subprotocols=[Subprotocol(SUBPROTOCOL)], max_size=None, max_queue=self._max_queue
        )
        if read:
            self._reader = asyncio.create_task(self._read())
        return self

    async def __aenter__(self) -> ViewerClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._ws is not None:
            await self._ws.close()

    async def _read(self) -> None:
        async for frame in self._ws:
            if isinstance(frame, bytes):
                self._data(frame)
            else:
                self._control(json.loads(frame))
            self._changed.set()

    def _data(self, frame: bytes) -> None:
        if len(frame) < _DATA_HEAD.size or frame[0] != _MESSAGE_DATA:
            return
        _, sub_id, log_time = _DATA_HEAD.unpack_from(frame)
        topic = self._by_sub.get(sub_id)
        if topic is not None:
            self._messages[topic].put_nowait(ViewerMessage(topic, log_time, frame[_DATA_HEAD.size :]))

    def _control(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "serverInfo":
            self.server_info = msg
        elif op == "advertise":
            for ch in msg["channels"]:
                self.channels[ch["topic"]] = ch
        elif op == "unadvertise":
            gone = set(msg["channelIds"])
            self.channels = {t: c for t, c in self.channels.items() if c["id"] not in gone}
        elif op == "status":
            self.statuses.append(msg)

    async def wait_for(self, predicate: Any, timeout_s: float = 10.0, what: str = "") -> None:
        """Wait until ``predicate()`` holds after messages arrive.

        Raises:
            TimeoutError: Naming ``what``.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not predicate():
            self._changed.clear()
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what or predicate}")
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                continue

    async def wait_advertised(self, topics: list[str], timeout_s: float = 10.0) -> None:
        """Wait until every topic is advertised."""
        try:
            await self.wait_for(lambda: all(t in self.channels for t in topics), timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"{sorted(set(topics) - set(self.channels))} not advertised within {timeout_s:g} s "
                f"(advertised: {sorted(self.channels)})"
            ) from None

    async def subscribe(self, *topics: str) -> None:
        """Subscribe to advertised topics."""
        subs = []
        for topic in topics:
            sub_id = self._next_sub
            self._next_sub += 1
            self._subs[topic] = sub_id
            self._by_sub[sub_id] = topic
            subs.append({"id": sub_id, "channelId": self.channels[topic]["id"]})
        await self.send({"op": "subscribe", "subscriptions": subs})

    async def unsubscribe(self, *topics: str) -> None:
        """Stop the subscriptions of these topics."""
        ids = [self._subs.pop(t) for t in topics]
        await self.send({"op": "unsubscribe", "subscriptionIds": ids})

    async def send(self, message: dict[str, Any] | str | bytes) -> None:
        """Send a control message (a dict as JSON), or raw text / bytes."""
        await self._ws.send(json.dumps(message) if isinstance(message, dict) else message)

    async def next_message(self, topic: str, timeout_s: float = 10.0) -> ViewerMessage:
        """The next message of a subscribed topic.

        Raises:
            TimeoutError: None within ``timeout_s``.
        """
        try:
            return await asyncio.wait_for(self._messages[topic].get(), timeout_s)
        except TimeoutError:
            raise TimeoutError(f"no message on {topic} within {timeout_s:g} s") from None

    def received(self, topic: str) -> int:
        """Messages of a topic received and not yet taken."""
        return self._messages[topic].qsize()


async def count_messages(url: str, topic: str, connect_timeout_s: float = 30.0) -> None:
    """Connect, subscribe to ``topic`` once advertised (prints ``ready``), count its messages
    until SIGINT or SIGTERM, then print ``{"received": N}`` (a viewer process for benchmarks)."""
    import signal

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    deadline = loop.time() + connect_timeout_s
    while True:
        try:
            client = await ViewerClient(url).connect()
            break
        except OSError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.2)
    received = 0
    try:
        await client.wait_advertised([topic], timeout_s=connect_timeout_s)
        await client.subscribe(topic)
        print("ready", flush=True)
        while not stop.is_set():
            try:
                await client.next_message(topic, timeout_s=0.2)
            except TimeoutError:
                continue
            received += 1
    finally:
        await client.close()
    print(json.dumps({"received": received}), flush=True)


if __name__ == "__main__":
    import sys

    asyncio.run(count_messages(sys.argv[1], sys.argv[2]))
