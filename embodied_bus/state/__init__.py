"""Latest-value state: a table per name and namespace holding the newest value of every key
(a pose, a calibration, a mission's progress), loaded in full by a process that starts late.

On Zenoh a state service stores the tables (``embodied-bus queue`` hosts one); on Pulsar each
table is a compacted topic.
"""

from embodied_bus.state.model import StateEntry
from embodied_bus.state.service import StateService
from embodied_bus.state.store import StateStore
from embodied_bus.state.table import StateBackend, StateOptions, StateTable, open_state, register_state

__all__ = [
    "StateBackend",
    "StateEntry",
    "StateOptions",
    "StateService",
    "StateStore",
    "StateTable",
    "open_state",
    "register_state",
]
