"""A TCP link a test can cut: a forwarding proxy in its own process, standing in for a robot's
Wi-Fi or LTE link.

``cut`` makes the link go silent the way a radio link does: nothing is forwarded either way
and new connections are accepted but hear nothing; no connection is reset (the peers find out
from their own timeouts). ``heal`` lets everything flow again, what waited included (what TCP's
retransmissions would deliver). ``reset`` closes every connection (a NAT or access-point change).

Command line (one command per line on standard input; each answered with ``ok`` on standard
output)::

    python -m embodied_bus.testing.linkproxy --listen 127.0.0.1:7650 --to 127.0.0.1:6650
    cut | heal | reset | stats
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field

__all__ = ["LinkProxy", "serve"]

_CHUNK = 65536


@dataclass
class _State:
    up: asyncio.Event = field(default_factory=asyncio.Event)
    writers: set[asyncio.StreamWriter] = field(default_factory=set)
    forwarded_bytes: int = 0
    connections: int = 0


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: _State) -> None:
    try:
        while data := await reader.read(_CHUNK):
            await state.up.wait()  # a cut link holds what it got
            writer.write(data)
            await writer.drain()
            state.forwarded_bytes += len(data)
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def _connection(
    client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, target: tuple[str, int], state: _State
) -> None:
    state.connections += 1
    await state.up.wait()  # a connection made while the link is cut waits for it
    try:
        server_r, server_w = await asyncio.open_connection(*target)
    except OSError:
        client_w.close()
        return
    state.writers.update((client_w, server_w))
    try:
        await asyncio.gather(_pipe(client_r, server_w, state), _pipe(server_r, client_w, state))
    finally:
        state.writers.difference_update((client_w, server_w))


async def serve(listen: tuple[str, int], target: tuple[str, int]) -> None:
    """Forward ``listen`` to ``target``, obeying commands on standard input."""
    state = _State()
    state.up.set()
    server = await asyncio.start_server(
        lambda r, w: _connection(r, w, target, state), listen[0], listen[1], reuse_address=True
    )
    loop = asyncio.get_running_loop()
    commands = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(commands), sys.stdin)
    print("ready", flush=True)
    async with server:
        while line := (await commands.readline()).decode().strip():
            if line == "cut":
                state.up.clear()
            elif line == "heal":
                state.up.set()
            elif line == "reset":
                for w in list(state.writers):
                    w.transport.abort()
            elif line != "stats":
                print(f"unknown command {line!r}", flush=True)
                continue
            stats = {
                "up": state.up.is_set(),
                "bytes": state.forwarded_bytes,
                "connections": state.connections,
            }
            print("ok " + json.dumps(stats), flush=True)


class LinkProxy:
    """Runs :func:`serve` in a child process and sends it commands."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        self.listen = listen
        self.target = target
        self._proc: subprocess.Popen[str] | None = None
        self.cut_at: float | None = None

    def start(self, timeout_s: float = 15.0) -> LinkProxy:
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "embodied_bus.testing.linkproxy",
                "--listen",
                f"{self.listen[0]}:{self.listen[1]}",
                "--to",
                f"{self.target[0]}:{self.target[1]}",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        line = self._proc.stdout.readline().strip()
        if line != "ready" or time.monotonic() > deadline:
            raise RuntimeError(f"link proxy did not start: {line!r}")
        return self

    def command(self, what: str) -> dict[str, object]:
        """Send ``cut``, ``heal``, ``reset`` or ``stats``; the proxy's answer."""
        assert self._proc is not None and self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(what + "\n")
        self._proc.stdin.flush()
        answer = self._proc.stdout.readline().strip()
        if not answer.startswith("ok "):
            raise RuntimeError(f"link proxy: {what!r} answered {answer!r}")
        return dict(json.loads(answer[3:]))

    def cut(self) -> None:
        self.command("cut")
        self.cut_at = time.monotonic()

    def heal(self) -> None:
        self.command("heal")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(10)
            self._proc = None

    def __enter__(self) -> LinkProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _hostport(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m embodied_bus.testing.linkproxy", description=__doc__)
    p.add_argument("--listen", required=True, help="host:port to accept on")
    p.add_argument("--to", required=True, help="host:port to forward to")
    args = p.parse_args(argv)
    asyncio.run(serve(_hostport(args.listen), _hostport(args.to)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
