"""Frames computed offline, with every sample known: what the online assembler must give when
nothing is forced out by the lateness bound.

This is the definition of the fusion semantics written as plainly as possible (sorted lists,
no incremental state), used to check the online :class:`~embodied_bus.fusion.assembler.Assembler`
and to compare re-fused recordings by digest. Each reference sample anchors one frame; lost
reference samples are judged from the stream's own cadence (:mod:`embodied_bus.fusion.cadence`);
picks are relative to the anchor's stamp; the windows of ``all`` / ``latest`` streams tile
time, so every sample of such a stream is in exactly one frame (between the first and the last
anchor).
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass

from embodied_bus.fusion.cadence import Cadence, lost_anchors
from embodied_bus.fusion.frame import MultiModalFrame
from embodied_bus.fusion.spec import FusionSpec, Pick, StreamSpec, Window
from embodied_bus.model.sample import Sample

__all__ = ["FrameRecord", "MemberKey", "digest", "frame_record", "offline_frames"]


@dataclass(frozen=True, slots=True, order=True)
class MemberKey:
    """A sample taken into a frame, by identity: its stamp (clock offset applied) and sequence
    number (publisher ids are random per process, so they are left out)."""

    stamp_ns: int
    seq: int


@dataclass(frozen=True, slots=True)
class FrameRecord:
    """What a frame took: its reference stamp (a lost reference: where it was due) and the
    members of each stream (empty streams left out)."""

    reference_stamp_ns: int
    members: dict[str, tuple[MemberKey, ...]]

    def as_json(self) -> list[object]:
        """A canonical JSON-able form (for digests and diffs)."""
        return [
            self.reference_stamp_ns,
            {name: [[m.stamp_ns, m.seq] for m in ms] for name, ms in sorted(self.members.items())},
        ]


def frame_record(frame: MultiModalFrame) -> FrameRecord:
    """The :class:`FrameRecord` of a frame made online."""
    return FrameRecord(
        frame.reference_stamp_ns,
        {
            name: tuple(MemberKey(m.stamp_ns, m.sample.header.seq) for m in ms)
            for name, ms in frame.members.items()
            if ms
        },
    )


def digest(records: Iterable[FrameRecord]) -> str:
    """SHA-256 over the records in reference-stamp order: equal for the same frames."""
    h = hashlib.sha256()
    for r in sorted(records, key=lambda r: r.reference_stamp_ns):
        h.update(json.dumps(r.as_json(), separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class _Anchor:
    stamp_ns: int
    key: MemberKey | None
    period_ns: int
    first: bool  # starts a segment (no previous anchor)


def _stamp(sample: Sample, spec: StreamSpec) -> int:
    return (sample.header.stamp_ns or sample.receive_ns) + spec.clock_offset_ns


def _by_stream(spec: FusionSpec, samples: Iterable[Sample]) -> dict[str, list[MemberKey]]:
    """Each input stream's samples, de-duplicated and in stamp order."""
    out: dict[str, list[MemberKey]] = {s.name: [] for s in spec.streams}
    seen: set[tuple[str, int, int]] = set()
    for sample in samples:
        h = sample.header
        st = spec.stream(h.stream)
        if st is None or (h.stream, h.publisher_id, h.seq) in seen:
            continue
        seen.add((h.stream, h.publisher_id, h.seq))
        out[st.name].append(MemberKey(_stamp(sample, st), h.seq))
    for keys in out.values():
        keys.sort(key=lambda k: k.stamp_ns)  # stable: equal stamps keep their arrival order
    return out


def _anchors(spec: FusionSpec, refs: list[MemberKey]) -> list[_Anchor]:
    """Every reference sample, and one anchor per sample the reference lost."""
    cadence = Cadence(spec.reference_period_ns)
    out: list[_Anchor] = []
    prev: int | None = None
    for key in refs:
        t = key.stamp_ns
        if prev is not None and t == prev:
            continue  # a second sample with the same stamp anchors nothing
        first = prev is None or t - prev > spec.jump_ns
        if first:
            cadence.reset()
        else:
            assert prev is not None
            period = cadence.period_ns
            out.extend(_Anchor(lost, None, period, False) for lost in lost_anchors(prev, t, period))
        cadence.observe(t)
        out.append(_Anchor(t, key, cadence.period_ns, first))
        prev = t
    return out


def _window(a: _Anchor, lo: int | None, window: Window) -> tuple[int, int]:
    """[lo, hi) of an anchor's window; ``lo`` is the previous window's end (None: the first of
    a segment). It ends just past the anchor (before), or a learned period (after) or half of
    one (around) past it."""
    t, p = a.stamp_ns, a.period_ns
    if window is Window.BEFORE:
        return (t - p + 1 if lo is None else lo), t + 1
    if window is Window.AFTER:
        return (t if lo is None else lo), t + p
    return (t - p // 2 if lo is None else lo), t + p // 2


def _between(keys: list[MemberKey], stamps: list[int], lo: int, hi: int) -> list[MemberKey]:
    """Keys with lo <= stamp < hi."""
    return keys[bisect.bisect_left(stamps, lo) : bisect.bisect_left(stamps, hi)]


def _pick(
    spec: FusionSpec, st: StreamSpec, keys: list[MemberKey], stamps: list[int], t: int
) -> list[MemberKey]:
    if st.pick is Pick.NEAREST:
        skew = spec.skew_ns(st)
        cands = _between(keys, stamps, t - skew, t + skew + 1)
        return [min(cands, key=lambda k: (abs(k.stamp_ns - t), k.stamp_ns))] if cands else []
    if st.pick is Pick.HOLD_LAST:
        return _between(keys, stamps, t - spec.age_ns(st), t + 1)[-1:]
    skew = spec.skew_ns(st)  # INTERPOLATE
    before = _between(keys, stamps, t - skew, t + 1)[-1:]
    after = _between(keys, stamps, t + 1, t + skew + 1)[:1]
    return before + after


def offline_frames(spec: FusionSpec, samples: Iterable[Sample]) -> list[FrameRecord]:
    """The frames of ``samples`` (any order) under ``spec``, as if no stream were ever late."""
    streams = _by_stream(spec, samples)
    ref = spec.reference
    anchors = _anchors(spec, streams[ref.name])
    stamps = {name: [k.stamp_ns for k in keys] for name, keys in streams.items()}
    lows: dict[str, int | None] = {}
    out: list[FrameRecord] = []
    for a in anchors:
        members: dict[str, tuple[MemberKey, ...]] = {}
        if a.key is not None:
            members[ref.name] = (a.key,)
        for st in spec.streams:
            if st is ref:
                continue
            keys = streams[st.name]
            if st.window is not None:
                lo, hi = _window(a, None if a.first else lows.get(st.name), st.window)
                lows[st.name] = hi
                got = _between(keys, stamps[st.name], lo, hi)
                picked = got[-1:] if st.pick is Pick.LATEST else got
            else:
                picked = _pick(spec, st, keys, stamps[st.name], a.stamp_ns)
            if picked:
                members[st.name] = tuple(picked)
        out.append(FrameRecord(a.stamp_ns, members))
    return out
