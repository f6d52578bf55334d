"""Retry policy: how long to wait before the next attempt, when to give up, and where to retry."""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

from embodied_bus.errors import BusConfigError

__all__ = ["DEFAULT_RETRY", "PermanentFailure", "RetryPolicy"]


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


#: The policy used when none is given.
DEFAULT_RETRY = RetryPolicy()
