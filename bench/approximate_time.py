"""message_filters' ApproximateTime policy, re-implemented in Python for the fusion benchmark.

A faithful port of the published algorithm of ROS 2 message_filters
(``include/message_filters/sync_policies/approximate_time.hpp``, BSD-3-Clause, Willow Garage;
described on the ROS wiki page message_filters/ApproximateTime): one deque per topic; when every
deque holds a message, the topic with the latest head is the *pivot*; heads are moved past,
oldest first, while a candidate set of smaller span (with an age penalty, 0.1 as in the code)
may still be found; a set is published when the pivot becomes the oldest head, when it is
provably optimal, or when the topics' inter-message lower bounds prove it. A topic whose deque
and past messages exceed the queue size drops its oldest message (silently: the policy has no
drop callback). Each message is used at most once; a set needs one message of every topic.

``test/test_approximate_time.py`` runs the upstream test cases
(``test/test_approximate_time_policy.cpp``) against this port.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["ApproximateTime"]

#: (stamp ns, message) as the policy queues them.
Event = tuple[int, Any]


class ApproximateTime:
    """The ApproximateTime synchronization policy over ``topics`` inputs.

    Args:
        topics: Number of inputs.
        queue_size: Messages kept per topic (queued and passed over together).
        on_set: Called with one event ``(stamp_ns, message)`` per topic for every set.
        age_penalty: Weight of a later candidate's age (message_filters' code uses 0.1).
        max_interval_ns: Longest span of a set (default: unbounded).
        lower_bounds_ns: Per topic, the least time between two of its messages (default 0).
    """

    def __init__(
        self,
        topics: int,
        queue_size: int,
        on_set: Callable[[list[Event]], None],
        *,
        age_penalty: float = 0.1,
        max_interval_ns: int | None = None,
        lower_bounds_ns: Sequence[int] | None = None,
    ) -> None:
        if queue_size < 1:
            raise ValueError("queue_size must be >= 1")
        self.n = topics
        self.queue_size = queue_size
        self.on_set = on_set
        self.age_penalty = age_penalty
        self.max_interval_ns = max_interval_ns
        self.lower_bounds_ns = list(lower_bounds_ns or [0] * topics)
        self.deques: list[deque[Event]] = [deque() for _ in range(topics)]
        self.past: list[list[Event]] = [[] for _ in range(topics)]
        self.non_empty = 0
        self.pivot: int | None = None
        self.pivot_ns = 0
        self.candidate: list[Event] | None = None
        self.candidate_start_ns = 0
        self.candidate_end_ns = 0
        self.has_dropped = [False] * topics
        #: Messages dropped because a topic's queue was full (the policy reports none).
        self.dropped = 0

    def add(self, topic: int, stamp_ns: int, message: Any = None) -> None:
        """One message of ``topic`` (messages of one topic in stamp order)."""
        q = self.deques[topic]
        q.append((stamp_ns, message))
        if len(q) == 1:
            self.non_empty += 1
            if self.non_empty == self.n:
                self._process()
        if len(q) + len(self.past[topic]) > self.queue_size:
            self.non_empty = 0
            self._recover_all()
            q.popleft()
            self.dropped += 1
            self.has_dropped[topic] = True
            if self.pivot is not None:
                self.candidate, self.pivot = None, None
                self._process()

    # ------------------------------------------------------------------ moves between deque and past
    def _delete_front(self, i: int) -> None:
        q = self.deques[i]
        q.popleft()
        if not q:
            self.non_empty -= 1

    def _move_front_to_past(self, i: int) -> None:
        q = self.deques[i]
        self.past[i].append(q.popleft())
        if not q:
            self.non_empty -= 1

    def _recover(self, i: int, count: int | None = None) -> None:
        """Put back the last ``count`` (all) messages moved past on topic ``i``."""
        v, q = self.past[i], self.deques[i]
        take = len(v) if count is None else count
        for _ in range(take):
            q.appendleft(v.pop())
        if q:
            self.non_empty += 1

    def _recover_all(self, counts: Sequence[int] | None = None) -> None:
        for i in range(self.n):
            self._recover(i, None if counts is None else counts[i])

    def _make_candidate(self) -> None:
        self.candidate = [q[0] for q in self.deques]
        for v in self.past:
            v.clear()

    def _publish_candidate(self) -> None:
        assert self.candidate is not None
        chosen = self.candidate
        self.candidate, self.pivot = None, None
        self.non_empty = 0
        for i in range(self.n):  # put back what was passed over, drop the published message
            v, q = self.past[i], self.deques[i]
            while v:
                q.appendleft(v.pop())
            q.popleft()
            if q:
                self.non_empty += 1
        self.on_set(chosen)

    # ------------------------------------------------------------------ boundaries
    @staticmethod
    def _boundary(times: Sequence[int], latest: bool) -> tuple[int, int]:
        """(index, time) of the latest (ties: the last topic) or earliest (ties: the first) time."""
        index, t = 0, times[0]
        for i, ti in enumerate(times):
            if (ti < t) != latest:
                index, t = i, ti
        return index, t

    def _heads(self) -> list[int]:
        return [q[0][0] for q in self.deques]

    def _virtual_times(self) -> list[int]:
        """Each topic's head, or for an exhausted topic the earliest its next message can be."""
        out = []
        for i, q in enumerate(self.deques):
            if q:
                out.append(q[0][0])
            else:
                bound = self.past[i][-1][0] + self.lower_bounds_ns[i]
                out.append(max(bound, self.pivot_ns))
        return out

    def _worse(self, end_ns: int) -> float:
        return (end_ns - self.candidate_end_ns) * (1 + self.age_penalty)

    # ------------------------------------------------------------------ the search
    def _process(self) -> None:
        while self.non_empty == self.n:
            heads = self._heads()
            end_i, end_ns = self._boundary(heads, latest=True)
            start_i, start_ns = self._boundary(heads, latest=False)
            for i in range(self.n):
                if i != end_i:
                    self.has_dropped[i] = False
            if self.pivot is None:
                too_long = self.max_interval_ns is not None and end_ns - start_ns > self.max_interval_ns
                if too_long or self.has_dropped[end_i]:
                    self._delete_front(start_i)
                    continue
                self._make_candidate()
                self.candidate_start_ns, self.candidate_end_ns = start_ns, end_ns
                self.pivot, self.pivot_ns = end_i, end_ns
                self._move_front_to_past(start_i)
            elif self._worse(end_ns) >= start_ns - self.candidate_start_ns:
                self._move_front_to_past(start_i)  # not better than the candidate
            else:
                self._make_candidate()  # better: same pivot
                self.candidate_start_ns, self.candidate_end_ns = start_ns, end_ns
                self._move_front_to_past(start_i)
            if start_i == self.pivot:
                self._publish_candidate()  # every candidate of this pivot was seen
            elif self._worse(end_ns) >= self.pivot_ns - self.candidate_start_ns:
                self._publish_candidate()  # provably optimal already
            elif self.non_empty < self.n:
                self._virtual_search()

    def _virtual_search(self) -> None:
        """Use the inter-message lower bounds to try to prove the candidate optimal."""
        moves = [0] * self.n
        while True:
            times = self._virtual_times()
            _, end_ns = self._boundary(times, latest=True)
            start_i, start_ns = self._boundary(times, latest=False)
            if self._worse(end_ns) >= self.pivot_ns - self.candidate_start_ns:
                self._publish_candidate()
                return
            if self._worse(end_ns) < start_ns - self.candidate_start_ns:
                self.non_empty = 0  # a better candidate may still come: undo the virtual moves
                self._recover_all(moves)
                return
            self._move_front_to_past(start_i)
            moves[start_i] += 1
