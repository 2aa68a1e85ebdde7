"""Real loopback servers for the client tests: uvicorn in a background thread.

The app runs on its own event loop in its own thread, so a sync ``httpx.Client`` and
an async test on the pytest loop can both call it, and shared Python state (counters,
gates) stays inspectable from the test.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import uvicorn


@contextmanager
def serve(
    app: Any, *, lifespan: Literal["on", "off"] = "off", startup_timeout: float = 10.0
) -> Iterator[str]:
    """Serve ``app`` on a free 127.0.0.1 port; yield its base URL; stop it after.

    Shutdown waits at most one second for in-flight requests (handlers that sleep
    past the client's timeout), then cancels them. Pass ``lifespan="on"`` for an
    app whose lifespan owns resources bound to the server's event loop (a SQL store).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan=lifespan,
        ws="none",
        http="h11",
        timeout_graceful_shutdown=1,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + startup_timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
        if thread.is_alive():  # pragma: no cover - a hung server must fail the test
            raise RuntimeError("uvicorn did not stop within 10 s")


def unused_port() -> int:
    """A loopback port with nothing listening (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
