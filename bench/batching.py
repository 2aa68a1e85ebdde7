"""Issue #14's Postgres targets in one command: ``python -m bench.batching``.

Two parts, each interleaved (every round runs every variant, in rotated order, so
machine drift touches all alike; medians of rounds, ratios as medians of per-round
ratios):

1. **Store level** (no HTTP): claim + complete pairs on fresh keys from 32 concurrent
   tasks, and the pair's latency one at a time, for

   - ``batched``: ``SQLStore(batching=True)`` through :func:`lifecycle.claim`;
   - ``per-request``: ``SQLStore(batching=False)`` (one statement per operation);
   - ``floor``: raw asyncpg, the same two one-row statements, a pool with one
     connection per task and no reset on release: the least a per-request guard does.

   It also reports operations per statement of the batched store.

2. **HTTP level**: the refund app (``bench/app.py``) served by uvicorn in the variants
   ``memory``, ``postgres_unbatched`` (per request), ``postgres_batched`` and ``floor_pg``
   (raw asyncpg, one pool connection per wrk connection), driven by wrk (``bench/harness.py``) at 32
   connections (fresh, replay, mix) and at 1 connection (fresh, for p50).

Then PASS/FAIL per target of issue #14 (Postgres part). ``--store-only`` /
``--http-only`` run one part; ``--json PATH`` writes everything measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench.harness import log

NOW = datetime.now(UTC)
LEASE, TTL = timedelta(seconds=30), timedelta(days=1)
US = timedelta(microseconds=1)
HEADERS = b'[["content-type","application/json"]]'
BODY = b'{"refund_id":"x"}'

Op = Callable[[], Awaitable[None]]


# ---------------------------------------------------------------------------------------
# Store level.


async def _load(op: Op, *, concurrency: int, seconds: float) -> dict[str, float]:
    """``concurrency`` tasks run ``op`` back to back for ``seconds``: ops/s and latency."""
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        while (start := time.perf_counter()) < deadline:
            await op()
            latencies.append(time.perf_counter() - start)

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - began
    latencies.sort()
    return {
        "ops_s": len(latencies) / elapsed,
        "p50_ms": latencies[len(latencies) // 2] * 1000,
        "p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000,
    }


async def store_level(
    pg_url: str, *, rounds: int, seconds: float, concurrency: int
) -> dict[str, Any]:
    import asyncpg

    from asgi_idempotency import SQLStore
    from asgi_idempotency.core import lifecycle
    from asgi_idempotency.stores.base import StoredResponse
    from asgi_idempotency.stores.sql.postgres_batched import BatchingPostgresDriver
    from asgi_idempotency.stores.sql.statements import PG
    from bench.app import floor_pool

    url = pg_url.replace("postgresql://", "postgresql+asyncpg://", 1)
    batched = SQLStore(url, batching=True)
    per_request = SQLStore(url, batching=False)
    await batched.create_all()
    pool: asyncpg.Pool = await floor_pool(pg_url, concurrency)
    response = StoredResponse(201, ((b"content-type", b"application/json"),), BODY)
    run = uuid.uuid4().hex[:8]
    counter = iter(range(1 << 62))
    claim_stmt, complete_stmt = PG["claim"], PG["complete"]

    def pair(store: SQLStore) -> Op:
        async def op() -> None:
            key, token = f"{run}{next(counter):056d}", uuid.uuid4().hex
            now = datetime.now(UTC)
            await lifecycle.claim(store, key, "h", token, now=now, lease=LEASE, ttl=TTL)
            await store.complete(key, token, response, now=now, ttl=TTL)

        return op

    async def floor_op() -> None:
        key, token = f"{run}{next(counter):056d}", uuid.uuid4().hex
        claim_args = claim_stmt.args(
            {"key": key, "request_hash": "h", "token": token,
             "lease_us": LEASE // US, "ttl_us": TTL // US}
        )  # fmt: skip
        complete_args = complete_stmt.args(
            {"where_key": key, "where_token": token, "ttl_us": TTL // US,
             "response_status": 201, "response_headers": HEADERS, "response_body": BODY}
        )  # fmt: skip
        async with pool.acquire() as c:
            await c.fetchrow(claim_stmt.sql, *claim_args)
        async with pool.acquire() as c:
            await c.execute(complete_stmt.sql, *complete_args)

    variants: dict[str, Op] = {
        "batched": pair(batched),
        "per-request": pair(per_request),
        "floor": floor_op,
    }
    results: dict[str, dict[str, list[dict[str, float]]]] = {"c32": {}, "c1": {}}
    try:
        for op in variants.values():  # warm-up: connections, prepared statements
            await _load(op, concurrency=concurrency, seconds=0.5)
        for rnd in range(rounds):
            names = list(variants)
            shift = rnd % len(names)
            order = names[shift:] + names[:shift]
            if rnd % 2:
                order.reverse()
            for name in order:
                for cell, conc in (("c32", concurrency), ("c1", 1)):
                    r = await _load(variants[name], concurrency=conc, seconds=seconds)
                    results[cell].setdefault(name, []).append(r)
                    log(f"store round {rnd + 1}/{rounds} {cell:3} {name:11} "
                        f"{r['ops_s']:7.0f} pairs/s  p50 {r['p50_ms']:.3f} ms  "
                        f"p99 {r['p99_ms']:.3f} ms")  # fmt: skip
                for attempt in range(20):  # a shared server may be out of connections
                    try:
                        await _vacuum(pg_url)
                        break
                    except asyncpg.TooManyConnectionsError:
                        if attempt == 19:
                            raise
                        await asyncio.sleep(1)
        driver = batched._driver
        assert isinstance(driver, BatchingPostgresDriver)
        per_statement = {kind: s.per_statement for kind, s in driver.stats.items()}
    finally:
        await pool.close()
        await batched.close()
        await per_request.close()
    return {"cells": results, "per_statement": per_statement}


async def _vacuum(pg_url: str) -> None:
    """Untimed, between variants: keep one variant's dead rows off the next one's clock."""
    import asyncpg

    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute("VACUUM idempotency_records")
    finally:
        await conn.close()


def _paired(cells: dict[str, list[dict[str, float]]], a: str, b: str, key: str) -> float:
    pairs = zip((r[key] for r in cells[a]), (r[key] for r in cells[b]), strict=True)
    return float(statistics.median(x / y for x, y in pairs))


def _spread(values: list[float]) -> str:
    return f"{min(values):.0f}-{max(values):.0f}"


def report_store(store: dict[str, Any]) -> list[tuple[str, bool, str]]:
    c32, c1 = store["cells"]["c32"], store["cells"]["c1"]
    log("\nStore level: claim + complete pairs, fresh keys")
    log(f"  {'variant':12} {'pairs/s (32)':>12} {'spread':>13} {'p99 ms (32)':>11} "
        f"{'p50 ms (1)':>10}")  # fmt: skip
    for name in c32:
        rates = [r["ops_s"] for r in c32[name]]
        log(f"  {name:12} {statistics.median(rates):12.0f} {_spread(rates):>13} "
            f"{statistics.median(r['p99_ms'] for r in c32[name]):11.2f} "
            f"{statistics.median(r['p50_ms'] for r in c1[name]):10.3f}")  # fmt: skip
    per = store["per_statement"]
    log("  batched, operations per statement (whole run): "
        + ", ".join(f"{k} {v:.1f}" for k, v in per.items()))  # fmt: skip
    checks = []
    r = _paired(c32, "batched", "floor", "ops_s")
    checks.append(("store: batched pairs/s >= 1.3x raw-asyncpg floor (32)", r >= 1.3, f"{r:.2f}x"))
    r = _paired(c32, "batched", "per-request", "ops_s")
    checks.append(("store: batched pairs/s >= per-request (32)", r >= 1.0, f"{r:.2f}x"))
    r = _paired(c1, "batched", "floor", "p50_ms")
    checks.append(("store: batched p50 <= 1.1x floor (1 at a time)", r <= 1.1, f"{r:.2f}x"))
    r = _paired(c1, "batched", "per-request", "p50_ms")
    checks.append(("store: batched p50 <= 1.1x per-request (1)", r <= 1.1, f"{r:.2f}x"))
    return checks


# ---------------------------------------------------------------------------------------
# HTTP level: the existing harness, with the batched store.

HTTP_VARIANTS = ["memory", "postgres_unbatched", "postgres_batched", "floor_pg"]
HTTP_WORKLOADS = ["fresh", "replay", "mix"]


def http_level(pg_url: str, *, rounds: int, duration: int, connections: int) -> dict[str, Any]:
    from bench.harness import ensure_wrk, prepare_postgres, run_wrk, start_server
    from bench.run import settle_postgres, summarize

    wrk = ensure_wrk()
    asyncio.run(prepare_postgres(pg_url.rsplit("/", 1)[0] + "/postgres", pg_url))
    tmp = Path(tempfile.mkdtemp(prefix="bench_batching_"))
    # The fair floor: one pool connection per load connection.
    env = {
        "BENCH_PG_URL": pg_url,
        "BENCH_GC_FREEZE": "1",
        "BENCH_FLOOR_POOL_SIZE": str(connections),
    }
    cells: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        servers = {v: stack.enter_context(start_server(v, env, tmp)) for v in HTTP_VARIANTS}
        for server in servers.values():
            run_wrk(wrk, server, "mix", duration=1, connections=connections, threads=1)
        plan = [(w, connections) for w in HTTP_WORKLOADS] + [("fresh", 1)]
        for rnd in range(rounds):
            for workload, conns in plan:
                shift = (rnd + HTTP_WORKLOADS.index(workload)) % len(HTTP_VARIANTS)
                order = HTTP_VARIANTS[shift:] + HTTP_VARIANTS[:shift]
                if rnd % 2:
                    order.reverse()
                name = workload if conns == connections else f"{workload}-c{conns}"
                for variant in order:
                    if conns == 1 and variant == "memory":
                        continue
                    r = run_wrk(
                        wrk, servers[variant], workload,
                        duration=duration, connections=conns, threads=1,
                    )  # fmt: skip
                    cells.setdefault((name, variant), []).append(r)
                    if variant != "memory":
                        _retry(lambda: asyncio.run(settle_postgres(pg_url)))
                    log(f"http round {rnd + 1}/{rounds} {name:9} {variant:10} "
                        f"{r['rps']:7.0f} req/s  p50 {r['p50_us'] / 1000:6.2f} ms  "
                        f"p99 {r['p99_us'] / 1000:6.2f} ms")  # fmt: skip
    p50_c1 = {v: [r["p50_us"] / 1000 for r in cells[("fresh-c1", v)]] for v in HTTP_VARIANTS[1:]}
    return {"table": summarize(cells), "p50_c1_rounds_ms": p50_c1}


def _retry(step: Callable[[], None], attempts: int = 20) -> None:
    """Run an untimed step again while Postgres is out of connections (a shared server)."""
    import asyncpg

    for attempt in range(attempts):
        try:
            step()
            return
        except asyncpg.TooManyConnectionsError:
            if attempt == attempts - 1:
                raise
            log("Postgres has no connection to spare; settling again in 1 s")
            time.sleep(1)


def report_http(http: dict[str, Any], connections: int) -> list[tuple[str, bool, str]]:
    from bench.run import paired_ratio

    table = http["table"]
    log(f"\nHTTP level (uvicorn, 1 worker; wrk -t1 -c{connections}, fresh also at -c1)")
    log(f"  {'workload':9} {'variant':11} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7}  rounds")
    for workload, row in table.items():
        for variant, c in row.items():
            log(f"  {workload:9} {variant:11} {c['rps']:7.0f} {c['p50_ms']:7.2f} "
                f"{c['p99_ms']:7.2f}  {c['rounds']}")  # fmt: skip

    def ratio(workload: str, a: str, b: str, key: str = "rounds") -> float:
        return paired_ratio(table, workload, a, b, key)

    checks = []
    r = ratio("fresh", "postgres_batched", "memory")
    checks.append(("http: Postgres fresh >= 0.9x ours on memory", r >= 0.9, f"{r:.2f}x"))
    r = ratio("fresh", "postgres_batched", "floor_pg")
    checks.append(("http: Postgres fresh >= 1.3x raw-asyncpg floor", r >= 1.3, f"{r:.2f}x"))
    r = ratio("replay", "postgres_batched", "floor_pg")
    checks.append(("http: Postgres replay >= 1.0x raw-asyncpg floor", r >= 1.0, f"{r:.2f}x"))
    for workload in HTTP_WORKLOADS:
        r = ratio(workload, "postgres_batched", "floor_pg", "p99_rounds_ms")
        checks.append((f"http: Postgres {workload} p99 <= floor's (c{connections})", r <= 1.0,
                       f"{r:.2f}x"))  # fmt: skip
    p50 = http["p50_c1_rounds_ms"]
    r = float(
        statistics.median(
            a / b for a, b in zip(p50["postgres_batched"], p50["floor_pg"], strict=True)
        )
    )
    checks.append(("http: Postgres p50 at 1 connection <= 1.1x floor's", r <= 1.1, f"{r:.2f}x"))
    # Not one of the targets: batching itself adds nothing one at a time.
    r = float(
        statistics.median(
            a / b for a, b in zip(p50["postgres_batched"], p50["postgres_unbatched"], strict=True)
        )
    )
    checks.append(("http: batched p50 at 1 connection <= 1.1x per-request's", r <= 1.1,
                   f"{r:.2f}x"))  # fmt: skip
    return checks


# ---------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--pg",
        default=os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/bench_idem"),
    )
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--seconds", type=float, default=3.0, help="per store-level cell (3)")
    ap.add_argument("--duration", type=int, default=5, help="seconds per HTTP cell (5)")
    ap.add_argument("--connections", type=int, default=32, help="concurrency (32)")
    ap.add_argument("--store-only", action="store_true")
    ap.add_argument("--http-only", action="store_true")
    ap.add_argument("--json", type=Path, help="write what was measured to this file")
    args = ap.parse_args()

    from bench.harness import prepare_postgres
    from bench.run import machine

    record: dict[str, Any] = {"date": datetime.now(UTC).isoformat(), "machine": machine()}
    checks: list[tuple[str, bool, str]] = []
    if not args.http_only:
        import uvloop

        asyncio.run(prepare_postgres(args.pg.rsplit("/", 1)[0] + "/postgres", args.pg))
        store = uvloop.run(
            store_level(
                args.pg, rounds=args.rounds, seconds=args.seconds, concurrency=args.connections
            )
        )
        record["store"] = store
        checks += report_store(store)
    if not args.store_only:
        http = http_level(
            args.pg, rounds=args.rounds, duration=args.duration, connections=args.connections
        )
        record["http"] = http
        checks += report_http(http, args.connections)
    log(f"\n{record['date']} on {record['machine']}; {args.rounds} interleaved rounds")
    for name, ok, value in checks:
        log(f"{'PASS' if ok else 'FAIL'}  {name:56} {value}")
    record["targets"] = [{"target": n, "pass": ok, "value": v} for n, ok, v in checks]
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
