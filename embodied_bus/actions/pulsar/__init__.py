"""The action queue on Apache Pulsar, as a package of one concern per module: topic names
(:mod:`.topics`), the records of the state log and replies (:mod:`.records`), sending from the
event loop (:mod:`.sending`), the state log's view (:mod:`.statelog`), an executor's consumers
and leases (:mod:`.worker`) and the planner's side (:mod:`.queue`)."""

from embodied_bus.actions.pulsar.queue import PulsarQueue, open_pulsar_queue
from embodied_bus.actions.pulsar.statelog import StateLog
from embodied_bus.actions.pulsar.topics import ActionTopics
from embodied_bus.actions.pulsar.worker import RECEIVER_QUEUE_SIZE, PulsarWorker

__all__ = [
    "RECEIVER_QUEUE_SIZE",
    "ActionTopics",
    "PulsarQueue",
    "PulsarWorker",
    "StateLog",
    "open_pulsar_queue",
]
