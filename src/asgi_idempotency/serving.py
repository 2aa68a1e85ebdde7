"""Real uvicorn processes on loopback ports, for the demo and the multi-process tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Server", "free_port", "run_uvicorn"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """A real uvicorn process on a loopback port."""

    process: subprocess.Popen[bytes]
    base_url: str
    log: Path

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (the supervisor and every worker)."""
        with suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)
        self.process.wait(timeout=20)


@contextmanager
def run_uvicorn(
    app: str,
    *,
    env: dict[str, str],
    log_dir: Path,
    workers: int = 1,
    extra_args: tuple[str, ...] = (),
    ready_path: str = "/refunds/count",
    timeout: float = 30.0,
) -> Iterator[Server]:
    """Start ``uvicorn app`` in its own process group; wait until it answers; kill it after."""
    port = free_port()
    log = log_dir / f"uvicorn-{port}.log"
    cmd = [
        sys.executable, "-m", "uvicorn", app,
        "--host", "127.0.0.1", "--port", str(port),
        "--workers", str(workers), "--log-level", "warning", *extra_args,
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"uvicorn exited early:\n{log.read_text()}")
            if _answers(server.base_url + ready_path):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not become ready:\n{log.read_text()}")
            time.sleep(0.1)
        yield server
    finally:
        server.kill()


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=1).status_code < 500
    except httpx.TransportError:
        return False
