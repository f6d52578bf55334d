"""The bridges' action queue credentials, from the robot YAML's ``security:`` section: their
planner signs actions and seals requests with ``planner_key``, their executor of routed kinds
seals with ``executor_key``, and both believe only what the allow-list's keys sealed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from embodied_bus.actions import Planner, ZenohQueueOptions
from embodied_bus.ros.config import SecurityPaths
from embodied_bus.security import Sealer, Signer, Trust, WatchedAllowList, load_private_key

if TYPE_CHECKING:
    from embodied_bus.bus import Bus

__all__ = ["BridgeCredentials", "bridge_credentials", "bridge_planner"]


@dataclass(frozen=True, slots=True)
class BridgeCredentials:
    """What the bridges seal, sign and trust with (all None: unsealed)."""

    signer: Signer | None = None
    planner_sealer: Sealer | None = None
    executor_sealer: Sealer | None = None
    trust: Trust | None = None

    def planner_options(self) -> ZenohQueueOptions | None:
        """The queue options of the bridges' planner (None: unsealed)."""
        return self._options(self.planner_sealer)

    def executor_options(self) -> ZenohQueueOptions | None:
        """The queue options of the bridges' executor (None: unsealed)."""
        return self._options(self.executor_sealer)

    def _options(self, sealer: Sealer | None) -> ZenohQueueOptions | None:
        if sealer is None and self.trust is None:
            return None
        return ZenohQueueOptions(sealer, self.trust)


def bridge_credentials(security: SecurityPaths | None) -> BridgeCredentials:
    """The credentials of ``security`` (None: none).

    Raises:
        KeyFileError: A key or the allow-list cannot be read.
    """
    if security is None:
        return BridgeCredentials()
    planner = load_private_key(security.planner_key) if security.planner_key else None
    executor = load_private_key(security.executor_key) if security.executor_key else None
    return BridgeCredentials(
        signer=Signer(planner) if planner is not None else None,
        planner_sealer=Sealer(planner) if planner is not None else None,
        executor_sealer=Sealer(executor) if executor is not None else None,
        trust=Trust(WatchedAllowList(security.allow_list)),
    )


def bridge_planner(bus: Bus, credentials: BridgeCredentials) -> Planner:
    """The planner of a bridge (ROS submissions, offered kinds)."""
    return Planner(bus, signer=credentials.signer, backend=credentials.planner_options())
