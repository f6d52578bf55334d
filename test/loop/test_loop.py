"""The event loop of the command line (embodied_bus.loop)."""

from __future__ import annotations

import asyncio
import importlib.util
import sys

import pytest

from embodied_bus import BusConfigError
from embodied_bus.loop import LOOP_ENV, loop_runner

HAVE_UVLOOP = importlib.util.find_spec("uvloop") is not None


async def _which_loop() -> str:
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


def test_asyncio_is_chosen_by_name_and_runs_a_coroutine() -> None:
    name, run = loop_runner("asyncio")
    assert name == "asyncio" and run(_which_loop()) == "asyncio"


@pytest.mark.skipif(not HAVE_UVLOOP, reason="uvloop is not installed")
def test_uvloop_is_the_default_where_installed_and_runs_a_coroutine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LOOP_ENV, raising=False)
    name, run = loop_runner()
    assert name == "uvloop" and run(_which_loop()) == "uvloop"


def test_the_environment_chooses_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LOOP_ENV, "asyncio")
    assert loop_runner()[0] == "asyncio"


def test_an_unknown_loop_is_a_clear_error_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LOOP_ENV, "trio")
    with pytest.raises(BusConfigError, match=r"EMBODIED_BUS_LOOP='trio': must be one of auto, uvloop"):
        loop_runner()


def test_without_uvloop_auto_falls_back_and_uvloop_asked_for_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # what an uninstalled package looks like
    assert loop_runner("auto")[0] == "asyncio"
    with pytest.raises(BusConfigError, match="uvloop is not installed"):
        loop_runner("uvloop")
