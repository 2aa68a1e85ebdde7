"""The loopback launcher: uvicorn workers accept on a socket bound before uvicorn started."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.serving import run_uvicorn

ROOT = Path(__file__).resolve().parents[2]


async def pid_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers every request with the worker's pid, after blocking that worker briefly.

    Blocking (not awaiting) keeps a busy worker from accepting, so that concurrent
    connections reach the other workers.
    """
    if scope["type"] != "http":
        return
    time.sleep(0.02)  # noqa: ASYNC251
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(os.getpid()).encode()})


@pytest.mark.slow
@pytest.mark.anyio
async def test_four_workers_serve_on_the_socket_bound_before_uvicorn_started(
    tmp_path: Path,
) -> None:
    env = {"PYTHONPATH": str(ROOT)}  # for `tests.ops.test_serving:pid_app` in the workers
    pids: set[str] = set()
    with run_uvicorn(
        "tests.ops.test_serving:pid_app", env=env, log_dir=tmp_path, workers=4
    ) as server:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as c:

            async def one() -> str:
                r = await c.get("/", headers={"connection": "close"})  # a new connection each
                return r.text

            deadline = time.monotonic() + 20
            while len(pids) < 4 and time.monotonic() < deadline:
                pids.update(await asyncio.gather(*(one() for _ in range(40))))
        log = server.log.read_text()
    assert len(pids) == 4, (pids, log)
    # The launcher kept no copy of the socket: with the server gone, the port refuses.
    async with httpx.AsyncClient(timeout=2) as c:
        with pytest.raises(httpx.ConnectError):
            await c.get(server.base_url)
