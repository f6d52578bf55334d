"""A 1 kHz IMU burst published and received in batches; every sample keeps its own header."""

import asyncio
import time

from embodied_bus import Backpressure, PublisherOptions, SubscriptionOptions, open_bus

N = 1000


async def main() -> None:
    async with open_bus("zenoh:", namespace="robot1") as bus:
        sub = await bus.subscribe(
            "imu", options=SubscriptionOptions(capacity=4096, backpressure=Backpressure.BLOCK)
        )
        pub = await bus.publisher(
            "imu", modality="imu", options=PublisherOptions(backpressure=Backpressure.BLOCK)
        )
        await pub.wait_for_subscribers(2.0)
        t0 = time.time_ns()
        seqs = await pub.publish_many([bytes(48)] * N, stamps_ns=[t0 + i * 1_000_000 for i in range(N)])
        got = 0
        async for batch in sub.batches(max_samples=256):
            got += len(batch)
            print(f"batch of {len(batch)}: seq {batch[0].seq}..{batch[-1].seq}")
            if got == N:
                break
        print(f"published seq {seqs.start}..{seqs.stop - 1}; counters {sub.counters()}")


asyncio.run(main())
