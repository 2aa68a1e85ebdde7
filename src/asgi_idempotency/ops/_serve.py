"""Uvicorn on a loopback port, for the demo (and the tests and benchmark that reuse it).

The listening socket is bound here first and handed to uvicorn already bound, in
process (``Server.run(sockets=[...])``) or to a child (``uvicorn --fd N``): asking
the kernel for a free port, closing it and passing the number on would let another
process take the port in between.

Needs the ``demo`` extra (uvicorn, httpx); nothing imports this module at package import.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import uvicorn

__all__ = ["UvicornProcess", "loopback_socket", "serve_in_thread", "uvicorn_process"]


def loopback_socket() -> socket.socket:
    """A TCP socket listening on 127.0.0.1, on a port the kernel picked; the caller closes it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # uvicorn --fd takes any socket for AF_UNIX, so it never sets TCP_NODELAY on what
        # it accepts; set here, Linux hands it on to every accepted connection. Without
        # it, Nagle and delayed ACKs hold every response back ~40 ms.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
    except OSError:
        sock.close()
        raise
    return sock


def _base_url(sock: socket.socket) -> str:
    return f"http://127.0.0.1:{sock.getsockname()[1]}"


class _Server(uvicorn.Server):
    """A ``uvicorn.Server`` that sets ``up_or_down`` once its startup has ended, well or not."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.up_or_down = threading.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().startup(sockets)
        finally:
            self.up_or_down.set()


@contextmanager
def serve_in_thread(
    app: Any,
    *,
    lifespan: Literal["on", "off"] = "off",
    startup_timeout: float = 10.0,
    http: Literal["h11", "httptools"] = "h11",
) -> Iterator[str]:
    """Serve ``app`` with uvicorn in a thread of this process; yield its base URL; stop it after.

    The app runs on an event loop of its own, so a synchronous client and another loop
    can both call it, and the caller can inspect the app's Python state meanwhile.
    Pass ``lifespan="on"`` for an app whose lifespan owns resources bound to the
    server's event loop (a SQL store), and ``http="httptools"`` for uvicorn's other
    HTTP/1.1 parser (it passes a header sent twice, ``Host`` included, on to the app).
    Shutdown waits at most one second for requests still running, then cancels them.
    Raises ``RuntimeError`` if the server does not start within ``startup_timeout``
    seconds, or does not stop within 10.
    """
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan=lifespan,
        ws="none",
        http=http,
        timeout_graceful_shutdown=1,
    )
    server = _Server(config)
    with loopback_socket() as sock:
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        try:
            server.up_or_down.wait(startup_timeout)
            if not server.started:
                raise RuntimeError("uvicorn did not start")
            yield _base_url(sock)
        finally:
            server.should_exit = True
            thread.join(timeout=10)
            if thread.is_alive():  # pragma: no cover - a hung server must fail its caller
                raise RuntimeError("uvicorn did not stop within 10 s")


@dataclass
class UvicornProcess:
    """A uvicorn child process (its own process group) serving on a loopback port."""

    process: subprocess.Popen[bytes]
    base_url: str
    log: Path

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (the supervisor and every worker); wait for it."""
        with suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)
        self.process.wait(timeout=20)


@contextmanager
def uvicorn_process(
    app: str,
    *,
    env: dict[str, str],
    log: Path,
    args: tuple[str, ...] = (),
    ready_path: str = "/refunds/count",
    timeout: float = 30.0,
    cwd: Path | None = None,
    log_level: str | None = "warning",
) -> Iterator[UvicornProcess]:
    """Run ``uvicorn app --fd N *args`` on a socket bound here; yield once it answers.

    ``env`` is added to this process's environment; the child's output goes to
    ``log``; it runs in ``cwd`` (default: this process's working directory), with
    ``--log-level log_level`` (``None``: uvicorn's default, as a user runs it). Ready
    means ``GET ready_path`` answered below 500. The process group is SIGKILLed on
    exit. Raises ``RuntimeError`` (with the log) if uvicorn exits, or has not
    answered within ``timeout`` seconds.
    """
    with loopback_socket() as sock:
        fd = sock.fileno()
        level = ("--log-level", log_level) if log_level is not None else ()
        cmd = [sys.executable, "-m", "uvicorn", app, "--fd", str(fd), *level, *args]
        with log.open("wb") as out:
            proc = subprocess.Popen(
                cmd,
                env={**os.environ, **env},
                stdout=out,
                stderr=subprocess.STDOUT,
                pass_fds=(fd,),
                start_new_session=True,
                cwd=cwd,
            )
        server = UvicornProcess(proc, _base_url(sock), log)
    # The child holds the socket now; this process's copy is closed, so the port is
    # released once the child dies and a killed server refuses connections.
    with until_ready(server, ready_path, timeout) as up:
        yield up


class ExitedEarly(RuntimeError):
    """The server process exited before it answered."""


@contextmanager
def until_ready(
    server: UvicornProcess, ready_path: str, timeout: float
) -> Iterator[UvicornProcess]:
    """``server`` once ``GET ready_path`` answers below 500; its process group SIGKILLed
    on exit, however the block ends.

    Raises:
        ExitedEarly: the process exited first (with its log).
        RuntimeError: it has not answered within ``timeout`` seconds (with its log).
    """
    try:
        deadline = time.monotonic() + timeout
        while not _answers(server.base_url + ready_path):
            # Another process: nothing to wait on but its answers.
            if server.process.poll() is not None:
                raise ExitedEarly(f"the server exited early:\n{server.log.read_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not become ready:\n{server.log.read_text()}")
            time.sleep(0.1)
        yield server
    finally:
        server.kill()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code < 500
    except httpx.TransportError:
        return False
