"""A robot's link to its fleet: chosen streams up through a store-and-forward spool, with
classes and rates; state and actions down."""

from embodied_bus.uplink.config import Route, UplinkConfig, uplink_config_from_dict
from embodied_bus.uplink.gate import RateGate
from embodied_bus.uplink.link import LinkStats, Uplink
from embodied_bus.uplink.spool import Spool, SpoolFullError

__all__ = [
    "LinkStats",
    "RateGate",
    "Route",
    "Spool",
    "SpoolFullError",
    "Uplink",
    "UplinkConfig",
    "uplink_config_from_dict",
]
