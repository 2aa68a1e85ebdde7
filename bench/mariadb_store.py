"""Store-level A/B on MariaDB/MySQL, no HTTP: SQLStore against raw asyncmy, two protocols.

``python -m bench.mariadb_store [--url mariadb+asyncmy://root@127.0.0.1:3306/bench_idem]``
(the database must exist; the table is created). Claim+complete pairs on fresh keys,
``--concurrency`` tasks, alternating rounds; prints pairs/s for

- ``ours``: ``SQLStore`` in its default configuration (the lifecycle's claim, then
  complete), as the middleware runs it;
- ``raw prepared``: the same two statements as asyncmy server-side prepared statements
  on ``--concurrency`` autocommit connections, the floor for what the store does;
- ``raw text``: the same on asyncmy's text protocol (client-side escaping), the
  alternative the store's driver chose against.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncmy
from sqlalchemy.engine import make_url

from asgi_idempotency import SQLStore
from asgi_idempotency.core.lifecycle import claim
from asgi_idempotency.stores.base import StoredResponse
from asgi_idempotency.stores.sql.statements import MYSQL

NOW = datetime.now(UTC)
LEASE, TTL = timedelta(seconds=30), timedelta(days=1)
RESPONSE = StoredResponse(201, ((b"content-type", b"application/json"),), b'{"refund_id":"x"}')
HEADERS = b'[["content-type","application/json"]]'


async def measure(op: Callable[[int], Awaitable[None]], n: int, concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            await op(i)

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return n / (time.perf_counter() - start)


async def ours(url: str, n: int, concurrency: int) -> float:
    store = SQLStore(url)
    try:

        async def pair(_: int) -> None:
            key, token = os.urandom(32).hex(), os.urandom(16).hex()
            won = await claim(store, key, "h" * 64, token, now=NOW, lease=LEASE,
                              ttl=TTL)  # fmt: skip
            assert won.owned
            assert await store.complete(key, token, RESPONSE, now=NOW, ttl=TTL)

        return await measure(pair, n, concurrency)
    finally:
        await store.close()


async def raw(url: str, n: int, concurrency: int, *, prepared: bool) -> float:
    u = make_url(url)
    conns: list[Any] = [
        await asyncmy.connect(host=u.host, port=u.port or 3306, user=u.username,
                              password=u.password or "", database=u.database, autocommit=True)
        for _ in range(concurrency)
    ]  # fmt: skip
    us = timedelta(microseconds=1)
    durations = {"lease_us": LEASE // us, "ttl_us": TTL // us}  # the server's clock decides
    claim_sql, complete_sql = MYSQL["claim"].sql, MYSQL["complete"].sql
    free: asyncio.Queue[tuple[Any, Any, Any]] = asyncio.Queue()
    for conn in conns:
        if prepared:
            free.put_nowait((conn, await conn.prepare(claim_sql), await conn.prepare(complete_sql)))
        else:
            free.put_nowait((conn, None, None))

    async def pair(_: int) -> None:
        key, token = os.urandom(32).hex(), os.urandom(16).hex()
        claim = {"key": key, "request_hash": "h" * 64, "token": token, **durations}
        ins = MYSQL["claim"].args(claim)
        done = MYSQL["complete"].args({
            "where_key": key, "where_token": token, "ttl_us": durations["ttl_us"],
            "response_status": 201, "response_headers": HEADERS, "response_body": RESPONSE.body,
        })  # fmt: skip
        conn, claim_stmt, complete_stmt = await free.get()
        try:
            if prepared:
                assert (await claim_stmt.execute(ins)).affected_rows == 1
                assert (await complete_stmt.execute(done)).affected_rows == 1
            else:
                async with conn.cursor() as cur:
                    assert await cur.execute(claim_sql.replace("?", "%s"), ins) == 1
                    assert await cur.execute(complete_sql.replace("?", "%s"), done) == 1
        finally:
            free.put_nowait((conn, claim_stmt, complete_stmt))

    try:
        return await measure(pair, n, concurrency)
    finally:
        for conn in conns:
            await conn.ensure_closed()


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="mariadb+asyncmy://root@127.0.0.1:3306/bench_idem")
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=32)
    args = ap.parse_args()
    setup = SQLStore(args.url)
    await setup.create_all()
    await setup.close()
    variants: dict[str, Callable[[], Awaitable[float]]] = {
        "ours": lambda: ours(args.url, args.n, args.concurrency),
        "raw prepared": lambda: raw(args.url, args.n, args.concurrency, prepared=True),
        "raw text": lambda: raw(args.url, args.n, args.concurrency, prepared=False),
    }
    results: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(args.rounds):
        names = list(variants) if round_ % 2 == 0 else list(reversed(variants))
        for name in names:
            results[name].append(await variants[name]())
    for name, rates in results.items():
        print(f"{name:<14} {statistics.median(rates):>8,.0f} pairs/s  (rounds: "
              + ", ".join(f"{r:,.0f}" for r in rates) + ")")  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
