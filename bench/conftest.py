"""Fixtures of the lab's own checks (bench/test_floors.py), apart from tests/conftest.py."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def pg_url() -> str:
    return os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")


@pytest.fixture
def mariadb_url() -> str:
    """A database of the check's own with the records table (the floor reads it at start)."""
    url = os.environ.get(
        "BENCH_MARIADB_URL", "mariadb+asyncmy://root@127.0.0.1:3306/bench_floors_check"
    )
    name = url.rsplit("/", 1)[1]
    client = shutil.which("mariadb") or shutil.which("mysql")
    if client is None:
        pytest.fail("no mariadb client on PATH (Debian: apt-get install mariadb-client)")
    subprocess.run(
        [client, "-h127.0.0.1", "-uroot", "-e", f"CREATE DATABASE IF NOT EXISTS {name}"],
        check=True,
    )
    subprocess.run(["asgi-idempotency", "migrate", "--database-url", url], check=True)
    return url


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A redis-server of the check's own on a free loopback port, stopped by its PID."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not on PATH (Debian: apt-get install redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)
