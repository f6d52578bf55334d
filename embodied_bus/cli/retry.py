"""Retry policies on the command line: the queue service's (``embodied-bus queue``) and the
Pulsar queue's policy records (``embodied-bus retry-policy``)."""

from __future__ import annotations

import argparse
import math
from types import MappingProxyType

from embodied_bus.actions import DEFAULT_RETRY, Planner, RetryPolicies, RetryPolicy
from embodied_bus.bus import open_bus
from embodied_bus.cli.common import add_bus_args, add_credential_args, at_least_one, queue_backend
from embodied_bus.errors import BusConfigError

__all__ = [
    "add_retry_args",
    "add_retry_policy_parser",
    "kind_policies",
    "policies_from_args",
    "retry_policy",
    "run_retry_policy",
]


def add_retry_policy_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """The ``retry-policy`` verb."""
    p = sub.add_parser(
        "retry-policy",
        help="Pulsar: set the queue's retry policy, of every kind or of one (a record in its state log)",
    )
    add_bus_args(p)
    add_retry_args(p, defaults=False)
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="how long to wait for the broker (default 30 s)",
    )
    add_credential_args(p)
    p.set_defaults(func=run_retry_policy)


def add_retry_args(p: argparse.ArgumentParser, *, defaults: bool = True) -> None:
    """``--max-attempts``, ``--backoff`` and ``--retry KIND=ATTEMPTS[:BACKOFF_S]``."""
    shown = f" (default {DEFAULT_RETRY.max_attempts})" if defaults else ""
    p.add_argument(
        "--max-attempts",
        type=at_least_one,
        default=DEFAULT_RETRY.max_attempts if defaults else None,
        help=f"tries before dead-lettering, for kinds without a --retry of their own{shown}",
    )
    p.add_argument(
        "--backoff",
        type=float,
        default=DEFAULT_RETRY.initial_backoff_s if defaults else None,
        help="delay after the first failure, seconds (doubles per failure, with jitter)",
    )
    p.add_argument(
        "--retry",
        action="append",
        default=[],
        metavar="KIND=ATTEMPTS[:BACKOFF_S]",
        help="the policy of one action kind (repeat for more kinds)",
    )


def retry_policy(max_attempts: int, backoff_s: float) -> RetryPolicy:
    """The policy the command line means by attempts and a first backoff (s)."""
    return RetryPolicy(
        max_attempts=max_attempts,
        initial_backoff_s=backoff_s,
        max_backoff_s=max(backoff_s, DEFAULT_RETRY.max_backoff_s),
        jitter=DEFAULT_RETRY.jitter if backoff_s else 0.0,
    )


def kind_policies(args: argparse.Namespace) -> dict[str, RetryPolicy]:
    """``--retry KIND=ATTEMPTS[:BACKOFF_S]`` options by kind."""
    out: dict[str, RetryPolicy] = {}
    for item in args.retry:
        kind, _, spec = item.partition("=")
        attempts, _, backoff = spec.partition(":")
        try:
            policy = retry_policy(
                int(attempts), float(backoff) if backoff else DEFAULT_RETRY.initial_backoff_s
            )
        except ValueError as err:
            raise BusConfigError(f"--retry {item!r}: expected KIND=ATTEMPTS[:BACKOFF_S] ({err})") from err
        if not kind:
            raise BusConfigError(f"--retry {item!r}: expected KIND=ATTEMPTS[:BACKOFF_S]")
        out[kind] = policy
    return out


def policies_from_args(args: argparse.Namespace) -> RetryPolicies:
    """The queue service's policies from its command line."""
    default = retry_policy(args.max_attempts, args.backoff)
    return RetryPolicies(default, MappingProxyType(kind_policies(args)))


async def run_retry_policy(args: argparse.Namespace) -> int:
    kinds = kind_policies(args)
    given = args.max_attempts is not None or args.backoff is not None
    if not given and not kinds:
        raise BusConfigError("give --max-attempts/--backoff (every kind) or --retry KIND=ATTEMPTS")
    wait_s = math.inf if args.connect_timeout is None else float(args.connect_timeout)
    backend = queue_backend(args)
    async with (
        open_bus(args.bus, namespace=args.ns, wait_s=wait_s) as bus,
        Planner(bus, connect_timeout_s=wait_s, backend=backend) as planner,
    ):
        if given:
            default = retry_policy(
                args.max_attempts or DEFAULT_RETRY.max_attempts,
                DEFAULT_RETRY.initial_backoff_s if args.backoff is None else args.backoff,
            )
            await planner.set_policy(default)
            print(f"every kind: {default}")
        for kind, policy in kinds.items():
            await planner.set_policy(policy, kind)
            print(f"{kind}: {policy}")
    return 0
