"""Retry policy: how long to wait before the next attempt, when to give up, and where to retry."""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Protocol

from embodied_bus.errors import BusConfigError

__all__ = ["DEFAULT_RETRY", "PermanentFailure", "Retried", "RetryPolicies", "RetryPolicy"]


class PermanentFailure(Exception):
    """Raised by a handler: retrying cannot help; the action goes to the dead-letter queue now."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with jitter and a maximum number of attempts.

    Attributes:
        max_attempts: Tries before dead-lettering (crashes and lost leases count).
        initial_backoff_s: Delay after the first failure, seconds.
        max_backoff_s: Upper bound of the delay, seconds.
        multiplier: Growth per failure.
        jitter: Fraction of the delay drawn at random (0..1), so retries of a burst spread out.
    """

    max_attempts: int = 5
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 30.0
    multiplier: float = 2.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise BusConfigError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < self.initial_backoff_s:
            raise BusConfigError("backoff must satisfy 0 <= initial_backoff_s <= max_backoff_s")
        if self.multiplier < 1 or not 0 <= self.jitter <= 1:
            raise BusConfigError("multiplier must be >= 1 and jitter within [0, 1]")

    def backoff_s(self, failures: int, rng: random.Random | None = None) -> float:
        """Delay before the next attempt after ``failures`` failed attempts (>= 1)."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** max(0, failures - 1))
        spread = base * self.jitter
        r = (rng or random).random()
        return max(0.0, base - spread + 2 * spread * r)

    def exhausted(self, attempts: int) -> bool:
        """Whether no attempt is left after ``attempts`` tries."""
        return attempts >= self.max_attempts

    @staticmethod
    def prefer(candidates: Iterable[str], tried: set[str]) -> list[str]:
        """Executors to offer a retry to: those that have not failed it first, if any are live."""
        cands = list(candidates)
        fresh = [c for c in cands if c not in tried]
        return fresh or cands


class Retried(Protocol):
    """What the policy of an action depends on (an :class:`~embodied_bus.actions.Action`)."""

    @property
    def kind(self) -> str: ...
    @property
    def retry(self) -> RetryPolicy | None: ...


#: The policy used when none is given.
DEFAULT_RETRY = RetryPolicy()


@dataclass(frozen=True, slots=True)
class RetryPolicies:
    """The retry policies of one queue: per action kind, else the default.

    The queue owns them, so every executor of a queue applies the same policy to a kind: the
    Zenoh queue service's configuration, or policy records in the Pulsar state log (see
    :meth:`~embodied_bus.actions.queue.ActionQueue.set_policy`).

    Attributes:
        default: The policy of kinds without one of their own.
        kinds: Policies by action kind.
    """

    default: RetryPolicy = DEFAULT_RETRY
    kinds: Mapping[str, RetryPolicy] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def of(cls, policy: RetryPolicy | RetryPolicies | None) -> RetryPolicies:
        """``policy`` as policies (one policy: the default of every kind)."""
        if policy is None:
            return cls()
        if isinstance(policy, RetryPolicies):
            return policy
        return cls(policy)

    def for_kind(self, kind: str) -> RetryPolicy:
        """The policy of actions of ``kind``."""
        return self.kinds.get(kind, self.default)

    def for_action(self, action: Retried) -> RetryPolicy:
        """The policy of one action: its own, else its kind's, else the default."""
        return action.retry if action.retry is not None else self.for_kind(action.kind)

    def with_policy(self, policy: RetryPolicy, kind: str | None = None) -> RetryPolicies:
        """These policies with ``policy`` for ``kind`` (None: the default)."""
        if kind is None:
            return replace(self, default=policy)
        return replace(self, kinds=MappingProxyType({**self.kinds, kind: policy}))
