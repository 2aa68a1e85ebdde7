"""Store-level A/B, no HTTP: SQLStore's hot path against raw asyncpg on the same statements.

``python -m bench.store_floor`` — claim+complete pairs (fresh) and replay claims, 32
concurrent tasks, alternating rounds; prints ops/s. The store keeps its default
configuration; raw asyncpg gets one pool connection per task, with no reset on
release (:func:`bench.app.floor_pool`). Isolates what the store adds over the driver
(the HTTP benchmark adds the middleware).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

from asgi_idempotency import SQLStore
from asgi_idempotency.core.lifecycle import claim
from asgi_idempotency.stores.base import StoredResponse
from asgi_idempotency.stores.sql.statements import PG
from bench.app import floor_pool

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


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/bench_idem")
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--pool", type=int, help="ours' pool_size (default: the store's default)")
    ap.add_argument("--engine", default="", help='pool settings "max_overflow,pool_timeout"')
    args = ap.parse_args()
    url = args.pg.replace("postgresql://", "postgresql+asyncpg://")
    if args.engine:  # "overflow,timeout": an engine built here, to compare pool settings
        from sqlalchemy.ext.asyncio import create_async_engine

        overflow, timeout = args.engine.split(",")
        engine = create_async_engine(
            url,
            pool_size=args.pool or 10,
            max_overflow=int(overflow),
            pool_timeout=None if timeout == "none" else float(timeout),
            connect_args={"command_timeout": 5},
        )
        store = SQLStore(engine)
    else:
        store = SQLStore(url) if args.pool is None else SQLStore(url, pool_size=args.pool)
    await store.create_all()
    pool = await floor_pool(args.pg, args.concurrency)
    claim_sql, complete_sql = PG["claim"].sql, PG["complete"].sql
    run = uuid.uuid4().hex[:8]
    await claim(store, f"{run}-r", "h", "t", now=NOW, lease=LEASE, ttl=TTL)
    await store.complete(f"{run}-r", "t", RESPONSE, now=NOW, ttl=TTL)

    async def ours_fresh(i: int) -> None:
        key, token = f"{run}-o-{i}-{uuid.uuid4().hex}", uuid.uuid4().hex
        await claim(store, key, "h", token, now=NOW, lease=LEASE, ttl=TTL)
        await store.complete(key, token, RESPONSE, now=NOW, ttl=TTL)

    async def raw_fresh(i: int) -> None:
        key, token = f"{run}-f-{i}-{uuid.uuid4().hex}", uuid.uuid4().hex
        async with pool.acquire() as c:
            await c.fetchrow(claim_sql, key, "h", token, NOW, LEASE, TTL)
        async with pool.acquire() as c:
            await c.execute(complete_sql, TTL, 201, HEADERS, RESPONSE.body, key, token)

    async def ours_replay(i: int) -> None:
        await claim(store, f"{run}-r", "h", "t2", now=NOW, lease=LEASE, ttl=TTL)

    async def raw_replay(i: int) -> None:
        async with pool.acquire() as c:
            await c.fetchrow(claim_sql, f"{run}-r", "h", "t2", NOW, LEASE, TTL)

    pairs = {"fresh": (ours_fresh, raw_fresh), "replay": (ours_replay, raw_replay)}
    results: dict[str, list[float]] = {}
    for ours, raw in pairs.values():  # warm both
        await measure(ours, 200, args.concurrency)
        await measure(raw, 200, args.concurrency)
    for rnd in range(args.rounds):
        for name, (ours, raw) in pairs.items():
            order = (
                [("ours", ours), ("raw", raw)] if rnd % 2 == 0 else [("raw", raw), ("ours", ours)]
            )
            for label, op in order:
                results.setdefault(f"{name} {label}", []).append(
                    await measure(op, args.n, args.concurrency)
                )
    for name in pairs:
        o, r = statistics.median(results[f"{name} ours"]), statistics.median(results[f"{name} raw"])
        print(
            f"{name:7} SQLStore {o:7.0f}/s   raw asyncpg {r:7.0f}/s   ratio {o / r:.2f}x   "
            f"rounds ours {[round(x) for x in results[f'{name} ours']]} "
            f"raw {[round(x) for x in results[f'{name} raw']]}"
        )
    await pool.close()
    await store.close()
    if args.engine:
        await store.engine.dispose()


if __name__ == "__main__":
    import uvloop

    uvloop.run(main())
