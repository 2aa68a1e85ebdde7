"""Real uvicorn processes for the multi-process tests, on the demo's launcher.

Each server gets its own log file in ``log_dir`` and ``workers`` worker processes,
all accepting on one socket bound before uvicorn starts (``asgi_idempotency.ops._serve``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from asgi_idempotency.ops._serve import UvicornProcess, uvicorn_process

__all__ = ["UvicornProcess", "run_uvicorn"]


@contextmanager
def run_uvicorn(
    app: str, *, env: dict[str, str], log_dir: Path, workers: int = 1
) -> Iterator[UvicornProcess]:
    """``uvicorn app --workers N`` in a process group of its own; yields once it answers."""
    log = log_dir / f"uvicorn-{uuid.uuid4().hex[:8]}.log"
    with uvicorn_process(app, env=env, log=log, args=("--workers", str(workers))) as server:
        yield server
