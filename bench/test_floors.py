"""The benchmark's floors hold what ``bench.run`` says they hold (issue #34); the lab's own
check, run by hand (`python -m pytest bench/test_floors.py`): the tests never import the lab.

Each floor on a networked store opens one connection per load connection when it
starts, counted from outside the driver (``/proc``, as ``bench.run`` checks after its
warm-up), and a floor started without being told the load's connection count refuses.
"""

from __future__ import annotations

import os

import pytest
from sqlalchemy.engine import make_url

from bench import app as bench_app
from bench.harness import open_connections

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("variant", ["floor_pg", "floor_redis", "floor_mariadb"])
async def test_a_floor_without_its_pool_size_refuses_to_start(
    variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BENCH_VARIANT", variant)
    monkeypatch.setenv("BENCH_REDIS_URL", "redis://127.0.0.1:1/0")  # never reached
    monkeypatch.delenv("BENCH_FLOOR_POOL_SIZE", raising=False)

    async def start() -> None:
        asgi = bench_app.create()
        async with asgi.router.lifespan_context(asgi):
            pass

    with pytest.raises(RuntimeError, match="BENCH_FLOOR_POOL_SIZE"):
        await start()


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param("floor_pg", marks=pytest.mark.postgres),
        pytest.param("floor_redis", marks=pytest.mark.redis),
        pytest.param("floor_mariadb", marks=pytest.mark.mariadb),
    ],
)
async def test_a_floor_opens_one_connection_per_load_connection_at_start(
    variant: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    if variant == "floor_pg":
        url = request.getfixturevalue("pg_url").replace("postgresql+asyncpg://", "postgresql://")
        monkeypatch.setenv("BENCH_PG_URL", url)
    elif variant == "floor_redis":
        url = request.getfixturevalue("redis_url")
        monkeypatch.setenv("BENCH_REDIS_URL", url)
    else:
        url = request.getfixturevalue("mariadb_url")
        monkeypatch.setenv("BENCH_MARIADB_URL", url)
    port = make_url(url).port
    assert port is not None
    monkeypatch.setenv("BENCH_VARIANT", variant)
    monkeypatch.setenv("BENCH_FLOOR_POOL_SIZE", "5")
    before = open_connections(os.getpid(), port)
    asgi = bench_app.create()
    async with asgi.router.lifespan_context(asgi):
        # Before any request: a floor that connects on demand would still hold none.
        assert open_connections(os.getpid(), port) - before == 5
    assert open_connections(os.getpid(), port) == before
