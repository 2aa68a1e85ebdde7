"""Effects counted in Postgres, in a table every consumer process writes to.

Each test names its run (its queue or stream name); rows of other runs are never read.
"""

from __future__ import annotations

import asyncio
import time

import asyncpg


def dsn(url: str) -> str:
    """asyncpg's DSN for a ``postgresql+asyncpg`` URL."""
    return url.replace("postgresql+asyncpg://", "postgresql://", 1)


_TABLE = (
    "CREATE TABLE IF NOT EXISTS broker_effects "
    "(run text NOT NULL, kind text NOT NULL, consumer text NOT NULL)"
)


async def ensure_table(url: str) -> None:
    """The effects table, for a consumer that writes its effect through the guard's session."""
    conn = await asyncpg.connect(dsn(url))
    try:
        await conn.execute(_TABLE)
    finally:
        await conn.close()


async def record(url: str, run: str, kind: str, consumer: str) -> None:
    conn = await asyncpg.connect(dsn(url))
    try:
        await conn.execute(_TABLE)
        await conn.execute(
            "INSERT INTO broker_effects (run, kind, consumer) VALUES ($1, $2, $3)",
            run, kind, consumer,
        )  # fmt: skip
    finally:
        await conn.close()


async def counted(url: str, run: str) -> dict[str, int]:
    """How many rows of each kind ``run`` has written."""
    conn = await asyncpg.connect(dsn(url))
    try:
        exists = await conn.fetchval("SELECT to_regclass('broker_effects') IS NOT NULL")
        if not exists:
            return {}
        rows = await conn.fetch(
            "SELECT kind, count(*) AS n FROM broker_effects WHERE run = $1 GROUP BY kind", run
        )
        return {row["kind"]: row["n"] for row in rows}
    finally:
        await conn.close()


async def who(url: str, run: str, kind: str) -> list[str]:
    """The consumers that wrote a row of ``kind`` for ``run``, sorted."""
    conn = await asyncpg.connect(dsn(url))
    try:
        rows = await conn.fetch(
            "SELECT consumer FROM broker_effects WHERE run = $1 AND kind = $2 ORDER BY 1",
            run, kind,
        )  # fmt: skip
        return [row["consumer"] for row in rows]
    finally:
        await conn.close()


async def until(url: str, run: str, kind: str, n: int, within: float = 60.0) -> dict[str, int]:
    """The counts of ``run`` once ``kind`` has ``n`` rows, or after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        got = await counted(url, run)
        if got.get(kind, 0) >= n or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.1)
