"""Fusion specs: which streams make a frame, and how each one is picked. Loaded from YAML.

Example (``config/fusion.yaml``)::

    fusion:
      bucket_width_ms: 100        # the routing unit: a worker owns whole buckets
      bucket_offset_ms: 50
      lateness_ms: 120            # give a silent stream up this long (event time) past a frame
      incomplete: emit            # emit partial frames with a missing mask, or "drop"
      late_panes: false           # also emit late samples as a late pane of their frame
      streams:
        lidar/top:    {role: reference, expected_period_ms: 100}   # one frame per sweep
        camera/front: {role: required, pick: nearest, max_skew_ms: 40}
        gps:          {role: optional, pick: hold_last, max_age_ms: 500}
        imu:          {role: optional, pick: all, window: around}

Every sample of the reference stream anchors one frame, whatever its phase in the bucket; the
other streams are picked relative to its stamp.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import yaml

from embodied_bus.errors import BusConfigError
from embodied_bus.model.clock import BucketClock
from embodied_bus.model.documents import convert_document
from embodied_bus.model.header import validate_stream_name

__all__ = [
    "DEFAULT_LATENESS_NS",
    "FusionSpec",
    "Incomplete",
    "Pick",
    "Role",
    "SpecDocument",
    "SpecError",
    "StreamDocument",
    "StreamSpec",
    "Window",
    "load_spec",
    "spec_from_dict",
]

#: Default lateness bound: 120 ms of event time past the furthest reach of a frame's picks.
DEFAULT_LATENESS_NS = 120_000_000
#: A stamp moving this far from a stream's last stamp is reported as a jump (2 s); a jump
#: backwards restarts the stream (the reference: the whole assembler).
DEFAULT_JUMP_NS = 2_000_000_000

#: Keys of older specs, refused with what to do instead.
_REMOVED_KEYS = {
    "lookahead": "decisions wait for the stream's own next sample, never for a guess from "
    "expected_period_ms; delete the key",
    "complete_by_count": "an `all` stream is decided once a sample past its window arrived, "
    "never by counting samples; delete the key",
}


class SpecError(BusConfigError):
    """A fusion spec is invalid; the message names the key (e.g. ``streams.camera.max_skew_ms``)."""


class Role(str, enum.Enum):
    """How a stream counts toward completeness."""

    #: Each of its samples anchors one frame; exactly one per spec.
    REFERENCE = "reference"
    #: Missing makes the frame incomplete.
    REQUIRED = "required"
    #: Attached when present; never makes a frame incomplete.
    OPTIONAL = "optional"


class Pick(str, enum.Enum):
    """Which samples of a stream a frame takes, relative to its reference stamp."""

    #: The sample nearest to the reference stamp, within ``max_skew``.
    NEAREST = "nearest"
    #: The last sample of the frame's window (see :class:`Window`).
    LATEST = "latest"
    #: Every sample of the frame's window: each sample lands in exactly one frame.
    ALL = "all"
    #: The last sample at or before the reference stamp, at most ``max_age`` old.
    HOLD_LAST = "hold_last"
    #: The samples just before and after the reference stamp, for linear interpolation.
    INTERPOLATE = "interpolate"


class Window(str, enum.Enum):
    """The part of time an ``all`` or ``latest`` stream gives each frame. The windows of
    consecutive reference samples tile time: every sample falls in exactly one."""

    #: Since the previous reference sample (exclusive) up to this one (inclusive): a sweep
    #: stamped at its end.
    BEFORE = "before"
    #: From this reference sample (inclusive) up to the next (exclusive): a sweep stamped at
    #: its start.
    AFTER = "after"
    #: Between the midpoints to the previous and the next reference sample.
    AROUND = "around"


class Incomplete(str, enum.Enum):
    """What to do with a frame whose reference or a required stream is missing."""

    EMIT = "emit"
    DROP = "drop"


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """One input stream of a fusion spec.

    Attributes:
        name: Stream name.
        role: Reference, required or optional.
        pick: Pick policy (the reference: None, its samples are the anchors).
        expected_period_ns: Nominal sample period, a hint only: the reference's real cadence
            is learned from its stamps (this is used until enough are seen); elsewhere None.
        max_skew_ns: Largest |member stamp - reference stamp| accepted (NEAREST, INTERPOLATE;
            None = half a bucket).
        max_age_ns: Largest age of a HOLD_LAST sample (None = one bucket).
        clock_offset_ns: Added to this stream's stamps before anything else (sensor clock
            correction, e.g. a camera 20 ms ahead → -20 ms).
        window: Which samples an ALL / LATEST stream gives each frame (None for other picks).
        max_delay_ns: Longest a sample of this stream arrives after its stamp, measured in
            event time (the furthest stamp seen on any stream). Past it, a sample that has not
            come is taken as lost, so a lost GPS fix does not hold frames back until the
            lateness bound (it is counted late if it still comes). None: the stream's own next
            sample decides.
    """

    name: str
    role: Role
    pick: Pick | None
    expected_period_ns: int | None = None
    max_skew_ns: int | None = None
    max_age_ns: int | None = None
    clock_offset_ns: int = 0
    window: Window | None = None
    max_delay_ns: int | None = None


@dataclass(frozen=True, slots=True)
class FusionSpec:
    """A validated fusion spec (build with :func:`load_spec` or :func:`spec_from_dict`).

    Attributes:
        clock: Bucket width and phase: the routing and ownership unit of scale-out.
        streams: Input streams; exactly one has role REFERENCE.
        lateness_ns: Event time past the furthest reach of a frame's picks after which a
            stream that has sent nothing for it is given up.
        incomplete: Emit or drop incomplete frames.
        late_panes: Emit late samples as late panes of their frame.
        jump_ns: Stamp jump threshold for a stream.
        name: Pipeline name (frames go to ``frames/<name>``).
    """

    clock: BucketClock
    streams: tuple[StreamSpec, ...]
    lateness_ns: int = DEFAULT_LATENESS_NS
    incomplete: Incomplete = Incomplete.EMIT
    late_panes: bool = False
    jump_ns: int = DEFAULT_JUMP_NS
    name: str = "fused"

    @property
    def reference(self) -> StreamSpec:
        """The reference stream."""
        return next(s for s in self.streams if s.role is Role.REFERENCE)

    @property
    def reference_period_ns(self) -> int:
        """The reference's expected period (a hint until its cadence is learned)."""
        period = self.reference.expected_period_ns
        assert period is not None  # required of the reference by the loader
        return period

    def stream(self, name: str) -> StreamSpec | None:
        """The spec of a stream, or None if it is not an input."""
        for s in self.streams:
            if s.name == name:
                return s
        return None

    def skew_ns(self, s: StreamSpec) -> int:
        """Effective max skew of a stream."""
        return s.max_skew_ns if s.max_skew_ns is not None else self.clock.width_ns // 2

    def age_ns(self, s: StreamSpec) -> int:
        """Effective max age of a HOLD_LAST stream."""
        return s.max_age_ns if s.max_age_ns is not None else self.clock.width_ns


