"""The Zenoh session through which ``ros-bridge`` and ``replay --ros`` join a ROS 2 graph on
rmw_zenoh, configured as rmw_zenoh configures its own, from the same environment variables:

- ``ZENOH_SESSION_CONFIG_URI``: a Zenoh JSON5 config file used instead of the defaults
  (multicast scouting off, timestamping on, a peer connected to ``tcp/localhost:7447``);
- ``ZENOH_CONFIG_OVERRIDE``: ``key=value;key=value`` settings applied on top (values are JSON5,
  e.g. ``connect/endpoints=["tcp/192.168.0.3:7447"]``);
- ``ZENOH_ROUTER_CHECK_ATTEMPTS``: how many times (one second apart) to look for a router
  before giving up; unset or 0 waits as long as it takes, a negative value does not look.

The robot YAML and the command line come last: ``ros.connect`` when it names endpoints other
than rmw_zenoh's default, ``ros.host_router`` and ``--connect`` / ``--host-router``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any

import zenoh

from embodied_bus.errors import BusConfigError, BusConnectionError
from embodied_bus.ros.config import RosLink
from embodied_bus.rosmsg.rmw_zenoh import DEFAULT_ROUTER_ENDPOINT

__all__ = ["ROUTER_WAIT_LOG_S", "open_rmw_session", "rmw_session_config", "router_check_attempts"]

_log = logging.getLogger("embodied_bus.ros")
#: How often a session waiting for its router says so, seconds.
ROUTER_WAIT_LOG_S = 5.0


def _overrides(text: str) -> list[tuple[str, str]]:
    """``key=value;key=value`` of ``ZENOH_CONFIG_OVERRIDE``.

    Raises:
        BusConfigError: An entry is not ``key=value``.
    """
    out = []
    for entry in (e.strip() for e in text.split(";")):
        if not entry:
            continue
        key, sep, value = entry.partition("=")
        if not sep or not key.strip():
            raise BusConfigError(f"ZENOH_CONFIG_OVERRIDE: {entry!r} is not key=value")
        out.append((key.strip(), value.strip()))
    return out


def rmw_session_config(link: RosLink, environ: dict[str, str] | None = None) -> zenoh.Config:
    """The session's Zenoh config (see the module docstring for what comes from where).

    Raises:
        BusConfigError: The config file cannot be read, or an override is not valid.
    """
    env = os.environ if environ is None else environ
    path = env.get("ZENOH_SESSION_CONFIG_URI", "").strip()
    if path and not link.host_router:
        try:
            conf = zenoh.Config.from_file(path)
        except (zenoh.ZError, OSError, ValueError) as err:
            raise BusConfigError(f"ZENOH_SESSION_CONFIG_URI: cannot read {path!r}: {err}") from err
    else:
        conf = zenoh.Config()
        conf.insert_json5("scouting/multicast/enabled", "false")
        # as rmw_zenoh's session config: samples are timestamped (transient-local caches need it)
        conf.insert_json5("timestamping/enabled", "true")
        conf.insert_json5("mode", '"peer"')
        conf.insert_json5("connect/endpoints", json.dumps([DEFAULT_ROUTER_ENDPOINT]))
        conf.insert_json5("listen/endpoints", json.dumps(["tcp/localhost:0"]))
    for key, value in _overrides(env.get("ZENOH_CONFIG_OVERRIDE", "")):
        try:
            conf.insert_json5(key, value)
        except (zenoh.ZError, ValueError) as err:
            raise BusConfigError(f"ZENOH_CONFIG_OVERRIDE: cannot set {key} to {value}: {err}") from err
    if link.host_router:
        conf.insert_json5("mode", '"router"')
        conf.insert_json5("listen/endpoints", json.dumps([link.host_router]))
    elif tuple(link.connect) != (DEFAULT_ROUTER_ENDPOINT,):
        conf.insert_json5("connect/endpoints", json.dumps(list(link.connect)))
    return conf


def router_check_attempts(environ: dict[str, str] | None = None) -> int | None:
    """``ZENOH_ROUTER_CHECK_ATTEMPTS`` as rmw_zenoh reads it: attempts (None: as many as it
    takes; 0: do not look)."""
    raw = (os.environ if environ is None else environ).get("ZENOH_ROUTER_CHECK_ATTEMPTS", "").strip()
    try:
        value = int(raw) if raw else 0
    except ValueError as err:
        raise BusConfigError(f"ZENOH_ROUTER_CHECK_ATTEMPTS: expected an integer, got {raw!r}") from err
    if value < 0:
        return 0
    return value or None


async def _wait_for_router(session: Any, link: RosLink, attempts: int | None) -> None:
    """Look for a router once a second, as rmw_zenoh does before a node starts."""
    where = ", ".join(link.connect)
    tried = 0
    while not list(session.info.routers_zid()):
        tried += 1
        if attempts is not None and tried >= attempts:
            raise BusConnectionError(
                f"no Zenoh router at {where} after {attempts} attempt(s) (ZENOH_ROUTER_CHECK_ATTEMPTS); "
                "start rmw_zenohd or embodied-bus router, or host one with --host-router"
            )
        if tried == 1 or tried % int(ROUTER_WAIT_LOG_S) == 0:
            _log.warning("waiting for a Zenoh router at %s (start rmw_zenohd or embodied-bus router)", where)
        await asyncio.sleep(1.0)


async def open_rmw_session(link: RosLink) -> Any:
    """Open the ROS-side Zenoh session (the router itself with ``host_router``); a peer waits
    for its router as ``ZENOH_ROUTER_CHECK_ATTEMPTS`` says.

    Raises:
        BusConnectionError: It could not be opened (e.g. the router endpoint is taken), or no
            router came within the attempts.
        BusConfigError: The session's configuration is not valid.
    """
    conf = rmw_session_config(link)
    attempts = router_check_attempts()
    try:
        session = await asyncio.to_thread(zenoh.open, conf)
    except zenoh.ZError as err:
        where = link.host_router or ", ".join(link.connect)
        raise BusConnectionError(f"cannot open the rmw_zenoh session ({where}): {err}") from err
    if link.host_router or attempts == 0:
        return session
    try:
        await _wait_for_router(session, link, attempts)
    except BaseException:
        await asyncio.to_thread(session.close)
        raise
    return session
