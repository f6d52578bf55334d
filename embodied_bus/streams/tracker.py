"""Per-publisher sequence tracking: gaps, duplicates and out-of-order samples."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["MAX_TRACKED_MISSING", "SequenceTracker", "Verdict"]

#: How many missing sequence numbers per publisher are remembered to recognise late arrivals
#: (and how many arrivals from before the first sample seen, to recognise their duplicates).
MAX_TRACKED_MISSING = 4096


class Verdict(enum.Enum):
    """How a sample's sequence number relates to what came before from its publisher."""

    IN_ORDER = "in_order"
    #: In order, but one or more earlier sequence numbers were skipped.
    GAP = "gap"
    #: Arrived after a later one: a number that had been counted missing, or one from before
    #: the first sample seen of its publisher (a Pulsar redelivery after a later fresh sample,
    #: or a late sample behind the point where the subscription joined).
    OUT_OF_ORDER = "out_of_order"
    #: Received before: not delivered again. A number whose fate is no longer remembered (older
    #: than :data:`MAX_TRACKED_MISSING` tracked gaps) is delivered as out of order instead:
    #: a rare repeat beats a silent loss.
    DUPLICATE = "duplicate"


@dataclass(slots=True)
class _PublisherState:
    last_seq: int
    #: Below this, what arrived is not known from ``missing`` (the first sample seen, raised
    #: past missing numbers that had to be forgotten); arrivals down there are kept in ``early``.
    floor: int
    missing: set[int] = field(default_factory=set)
    early: set[int] = field(default_factory=set)


@dataclass(slots=True)
class SequenceTracker:
    """Classifies sequence numbers per publisher and counts anomalies.

    Attributes:
        gaps: Number of gap events (a jump forward over at least one number).
        missing: Sequence numbers skipped and not (yet) received.
        out_of_order: Samples that arrived after a later one of the same publisher.
        duplicates: Samples whose sequence number had already been received.
    """

    gaps: int = 0
    missing: int = 0
    out_of_order: int = 0
    duplicates: int = 0
    _pubs: dict[int, _PublisherState] = field(default_factory=dict)

    def observe(self, publisher_id: int, seq: int) -> Verdict:
        """Record one sample and return its verdict."""
        st = self._pubs.get(publisher_id)
        if st is None:
            # First sample seen from this publisher: joining mid-stream is not a gap.
            self._pubs[publisher_id] = _PublisherState(seq, seq)
            return Verdict.IN_ORDER
        last = st.last_seq
        if seq == last + 1:
            st.last_seq = seq
            return Verdict.IN_ORDER
        if seq > last:
            skipped = seq - last - 1
            self.gaps += 1
            self.missing += skipped
            if skipped <= MAX_TRACKED_MISSING:
                st.missing.update(range(last + 1, seq))
                if len(st.missing) > MAX_TRACKED_MISSING:
                    forgotten = sorted(st.missing)[: len(st.missing) - MAX_TRACKED_MISSING]
                    st.missing.difference_update(forgotten)
                    st.floor = max(st.floor, forgotten[-1] + 1)
            else:  # too many to remember: nothing below this sample is known any more
                st.floor = seq
            st.last_seq = seq
            return Verdict.GAP
        if seq in st.missing:
            st.missing.discard(seq)
            self.missing -= 1
            self.out_of_order += 1
            return Verdict.OUT_OF_ORDER
        if seq < st.floor and seq not in st.early:
            st.early.add(seq)
            if len(st.early) > MAX_TRACKED_MISSING:
                st.early.discard(min(st.early))
            self.out_of_order += 1
            return Verdict.OUT_OF_ORDER
        self.duplicates += 1
        return Verdict.DUPLICATE

    def advance_run(self, publisher_id: int, first_seq: int, last_seq: int) -> bool:
        """Record ``first_seq`` .. ``last_seq`` (consecutive) of a publisher as :meth:`observe`
        would one by one, if ``first_seq`` comes after everything seen from it (a first
        sample, in order, or a gap); else change nothing and return False."""
        st = self._pubs.get(publisher_id)
        if st is None:
            self._pubs[publisher_id] = _PublisherState(last_seq, first_seq)
            return True
        last = st.last_seq
        if first_seq <= last:
            return False
        if first_seq > last + 1:
            self.observe(publisher_id, first_seq)  # the gap, counted and remembered
        st.last_seq = last_seq
        return True

    @property
    def publishers(self) -> int:
        """Number of distinct publishers seen."""
        return len(self._pubs)
