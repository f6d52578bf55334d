"""What ``setup.py`` declares, read without installing (``setuptools.setup`` captured)."""

from __future__ import annotations

import os
import runpy
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]


def setup_kwargs() -> dict[str, object]:
    """The keyword arguments ``setup.py`` hands to ``setuptools.setup``."""
    captured: dict[str, object] = {}
    with mock.patch("setuptools.setup", lambda **kw: captured.update(kw)):
        cwd = Path.cwd()
        try:
            os.chdir(ROOT)
            runpy.run_path(str(ROOT / "setup.py"))
        finally:
            os.chdir(cwd)
    return captured
