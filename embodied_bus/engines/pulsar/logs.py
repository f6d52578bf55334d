"""The Pulsar client's own (C++) log, on stderr."""

from __future__ import annotations

import fcntl
import logging
import os
import stat
from typing import Any

import pulsar

_logger = logging.getLogger("embodied_bus.pulsar")


#: The C++ client logs natively (warnings and errors; see ``native_logger``). A Python logger would be called
#: from the client's I/O threads, also while the interpreter shuts down, and a thread that needs
#: the GIL then is ended by Python mid-C++ frame: the process aborts (std::terminate).
#: ``EMBODIED_BUS_PULSAR_LOG=debug|info|warn|error`` sets its level (default ``warn``); ``info``
#: shows each reconnection and lookup, which tells where a client waits after a broker died.
_LEVELS = {
    "debug": pulsar.LoggerLevel.Debug,
    "info": pulsar.LoggerLevel.Info,
    "warn": pulsar.LoggerLevel.Warn,
    "error": pulsar.LoggerLevel.Error,
}
CLIENT_LOG_LEVEL = _LEVELS.get(
    os.environ.get("EMBODIED_BUS_PULSAR_LOG", "warn").lower(), pulsar.LoggerLevel.Warn
)


def native_logger() -> Any:
    """The client's own (C++) logger, on stderr where that can be opened as a stream.

    pulsar-client's ``ConsoleLogger`` writes to *stdout*, where it would mix with the JSON the CLI
    and the benchmarks print; its ``FileLogger`` opens a path (for appending), and
    ``/dev/stderr`` can be opened anew for a pipe, a terminal or a regular file. A regular file
    opened without ``O_APPEND`` (``2> file``) is switched to appending first, or Python's writes
    at its own offset would overwrite the client's lines. Only a socket (which cannot be opened)
    keeps the console logger. Not a Python logger: the client calls it, taking the GIL, on
    every log-level check of its I/O threads (halves small-message rates), and from those
    threads during interpreter exit (aborted processes now and then).
    """
    try:
        mode = os.fstat(2).st_mode
    except OSError:
        mode = 0
    if not os.path.exists("/dev/stderr"):
        return pulsar.ConsoleLogger(CLIENT_LOG_LEVEL)
    if stat.S_ISREG(mode):
        try:
            fcntl.fcntl(2, fcntl.F_SETFL, fcntl.fcntl(2, fcntl.F_GETFL) | os.O_APPEND)
        except OSError:
            return pulsar.ConsoleLogger(CLIENT_LOG_LEVEL)
    elif not (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)):
        return pulsar.ConsoleLogger(CLIENT_LOG_LEVEL)
    return pulsar.FileLogger(CLIENT_LOG_LEVEL, "/dev/stderr")
