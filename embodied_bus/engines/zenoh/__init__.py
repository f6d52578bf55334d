"""The Zenoh engine: an embedded peer (default), a client of a router, or a router itself."""

from embodied_bus.engines.zenoh.config import build_zenoh_config, stream_key
from embodied_bus.engines.zenoh.engine import ZenohEngine

__all__ = ["ZenohEngine", "build_zenoh_config", "stream_key"]