def _ms(where: str, value: float, *, allow_zero: bool = False, signed: bool = False) -> int:
    """Milliseconds as nanoseconds, checked for sign."""
    ns = round(value * 1_000_000)
    if not signed and (ns < 0 or (ns == 0 and not allow_zero)):
        raise SpecError(f"{where}: must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return ns


class StreamDocument(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One input of a spec document (``fusion.streams.<name>``); times in milliseconds.

    Attributes:
        role: ``reference`` (exactly one: each of its samples anchors a frame), ``required`` or
            ``optional``.
        pick: ``nearest``, ``latest``, ``all``, ``hold_last`` or ``interpolate``; not on the
            reference (none: ``nearest``).
        window: ``all`` / ``latest`` picks: ``before`` (since the previous sweep), ``after`` (a
            learned period on) or ``around`` (half a period either side; the default).
        expected_period_ms: The reference's nominal period, used until its cadence is learned
            (required of the reference; other streams need none).
        max_skew_ms: ``nearest``, ``interpolate``: the farthest a pick may be from the reference
            stamp (none: half a bucket).
        max_age_ms: ``hold_last``: the oldest a held sample may be (none: one bucket).
        clock_offset_ms: Added to this stream's stamps (a sensor clock known to be off).
        max_delay_ms: A stream silent this long while the others moved this far past its last
            sample is taken to have lost what it owes (none: the lateness bound).
    """

    role: Role
    pick: Pick | None = None
    window: Window | None = None
    expected_period_ms: float | None = None
    max_skew_ms: float | None = None
    max_age_ms: float | None = None
    clock_offset_ms: float = 0.0
    max_delay_ms: float | None = None

    def to_spec(self, name: str, where: str) -> StreamSpec:
        """The stream's :class:`StreamSpec`.

        Raises:
            SpecError: A value out of range or a key that does not apply (named).
        """
        pick = self._pick(where)
        if self.window is not None and pick not in (Pick.ALL, Pick.LATEST):
            raise SpecError(
                f"{where}.window: only `all` and `latest` picks take a window, not "
                f"{'the reference' if pick is None else repr(pick.value)}"
            )
        if self.role is Role.REFERENCE and self.expected_period_ms is None:
            raise SpecError(
                f"{where}.expected_period_ms: missing; the reference needs its nominal period "
                "(a hint for telling a lost sample from a slow one until its cadence is learned)"
            )
        period, skew, age, delay = (
            self.expected_period_ms,
            self.max_skew_ms,
            self.max_age_ms,
            self.max_delay_ms,
        )
        return StreamSpec(
            name=name,
            role=self.role,
            pick=pick,
            expected_period_ns=None if period is None else _ms(f"{where}.expected_period_ms", period),
            max_skew_ns=None if skew is None else _ms(f"{where}.max_skew_ms", skew, allow_zero=True),
            max_age_ns=None if age is None else _ms(f"{where}.max_age_ms", age),
            clock_offset_ns=_ms(f"{where}.clock_offset_ms", self.clock_offset_ms, signed=True),
            window=(self.window or Window.AROUND) if pick in (Pick.ALL, Pick.LATEST) else None,
            max_delay_ns=None if delay is None else _ms(f"{where}.max_delay_ms", delay),
        )

    def _pick(self, where: str) -> Pick | None:
        if self.role is not Role.REFERENCE:
            return self.pick or Pick.NEAREST
        if self.pick is not None:
            raise SpecError(
                f"{where}.pick: the reference takes no pick: each of its samples anchors one "
                f"frame (a bucket holding two sweeps gives two frames); delete "
                f"`pick: {self.pick.value}`"
            )
        return None


class SpecDocument(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A fusion spec as written in YAML (the value under ``fusion:``); times in milliseconds.

    Attributes:
        streams: Each input by stream name (its keys in the next table).
        bucket_width_ms: The bucket clock's width (the routing key); a worker refuses samples
            bucketed with another clock.
        bucket_offset_ms: Where bucket boundaries fall, past a multiple of the width.
        lateness_ms: A stream is given up for a frame once the other streams are this far (event
            time) past what the frame needs from it and it has been silent this long.
        incomplete: ``emit`` partial frames with a missing mask, or ``drop`` them.
        late_panes: Also emit late samples as late panes of their frame.
        jump_ms: A stamp moving this far is reported as a jump (backwards: a restart).
        name: Frames go to the stream ``frames/<name>``.
    """

    streams: dict[str, Any]
    bucket_width_ms: float = 100.0
    bucket_offset_ms: float = 0.0
    lateness_ms: float = DEFAULT_LATENESS_NS / 1e6
    incomplete: Incomplete = Incomplete.EMIT
    late_panes: bool = False
    jump_ms: float = DEFAULT_JUMP_NS / 1e6
    name: str = "fused"


def _refuse_removed(opts: Any, where: str) -> None:
    """Refuse keys of older specs by name, saying what to do instead."""
    if isinstance(opts, Mapping):
        for key, fix in _REMOVED_KEYS.items():
            if key in opts:
                raise SpecError(f"{where}.{key}: no longer a fusion key: {fix}")


def _name(where: str, name: Any) -> str:
    try:
        return validate_stream_name(str(name))
    except ValueError as err:
        raise SpecError(f"{where}: {err}") from None


def spec_from_dict(doc: Mapping[str, Any], *, where: str = "fusion") -> FusionSpec:
    """Validate a spec mapping (the value under ``fusion:``) and build a :class:`FusionSpec`.

    Raises:
        SpecError: The message names the offending key.
    """
    d = convert_document(doc, SpecDocument, where, SpecError)
    width = _ms(f"{where}.bucket_width_ms", d.bucket_width_ms)
    offset = _ms(f"{where}.bucket_offset_ms", d.bucket_offset_ms, allow_zero=True)
    if offset >= width:
        raise SpecError(f"{where}.bucket_offset_ms: must be smaller than bucket_width_ms")
    if not d.streams:
        raise SpecError(f"{where}.streams: expected a non-empty mapping of stream name to options")
    streams = []
    for name, opts in d.streams.items():
        w = f"{where}.streams.{name}"
        _refuse_removed(opts, w)
        stream = convert_document(opts, StreamDocument, w, SpecError)
        streams.append(stream.to_spec(_name(w, name), w))
    refs = [s.name for s in streams if s.role is Role.REFERENCE]
    if len(refs) != 1:
        raise SpecError(f"{where}.streams: exactly one stream must have role: reference, found {refs}")
    return FusionSpec(
        clock=BucketClock(width_ns=width, offset_ns=offset),
        streams=tuple(streams),
        lateness_ns=_ms(f"{where}.lateness_ms", d.lateness_ms, allow_zero=True),
        incomplete=d.incomplete,
        late_panes=d.late_panes,
        jump_ns=_ms(f"{where}.jump_ms", d.jump_ms),
        name=_name(f"{where}.name", d.name),
    )


def load_spec(path: str | Path) -> FusionSpec:
    """Load a spec from a YAML file: either the spec itself or a document with a ``fusion:`` key.

    Raises:
        SpecError: The file cannot be read or parsed, or the spec is invalid.
    """
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except OSError as err:
        raise SpecError(f"cannot read fusion spec {str(path)!r}: {err}") from err
    except yaml.YAMLError as err:
        raise SpecError(f"fusion spec {str(path)!r} is not valid YAML: {err}") from err
    if isinstance(doc, Mapping) and "fusion" in doc:
        return spec_from_dict(doc["fusion"], where=f"{path}: fusion")
    return spec_from_dict(doc or {}, where=str(path))
