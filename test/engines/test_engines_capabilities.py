"""Engines by capability and by URL scheme: a part that needs what an engine does not have
says so by name; the scheme picks the engine from a registry a third engine can join."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from embodied_bus import open_bus
from embodied_bus.actions import QueueService
from embodied_bus.engines import Engine, ZenohSettings, open_engine, register_engine
from embodied_bus.engines.capabilities import (
    Membership,
    Notifications,
    RequestReply,
    membership,
    request_reply,
)
from embodied_bus.errors import BusConfigError
from embodied_bus.state import StateService


async def test_each_engine_declares_what_it_offers_beyond_streams(pulsar_url: str) -> None:
    async with open_bus("zenoh:", namespace="caps") as z, open_bus(pulsar_url, namespace="caps") as p:
        assert isinstance(z.engine, RequestReply | Notifications | Membership)
        assert all(isinstance(z.engine, c) for c in (RequestReply, Notifications, Membership))
        assert isinstance(p.engine, Membership)
        assert not isinstance(p.engine, RequestReply | Notifications)
        assert membership(p.engine, "a test") is p.engine
        with pytest.raises(BusConfigError, match="a test needs request/reply, which the pulsar engine"):
            request_reply(p.engine, "a test")


async def test_a_service_on_an_engine_without_request_reply_fails_naming_it(
    pulsar_url: str, tmp_path: Path
) -> None:
    async with open_bus(pulsar_url, namespace="caps") as bus:
        stop = asyncio.Event()
        with pytest.raises(BusConfigError, match="the action queue service needs request/reply"):
            await asyncio.wait_for(QueueService(bus, tmp_path / "q.db").run(stop), 10)
        with pytest.raises(BusConfigError, match="the state service needs request/reply"):
            await asyncio.wait_for(StateService(bus, tmp_path / "s.db").run(stop), 10)


@dataclass(frozen=True)
class _Settings:
    """Settings of an engine registered under another scheme."""

    scheme: str
    namespace: str = "caps"


async def test_the_url_scheme_picks_the_engine_from_the_registry() -> None:
    with pytest.raises(BusConfigError, match="no engine for bus URL scheme 'carrier-pigeon'; known: pulsar"):
        await open_engine(_Settings("carrier-pigeon"))
    opened: list[Any] = []

    async def open_local(settings: Any) -> Engine:
        opened.append(settings)
        from embodied_bus.engines.zenoh import ZenohEngine

        return await ZenohEngine.open(ZenohSettings(namespace=settings.namespace))

    register_engine("local-test", open_local)
    engine = await open_engine(_Settings("local-test"))
    try:
        assert engine.name == "zenoh" and [s.scheme for s in opened] == ["local-test"]
    finally:
        await engine.close()
