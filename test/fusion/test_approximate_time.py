"""The benchmark's port of message_filters' ApproximateTime reproduces the upstream test cases
(ros2/message_filters ``test/test_approximate_time_policy.cpp``): inputs as (time s, topic),
expected sets as the stamps of each topic."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from approximate_time import ApproximateTime

S = 1_000_000_000
A, B, C, D = 0, 1, 2, 3


def run(
    inputs: list[tuple[float, int]], topics: int, queue_size: int, **kw: object
) -> list[tuple[float, ...]]:
    sets: list[tuple[float, ...]] = []
    sync = ApproximateTime(topics, queue_size, lambda s: sets.append(tuple(t / S for t, _ in s)), **kw)  # type: ignore[arg-type]
    for t, topic in inputs:
        sync.add(topic, int(t * S))
    return sets


CASES = {
    "exact_match": ([(0, A), (0, B), (3, A), (3, B), (6, A), (6, B)], 10, [(0, 0), (3, 3), (6, 6)]),
    "perfect_match": ([(0, A), (1, B), (3, A), (4, B), (6, A), (7, B)], 10, [(0, 1), (3, 4)]),
    "imperfect_match": ([(0, A), (1, B), (2, A), (3, A), (5, B), (6, A), (7, B)], 10, [(0, 1), (6, 5)]),
    "acceleration": ([(0, A), (7, B), (12, A), (15, B), (17, A), (18, B)], 10, [(12, 7), (17, 18)]),
    "dropped_messages_queue_1": (
        [(0, A), (1, B), (3, B), (4, A), (7, B), (8, A), (10, A), (11, B), (13, A), (14, B)], 1,
        [(4, 3), (10, 11)],
    ),
    "dropped_messages_queue_2": (
        [(0, A), (1, B), (3, B), (4, A), (7, B), (8, A), (10, A), (11, B), (13, A), (14, B)], 2,
        [(0, 1), (4, 3), (8, 7), (10, 11)],
    ),
    "long_queue": (
        [*[(t, A) for t in range(9)], (3, B), (9, A), (10, A), (11, A), (12, A), (10, B), (13, A)], 5,
        [(10, 10)],
    ),
    "double_publish": ([(0, A), (1, B), (3, B), (3, A)], 10, [(0, 1), (3, 3)]),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_two_topic_cases_give_the_upstream_sets(name: str) -> None:
    inputs, queue, expected = CASES[name]
    assert run(inputs, 2, queue) == [tuple(float(x) for x in s) for s in expected]


def test_four_topics_give_the_upstream_sets() -> None:
    inputs = [(0, A), (1, B), (2, C), (3, D), (5, A), (5, D), (6, B), (6, C), (8, A), (9, B),
              (10, C), (11, D), (10, A), (13, A), (14, B)]  # fmt: skip
    assert run(inputs, 4, 10) == [(0, 1, 2, 3), (5, 6, 6, 5), (10, 9, 10, 11)]


def test_an_early_publish_needs_only_the_pivot_to_pass() -> None:
    assert run([(0, A), (1, B), (2, C), (3, D), (7, A)], 4, 10) == [(0, 1, 2, 3)]


@pytest.mark.parametrize(("bound_s", "expected"), [(1.5, [(0, 1), (3, 4)]), (2.0, [(0, 1), (3, 4), (6, 7)])])
def test_a_rate_bound_proves_sets_optimal_earlier(bound_s: float, expected: list[tuple[int, int]]) -> None:
    inputs: list[tuple[float, int]] = [(0, A), (1, B), (3, A), (4, B), (6, A), (7, B)]
    got = run(inputs, 2, 10, lower_bounds_ns=[int(bound_s * S), 0])
    assert got == [tuple(float(x) for x in s) for s in expected]
