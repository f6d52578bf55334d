"""Zenoh engine: an embedded peer (default), a client of a router, or a router itself.

Key layout: ``eb/<namespace>/s/<stream>``. The binary header rides in the Zenoh attachment and
the payload is passed through untouched.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import replace
from typing import Any

import zenoh

from embodied_bus.engines.base import Engine, EnginePublisher, EngineSubscriber, MessageSink
from embodied_bus.engines.urls import ZenohSettings
from embodied_bus.errors import (
    BusClosedError,
    BusConfigError,
    BusConnectionError,
    HeaderError,
    PublishError,
)
from embodied_bus.model.qos import Backpressure, PublisherOptions, SubscriptionOptions
from embodied_bus.model.wire import Header, HeaderFlags, decode_header, encode_header

__all__ = ["ZenohEngine", "build_zenoh_config", "stream_key"]

#: Shared-memory pool per publisher, in bytes (grows to fit a payload if needed).
SHM_POOL_BYTES = 64 * 1024 * 1024

_log_init = threading.Lock()
_log_done = False


def _init_logging() -> None:
    global _log_done
    with _log_init:
        if not _log_done:
            zenoh.init_log_from_env_or("error")
            _log_done = True


def stream_key(namespace: str, stream: str | None) -> str:
    """Zenoh key expression of a stream (``None``: every stream of the namespace)."""
    return f"eb/{namespace}/s/{stream}" if stream is not None else f"eb/{namespace}/s/**"


def build_zenoh_config(settings: ZenohSettings) -> zenoh.Config:
    """Translate settings into a Zenoh config.

    Raises:
        BusConfigError: The config file cannot be read or a value is rejected by Zenoh.
    """
    try:
        cfg = zenoh.Config.from_file(settings.config_file) if settings.config_file else zenoh.Config()
        cfg.insert_json5("mode", json.dumps(settings.mode))
        cfg.insert_json5("scouting/multicast/enabled", json.dumps(settings.multicast_scouting))
        if settings.listen:
            cfg.insert_json5("listen/endpoints", json.dumps(list(settings.listen)))
        if settings.connect:
            cfg.insert_json5("connect/endpoints", json.dumps(list(settings.connect)))
            cfg.insert_json5("connect/timeout_ms", str(int(settings.connect_timeout_s * 1000)))
            cfg.insert_json5("connect/exit_on_failure", "true")
        if settings.shm is not None:
            cfg.insert_json5("transport/shared_memory/enabled", json.dumps(settings.shm))
    except zenoh.ZError as err:
        raise BusConfigError(f"invalid Zenoh configuration: {err}") from err
    except OSError as err:
        raise BusConfigError(f"cannot read Zenoh config file {settings.config_file!r}: {err}") from err
    return cfg


class _ZenohPublisher(EnginePublisher):
    def __init__(self, engine: ZenohEngine, key: str, options: PublisherOptions) -> None:
        self._engine = engine
        cc = (
            zenoh.CongestionControl.BLOCK
            if options.backpressure is Backpressure.BLOCK
            else zenoh.CongestionControl.DROP
        )
        self._pub = engine.session.declare_publisher(
            key, congestion_control=cc, reliability=zenoh.Reliability.RELIABLE
        )
        self._shm_threshold = options.shm_threshold_bytes if options.shm else None
        self._shm: Any = None
        self._closed = False

    def _shm_buffer(self, payload: bytes | bytearray) -> Any:
        if self._shm is None:
            self._shm = zenoh.shm.ShmProvider.default_backend(max(SHM_POOL_BYTES, 2 * len(payload)))
        buf = self._shm.alloc(len(payload), policy=zenoh.shm.BlockOn(zenoh.shm.GarbageCollect()))
        buf[0 : len(payload)] = payload
        return buf

    def send(self, header: Header, payload: bytes | bytearray) -> bool:
        if self._closed:
            raise BusClosedError(f"publisher for {header.stream!r} is closed")
        try:
            if self._shm_threshold is not None and len(payload) >= self._shm_threshold:
                att = encode_header(replace(header, flags=header.flags | HeaderFlags.SHM))
                self._pub.put(self._shm_buffer(payload), attachment=att)
            else:
                self._pub.put(payload, attachment=encode_header(header))
        except zenoh.ZError as err:
            raise PublishError(f"zenoh put on {header.stream!r} failed: {err}") from err
        return True

    def has_subscribers(self) -> bool:
        status = self._pub.matching_status
        return bool(getattr(status, "matching", status))

    async def flush(self) -> None:
        return None

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._pub.undeclare()  # type: ignore[no-untyped-call]
            except zenoh.ZError:
                pass


class _ZenohSubscriber(EngineSubscriber):
    def __init__(self, engine: ZenohEngine, key: str, sink: MessageSink) -> None:
        deliver = sink.deliver
        reject = sink.reject

        def on_sample(sample: zenoh.Sample) -> None:
            att = sample.attachment
            if att is None:
                reject(HeaderError(f"sample on {sample.key_expr} has no header attachment"), None)
                return
            try:
                header = decode_header(att.to_bytes())
            except HeaderError as err:
                reject(HeaderError(f"sample on {sample.key_expr}: {err}"), None)
                return
            deliver(header, sample.payload.to_bytes(), None)

        self._sub = engine.session.declare_subscriber(key, on_sample)
        self._closed = False

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._sub.undeclare()  # type: ignore[no-untyped-call]
            except zenoh.ZError:
                pass


class ZenohEngine(Engine):
    """A Zenoh session used as a bus engine.

    Open with :meth:`open`; the session is closed by :meth:`close`.
    """

    name = "zenoh"

    def __init__(self, settings: ZenohSettings, session: zenoh.Session) -> None:
        self.settings = settings
        self.session = session
        self._closed = False

    @classmethod
    async def open(cls, settings: ZenohSettings) -> ZenohEngine:
        """Open the session.

        Raises:
            BusConnectionError: None of the ``connect`` endpoints answered in time, or a listen
                endpoint could not be bound.
        """
        _init_logging()
        cfg = build_zenoh_config(settings)
        try:
            session = await asyncio.wait_for(
                asyncio.to_thread(zenoh.open, cfg), settings.connect_timeout_s + 5.0
            )
        except zenoh.ZError as err:
            where = ", ".join(settings.connect or settings.listen) or "the default endpoints"
            raise BusConnectionError(
                f"cannot open Zenoh session ({settings.mode}) with {where} within "
                f"{settings.connect_timeout_s:g} s: {err}"
            ) from err
        except TimeoutError as err:
            raise BusConnectionError(
                f"opening the Zenoh session did not finish within {settings.connect_timeout_s + 5:g} s"
            ) from err
        return cls(settings, session)

    def key(self, stream: str | None) -> str:
        """Key expression of a stream in this namespace."""
        return stream_key(self.settings.namespace, stream)

    def _check(self) -> None:
        if self._closed:
            raise BusClosedError("the Zenoh bus is closed")

    async def create_publisher(self, stream: str, options: PublisherOptions) -> EnginePublisher:
        self._check()
        return _ZenohPublisher(self, self.key(stream), options)

    async def create_subscriber(
        self, stream: str | None, sink: MessageSink, options: SubscriptionOptions
    ) -> EngineSubscriber:
        self._check()
        return _ZenohSubscriber(self, self.key(stream), sink)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await asyncio.to_thread(self.session.close)
