"""A throwaway ``redis-server`` for the benchmark's Redis variants (never the system one).

The processes are :mod:`bench.redis_servers`' (the tests use the same ones): a free
loopback port, persistence off (the benchmark measures the guard, not the disk),
stopped by their PIDs.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.helpers.redis_servers import start_cluster, start_server

__all__ = ["redis_cluster", "redis_server"]


@contextmanager
def redis_server(directory: Path, *extra: str) -> Iterator[str]:
    """Yield the ``redis://`` URL of a fresh server in ``directory``; stop it afterwards."""
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not on PATH: install it, or set BENCH_REDIS_URL")
    server = start_server(directory, "--maxmemory-policy", "noeviction", *extra)
    try:
        yield server.url
    finally:
        server.stop()


@contextmanager
def redis_cluster(directory: Path, *, replicas: bool = True) -> Iterator[str]:
    """Yield the ``redis+cluster://`` URL of a fresh 3-primary loopback cluster, with a
    replica per primary unless ``replicas`` is false."""
    cluster = start_cluster(directory, replicas=replicas)
    try:
        yield cluster.url
    finally:
        cluster.stop()
