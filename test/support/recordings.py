"""The real recordings the tests read: ``test/data/recordings`` (see its ``MANIFEST.md`` for
each one's source, commit and licence)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORDINGS = ROOT / "test" / "data" / "recordings"


def recording(*parts: str) -> Path:
    """Path of a file or folder of the recordings; fails clearly if absent."""
    p = RECORDINGS.joinpath(*parts)
    assert p.exists(), f"recording {p} not found (the repository ships it under test/data/recordings)"
    return p
