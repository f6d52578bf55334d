"""Publish a point cloud and receive it as a zero-copy NumPy view, on an embedded Zenoh bus."""

import asyncio
import time

import numpy as np

from embodied_bus import Backpressure, SubscriptionOptions, open_bus


async def main() -> None:
    async with open_bus("zenoh:", namespace="robot1") as bus:  # or "pulsar://host:6650"
        sub = await bus.subscribe(
            "lidar/top", options=SubscriptionOptions(capacity=8, backpressure=Backpressure.DROP_OLDEST)
        )
        pub = await bus.publisher("lidar/top", modality="lidar", encoding="npy", frame_id="lidar_top")
        await pub.wait_for_subscribers(2.0)
        cloud = np.zeros(100_000, dtype=[("x", "<f4"), ("y", "<f4"), ("z", "<f4")])
        await pub.publish_array(cloud, stamp_ns=time.time_ns())
        s = await sub.recv(timeout_s=2)
        print(s.seq, s.stamp_ns, s.bucket, s.header.frame_id, s.as_array().shape)
        print(sub.counters())  # received, delivered, gaps, missing, out_of_order, duplicates, dropped


asyncio.run(main())
