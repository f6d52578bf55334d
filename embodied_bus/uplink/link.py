"""The uplink: a robot's streams up to the fleet through a store-and-forward spool.

Samples of the routed streams are read off the robot's bus, passed through each stream's rate
gate, and written to the :class:`~embodied_bus.uplink.spool.Spool`. One sender takes them out in
class order, hands them to the fleet bus with their headers unchanged (stream, publisher id,
sequence number, sensor stamp, bucket), waits until the fleet has them (on Pulsar: persisted),
and only then forgets them. A link that drops holds the batch in flight; everything after it
waits on disk, so when the link returns the most important class goes first. A batch the fleet
refused is sent again: the fleet's subscribers drop the copies by publisher and sequence number.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from embodied_bus.bus import Bus
from embodied_bus.engines.base import EnginePublisher
from embodied_bus.errors import BusClosedError, BusConnectionError, EmbodiedBusError
from embodied_bus.model.header import decode_header, encode_header
from embodied_bus.model.qos import Backpressure, PublisherOptions, SubscriptionOptions
from embodied_bus.model.sample import Sample
from embodied_bus.streams.subscriber import Subscription
from embodied_bus.uplink.config import Route, UplinkConfig
from embodied_bus.uplink.gate import RateGate
from embodied_bus.uplink.spool import Spool, Spooled

__all__ = ["LinkStats", "Uplink"]

_log = logging.getLogger("embodied_bus.uplink")

#: Most samples and bytes handed to the fleet bus before waiting for them to be persisted.
BATCH_ITEMS = 512
BATCH_BYTES = 8 * 2**20
#: Samples read off the robot's bus before they are written to the spool together.
INTAKE_BATCH = 256
#: Wait this long before sending again after the fleet refused a batch, seconds (doubling).
RETRY_FIRST_S = 0.2
RETRY_MAX_S = 5.0


@dataclass
class LinkStats:
    """What crossed, what waits, what was given up (counts per stream)."""

    received: Counter[str] = field(default_factory=Counter)
    spooled: Counter[str] = field(default_factory=Counter)
    sent: Counter[str] = field(default_factory=Counter)
    skipped_by_rate: Counter[str] = field(default_factory=Counter)
    degraded_episodes: int = 0
    degraded_s: float = 0.0
    send_errors: int = 0

    def as_dict(self, spool: Spool, degraded: bool) -> dict[str, Any]:
        streams = sorted(set(self.received) | set(self.sent) | set(spool.dropped))
        return {
            "degraded": degraded,
            "degraded_episodes": self.degraded_episodes,
            "degraded_s": round(self.degraded_s, 1),
            "backlog_items": len(spool),
            "backlog_bytes": spool.size_bytes,
            "send_errors": self.send_errors,
            "streams": {
                s: {
                    "received": self.received[s],
                    "spooled": self.spooled[s],
                    "sent": self.sent[s],
                    "skipped_by_rate": self.skipped_by_rate[s],
                    "dropped_spool_full": spool.dropped[s],
                }
                for s in streams
            },
        }


class Uplink:
    """Forwards ``config.routes`` from ``robot`` (the robot's bus) to ``fleet`` (the fleet bus,
    opened in the robot's fleet namespace). ``await run(stop)`` until ``stop`` is set."""

    def __init__(self, robot: Bus, fleet: Bus, config: UplinkConfig, spool: Spool | None = None) -> None:
        if not config.routes:
            raise EmbodiedBusError("the uplink has no streams to forward (uplink.streams is empty)")
        self.robot = robot
        self.fleet = fleet
        self.config = config
        self.spool = spool or Spool(config.spool, config.spool_limit_bytes)
        self.stats = LinkStats()
        self._routes = {r.stream: r for r in config.routes}
        self._gates = {r.stream: RateGate(r.rate_hz, r.down_rate_hz) for r in config.routes}
        self._publishers: dict[str, EnginePublisher] = {}
        self._waiting = asyncio.Event()  # the spool got something
        self._degraded_since: float | None = None
        self._subscriptions: list[Subscription] = []

    @property
    def degraded(self) -> bool:
        """Whether the link is degraded: a batch waited longer than ``degraded_after_s`` for
        the fleet, and the backlog since has not drained."""
        return self._degraded_since is not None

    def report(self) -> dict[str, Any]:
        """Figures for a progress line (JSON-ready)."""
        out = self.stats.as_dict(self.spool, self.degraded)
        out["robot"] = self.config.robot
        return out

    async def run(self, stop: asyncio.Event) -> None:
        """Forward until ``stop`` is set; what is left in the spool stays for the next run."""
        for lossless in (True, False):
            streams = [r.stream for r in self.config.routes if r.lossless is lossless]
            if streams:
                opts = SubscriptionOptions(
                    capacity=100_000 if lossless else 64,  # lossy: large samples, the newest win
                    backpressure=Backpressure.BLOCK if lossless else Backpressure.DROP_OLDEST,
                )
                self._subscriptions.append(await self.robot.subscribe(streams, options=opts))
        if len(self.spool):
            self._waiting.set()  # what an earlier run left
        tasks = [asyncio.create_task(self._intake(sub)) for sub in self._subscriptions]
        tasks.append(asyncio.create_task(self._send_loop(stop)))
        stopping = asyncio.create_task(stop.wait())
        try:
            done, _ = await asyncio.wait([*tasks, stopping], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not stopping and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
        finally:
            for t in [*tasks, stopping]:
                t.cancel()
            await asyncio.gather(*tasks, stopping, return_exceptions=True)
            await self._close()

    async def _close(self) -> None:
        for sub in self._subscriptions:
            await sub.close()
        self._subscriptions.clear()
        for pub in self._publishers.values():
            try:
                await asyncio.wait_for(pub.close(), 5.0)
            except (TimeoutError, EmbodiedBusError) as err:  # the spool still has what it held
                _log.debug("closing a fleet publisher: %s", err)
        self._publishers.clear()
        self.spool.close()

    # ------------------------------------------------------------------ robot side
    async def _intake(self, sub: Subscription) -> None:
        async for batch in sub.batches(INTAKE_BATCH):
            items = self._admit(batch)
            if not items:
                continue
            if sum(len(p) for *_, p in items) > 256 * 1024:
                await asyncio.to_thread(self.spool.put_many, items)
            else:
                self.spool.put_many(items)
            self._waiting.set()

    def _admit(self, batch: list[Sample]) -> list[tuple[int, str, bytes, bytes]]:
        degraded = self.degraded
        items = []
        for sample in batch:
            h = sample.header
            route: Route | None = self._routes.get(h.stream)
            if route is None:
                continue
            self.stats.received[h.stream] += 1
            if not self._gates[h.stream].keep(h.stamp_ns, degraded=degraded):
                self.stats.skipped_by_rate[h.stream] += 1
                continue
            self.stats.spooled[h.stream] += 1
            items.append((route.cls, h.stream, encode_header(h), bytes(sample.payload)))
        return items

    # ------------------------------------------------------------------ fleet side
    async def _publisher(self, stream: str) -> EnginePublisher:
        pub = self._publishers.get(stream)
        if pub is None:
            options = PublisherOptions(backpressure=Backpressure.BLOCK)  # held while the link is down
            pub = self._publishers[stream] = await self.fleet.engine.create_publisher(stream, options)
        return pub

    async def _send_loop(self, stop: asyncio.Event) -> None:
        retry_s = RETRY_FIRST_S
        while not stop.is_set():
            self._waiting.clear()  # before the take: a put after it sets it again
            batch = self.spool.take(BATCH_ITEMS, BATCH_BYTES)
            if not batch:
                self._drained()
                await self._waiting.wait()
                continue
            try:
                await self._deliver(batch)
            except (BusConnectionError, BusClosedError, EmbodiedBusError) as err:
                self.spool.give_back(batch)
                self.stats.send_errors += 1
                self._degrade()
                _log.warning(
                    "uplink: the fleet refused %d samples (sent again in %.1f s): %s",
                    len(batch),
                    retry_s,
                    err,
                )
                await asyncio.sleep(retry_s)
                retry_s = min(retry_s * 2, RETRY_MAX_S)
                continue
            retry_s = RETRY_FIRST_S
            self.spool.remove(batch)
            for item in batch:
                self.stats.sent[item.stream] += 1

    async def _deliver(self, batch: list[Spooled]) -> None:
        """Hand ``batch`` to the fleet bus in order; return once the fleet has all of it."""
        used: dict[str, EnginePublisher] = {}
        for item in batch:
            pub = used.get(item.stream) or await self._publisher(item.stream)
            used[item.stream] = pub
            if not pub.send(decode_header(item.header), item.payload):
                raise BusConnectionError(f"the fleet bus dropped a sample of {item.stream!r}")
        flushed = asyncio.ensure_future(asyncio.gather(*(p.flush() for p in used.values())))
        done, _ = await asyncio.wait([flushed], timeout=self.config.degraded_after_s)
        if not done:
            self._degrade()  # the link is slow or gone: wait on, the client resends on reconnect
        await flushed

    def _degrade(self) -> None:
        if self._degraded_since is None:
            self._degraded_since = time.monotonic()
            self.stats.degraded_episodes += 1
            _log.warning("uplink: link to the fleet degraded (samples wait in the spool)")

    def _drained(self) -> None:
        if self._degraded_since is not None:
            took = time.monotonic() - self._degraded_since
            self.stats.degraded_s += took
            self._degraded_since = None
            _log.warning("uplink: link to the fleet back, backlog drained (%.1f s degraded)", took)
