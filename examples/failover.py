"""An active/standby pair: of two subscriptions in one failover group only the active one gets
the stream; when it leaves, the standby takes over with nothing lost."""

import asyncio
import time

from embodied_bus import Backpressure, SubscriptionOptions, open_bus

OPTIONS = SubscriptionOptions(failover_group="planner", backpressure=Backpressure.BLOCK, auto_ack=False)


async def take(sub, count: int) -> list[int]:
    seqs = []
    for _ in range(count):
        sample = await sub.recv(timeout_s=5)
        seqs.append(sample.seq)
        sample.ack()  # handled: a standby need not repeat it
    return seqs


async def main() -> None:
    async with open_bus("zenoh:", namespace="robot1") as bus:  # or "pulsar://host:6650"
        active = await bus.subscribe("orders", options=OPTIONS)  # the oldest member is active
        standby = await bus.subscribe("orders", options=OPTIONS)
        pub = await bus.publisher("orders")
        for i in range(10):
            await pub.publish(b"order %d" % i, stamp_ns=time.time_ns())
        first = await take(active, 10)
        await active.close()  # or the process dies: the standby takes over
        for i in range(10, 20):
            await pub.publish(b"order %d" % i, stamp_ns=time.time_ns())
        then = await take(standby, 10)
        print(f"active: {first[0]}..{first[-1]}; after it left, the standby: {then[0]}..{then[-1]}")


asyncio.run(main())
