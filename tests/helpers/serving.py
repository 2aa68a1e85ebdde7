"""Real ASGI server processes for the multi-process and server tests.

uvicorn runs on the demo's launcher: each server gets its own log file in ``log_dir``
and ``workers`` worker processes, all accepting on one socket bound before uvicorn
starts (``asgi_idempotency.ops._serve``). :func:`run_server` starts uvicorn, hypercorn
or granian on a loopback port the same way (hypercorn on the socket bound here, by its
descriptor; granian, which binds its own, on a port found free), in a process group of
its own, and yields once the app answers.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from asgi_idempotency.ops._serve import (
    ExitedEarly,
    UvicornProcess,
    loopback_socket,
    until_ready,
    uvicorn_process,
)

__all__ = ["SERVERS", "Server", "ServerProcess", "UvicornProcess", "run_server", "run_uvicorn"]

# A server process, whichever server: the process, its base URL, its log, kill().
ServerProcess = UvicornProcess
Server = Literal["uvicorn", "hypercorn", "granian"]
SERVERS: tuple[Server, ...] = ("uvicorn", "hypercorn", "granian")


@contextmanager
def run_uvicorn(
    app: str, *, env: dict[str, str], log_dir: Path, workers: int = 1
) -> Iterator[UvicornProcess]:
    """``uvicorn app --workers N`` in a process group of its own; yields once it answers."""
    log = log_dir / f"uvicorn-{uuid.uuid4().hex[:8]}.log"
    with uvicorn_process(app, env=env, log=log, args=("--workers", str(workers))) as server:
        yield server


@contextmanager
def run_server(
    server: Server,
    app: str,
    *,
    env: dict[str, str],
    log_dir: Path,
    ready_path: str = "/ready",
    timeout: float = 30.0,
) -> Iterator[ServerProcess]:
    """``app`` (``module:attribute``) served by ``server`` with one worker on 127.0.0.1;
    yields once ``GET ready_path`` answers below 500. hypercorn serves HTTP/1.1 and
    HTTP/2 (h2c, prior knowledge) on one port, granian too (``--http auto``). The
    process group is SIGKILLed on exit. Raises ``RuntimeError`` (with the log) if the
    server exits or does not answer within ``timeout`` seconds."""
    log = log_dir / f"{server}-{uuid.uuid4().hex[:8]}.log"
    if server == "uvicorn":
        with uvicorn_process(app, env=env, log=log, ready_path=ready_path, timeout=timeout) as up:
            yield up
        return
    if server == "hypercorn":
        with loopback_socket() as sock:
            fd = sock.fileno()
            cmd = ["-m", "hypercorn", app, "--bind", f"fd://{fd}", "--workers", "1"]
            process = _spawn(cmd, env, log, pass_fds=(fd,))
            base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        with until_ready(ServerProcess(process, base_url, log), ready_path, timeout) as up:
            yield up
        return
    # granian binds its own socket (it takes no descriptor): a port found free here may
    # be taken by another process before granian binds it, so an early exit is retried.
    for attempt in range(3):
        port = _free_port()
        cmd = ["-m", "granian", "--interface", "asgi", "--host", "127.0.0.1",
               "--port", str(port), "--workers", "1", app]  # fmt: skip
        process = _spawn(cmd, env, log, pass_fds=())
        started = ServerProcess(process, f"http://127.0.0.1:{port}", log)
        try:
            with until_ready(started, ready_path, timeout) as up:
                yield up
            return
        except ExitedEarly:
            if attempt == 2:
                raise


def _spawn(
    args: list[str], env: dict[str, str], log: Path, *, pass_fds: tuple[int, ...]
) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, *args],
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            pass_fds=pass_fds,
            start_new_session=True,
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
