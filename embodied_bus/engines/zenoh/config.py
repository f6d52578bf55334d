"""Zenoh session configuration from bus settings: endpoints, TLS, shared memory, logging."""

from __future__ import annotations

import json
import logging
import threading

import zenoh

from embodied_bus.engines.urls import DEFAULT_SHM_POOL_BYTES, ZenohSettings
from embodied_bus.errors import (
    BusConfigError,
)

_logger = logging.getLogger("embodied_bus.zenoh")
_log_init = threading.Lock()
_log_done = False


def init_logging() -> None:
    """Zenoh's own log lines, only when ``RUST_LOG`` asks for them: zenoh-python writes them to
    standard output, where they would corrupt what a program prints there (JSON, samples).
    A default level of "error" once put a shared-memory watchdog's "timer overrun" into the
    middle of a benchmark's JSON."""
    global _log_done
    with _log_init:
        if not _log_done:
            zenoh.try_init_log_from_env()  # type: ignore[no-untyped-call]
            _log_done = True


def stream_key(namespace: str, stream: str | None) -> str:
    """Zenoh key expression of a stream (``None``: every stream of the namespace)."""
    return f"eb/{namespace}/s/{stream}" if stream is not None else f"eb/{namespace}/s/**"


SHM_POOL_KEY = "transport/shared_memory/transport_optimization/pool_size"
SHM_ENABLED_KEY = "transport/shared_memory/enabled"


_LISTEN_KEY = "listen/endpoints"
#: What Zenoh listens on when nobody said (a plaintext port on every interface, for peers).
_DEFAULT_LISTEN = zenoh.Config().get_json(_LISTEN_KEY)


def _secured(settings: ZenohSettings) -> bool:
    """TLS settings or a config file (access control, TLS): a plaintext default listener would
    be a side door around them. Plain peers keep Zenoh's default and mesh with each other."""
    return bool(settings.tls_ca or settings.tls_cert or settings.mtls or settings.config_file)


def _check_tls_endpoints(settings: ZenohSettings) -> None:
    """A bus with TLS settings listens and connects on TLS endpoints only.

    Raises:
        BusConfigError: A plaintext endpoint beside TLS settings (named).
    """
    if not (settings.tls_ca or settings.tls_cert or settings.mtls):
        return
    plain = [e for e in (*settings.listen, *settings.connect) if not e.startswith(("tls/", "quic/"))]
    if plain:
        raise BusConfigError(
            f"a TLS bus uses tls/ (or quic/) endpoints only; remove the plaintext endpoint(s) {plain} "
            "or open a second bus for them"
        )


def build_zenoh_config(settings: ZenohSettings) -> zenoh.Config:
    """Translate settings into a Zenoh config.

    Raises:
        BusConfigError: The config file cannot be read or a value is rejected by Zenoh.
    """
    try:
        cfg = zenoh.Config.from_file(settings.config_file) if settings.config_file else zenoh.Config()
        cfg.insert_json5("mode", json.dumps(settings.mode))
        cfg.insert_json5("scouting/multicast/enabled", json.dumps(settings.multicast_scouting))
        _check_tls_endpoints(settings)
        if settings.listen:
            cfg.insert_json5("listen/endpoints", json.dumps(list(settings.listen)))
        elif (
            _secured(settings) and settings.mode != "router" and cfg.get_json(_LISTEN_KEY) == _DEFAULT_LISTEN
        ):
            # a secured peer or client listens only where it is told: Zenoh's own default would
            # open a plaintext port on every interface beside its TLS endpoints or access control
            cfg.insert_json5(_LISTEN_KEY, "[]")
        if settings.connect:
            cfg.insert_json5("connect/endpoints", json.dumps(list(settings.connect)))
            cfg.insert_json5("connect/timeout_ms", str(int(settings.connect_timeout_s * 1000)))
            cfg.insert_json5("connect/exit_on_failure", "true")
        if settings.shm is not None:
            cfg.insert_json5("transport/shared_memory/enabled", json.dumps(settings.shm))
        pool = settings.shm_pool_bytes
        if pool is None:
            engine_default = zenoh.Config().get_json(SHM_POOL_KEY)
            if settings.config_file is None or cfg.get_json(SHM_POOL_KEY) == engine_default:
                pool = DEFAULT_SHM_POOL_BYTES  # the config file did not choose one
        if pool:
            cfg.insert_json5(SHM_POOL_KEY, str(pool))
        tls = "transport/link/tls/"
        if settings.tls_ca:
            cfg.insert_json5(tls + "root_ca_certificate", json.dumps(settings.tls_ca))
        if settings.tls_cert and settings.tls_key:
            cfg.insert_json5(tls + "listen_certificate", json.dumps(settings.tls_cert))
            cfg.insert_json5(tls + "listen_private_key", json.dumps(settings.tls_key))
            if settings.mtls:
                cfg.insert_json5(tls + "connect_certificate", json.dumps(settings.tls_cert))
                cfg.insert_json5(tls + "connect_private_key", json.dumps(settings.tls_key))
        if settings.mtls:
            cfg.insert_json5(tls + "enable_mtls", "true")
    except zenoh.ZError as err:
        raise BusConfigError(f"invalid Zenoh configuration: {err}") from err
    except OSError as err:
        raise BusConfigError(f"cannot read Zenoh config file {settings.config_file!r}: {err}") from err
    return cfg
