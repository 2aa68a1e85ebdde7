"""Fixtures of the reliability suite (the helpers they build on live in ``support``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import pytest
from sqlalchemy.engine import make_url

from asgi_idempotency import SQLStore

from ..conftest import emptied
from ..helpers.serving import UvicornProcess, run_uvicorn
from .support import DEMO, SHARED_LEASE, Probe, TcpProxy, demo_env


@pytest.fixture
def pg_proxy(pg_url: str) -> Iterator[TcpProxy]:
    """A loopback TCP proxy in front of the run's Postgres; closed after the test."""
    u = make_url(pg_url)
    proxy = TcpProxy(u.host or "127.0.0.1", u.port or 5432)
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.fixture
def probe(pg_store: SQLStore) -> Probe:
    """Direct reads of the run's (freshly truncated) Postgres, bypassing any proxy."""
    return Probe(pg_store)


@pytest.fixture
async def mariadb_probe(mariadb_url: str) -> AsyncIterator[Probe]:
    """Direct reads of the run's MariaDB database, its tables emptied first."""
    async with emptied(SQLStore(mariadb_url)) as store:
        yield Probe(store)


@pytest.fixture(scope="session")
def demo_pair(
    pg_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[UvicornProcess, UvicornProcess]]:
    """Two demo servers (two processes, one Postgres, lease ``SHARED_LEASE``), shared by the suite.

    A uvicorn start costs seconds on a busy machine, so the tests that do not kill
    their server share these; each test still starts from truncated tables (``probe``).
    Started side by side in threads; both are killed at the end of the run.
    """
    yield from _demo_pair(pg_url, tmp_path_factory)


@pytest.fixture(scope="session")
def mariadb_demo_pair(
    mariadb_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[UvicornProcess, UvicornProcess]]:
    """``demo_pair`` on the run's MariaDB database."""
    yield from _demo_pair(mariadb_url, tmp_path_factory)


def _demo_pair(
    url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[UvicornProcess, UvicornProcess]]:
    log_dir = tmp_path_factory.mktemp("demo")
    managers = [
        run_uvicorn(DEMO, env=demo_env(url, lease=SHARED_LEASE), log_dir=log_dir) for _ in range(2)
    ]
    with ExitStack() as stack:
        with ThreadPoolExecutor(len(managers)) as pool:
            futures = [pool.submit(m.__enter__) for m in managers]
        servers: list[UvicornProcess] = []
        errors: list[BaseException] = []
        for manager, future in zip(managers, futures, strict=True):
            error = future.exception()
            if error is None:
                servers.append(future.result())
                stack.push(manager.__exit__)
            else:
                errors.append(error)
        if errors:
            raise errors[0]
        yield servers[0], servers[1]
