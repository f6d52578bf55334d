"""Where the shared real recordings live (``../shared/data/recordings`` from the project root)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDINGS = Path(os.environ.get("EMBODIED_BUS_RECORDINGS", ROOT.parent / "shared" / "data" / "recordings"))


def recording(*parts: str) -> Path:
    """Path of a file or folder in the shared recordings; fails clearly if absent."""
    p = RECORDINGS.joinpath(*parts)
    assert p.exists(), f"recording {p} not found (set EMBODIED_BUS_RECORDINGS)"
    return p
