"""The idempotency benchmark: one command, ``python -m bench.run`` (README: "Performance").

Serves the refund app (``bench/app.py``) over real HTTP (uvicorn, uvloop, httptools,
one worker, loopback) in every variant at once, then drives them with wrk in
alternating order, round after round, so that machine drift touches all alike. Each
floor holds one store connection per wrk connection, checked from outside the app
after warm-up (the run refuses otherwise); ours keep their defaults. Prints req/s,
p50, p99 and the app process's CPU per request for each variant and workload, with
ratios to its floor and to no guard; then each store against its own floor (fresh
and replay: req/s, p99, CPU), the round trips per outcome counted on the Postgres
wire, and PASS/FAIL per target; writes ``bench/results/<stamp>.json``, ``latest.json`` and
``chart.png``.

Bounded: by default 12 variants x 3 workloads x 5 rounds x 5 s, plus the Postgres
variants at one connection, about 20 minutes; ``--rounds``, ``--duration`` and
``--variants`` shorten it. Needs Postgres (``--pg``), MariaDB (``--mariadb``; the
benchmark creates and drops its own database on both) and ``redis-server`` on PATH
(a throwaway one on a free loopback port) or ``BENCH_REDIS_URL``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from asgi_idempotency.ops._serve import UvicornProcess
from bench import peers
from bench.harness import (
    RESULTS,
    ensure_wrk,
    log,
    open_connections,
    open_files,
    postgres_processes,
    prepare_postgres,
    redis_processes,
    run_wrk,
    start_server,
)

# Postgres variants are named by configuration, not as "the default": the library's
# default can change, and a result must still say what it measured.
VARIANTS = [
    "none", "memory", "floor_memory", "postgres_batched", "postgres_unbatched", "floor_pg",
    "sqlite", "floor_sqlite", "mariadb", "floor_mariadb", "redis", "floor_redis",
]  # fmt: skip
# Run only when named in --variants: other libraries on the same redis-server
# (bench/peers.py), pip-installed on demand into the running venv, never dependencies
# of the package.
OPTIONAL = [*peers.PEERS, *peers.IDEMKIT]
POSTGRES = ("postgres_batched", "postgres_unbatched", "floor_pg", "peer_idemkit_pg")
REDIS = ("redis", "floor_redis", *peers.PEERS, "peer_idemkit_redis")
MARIADB = ("mariadb", "floor_mariadb")
WORKLOADS = ["fresh", "replay", "mix"]
# Fresh keys from one wrk connection: one request at a time, where batching must add
# no latency. Run for these variants only, in every round.
C1 = "fresh-c1"
C1_VARIANTS = ("postgres_unbatched", "postgres_batched", "floor_pg")
# The ÷floor column. The memory store's target is against no guard; its floor (the same
# minimal guard on a dict) shows how much of the gap any buffering guard pays.
FLOOR = {
    "postgres_batched": "floor_pg", "postgres_unbatched": "floor_pg", "sqlite": "floor_sqlite",
    "memory": "floor_memory", "mariadb": "floor_mariadb", "redis": "floor_redis",
    **dict.fromkeys(peers.PEERS, "floor_redis"),
    "peer_idemkit_pg": "floor_pg", "peer_idemkit_redis": "floor_redis",
}  # fmt: skip
# The stores, each against its own floor, in the report's order.
STORES = ["memory", "sqlite", "postgres_batched", "postgres_unbatched", "mariadb", "redis"]
LABELS = {
    "none": "no guard",
    "memory": "ours, memory",
    "floor_memory": "floor, dict",
    "postgres_batched": "ours, PG batched",
    "postgres_unbatched": "ours, PG unbatched",
    "floor_pg": "floor, asyncpg",
    "sqlite": "ours, SQLite",
    "floor_sqlite": "floor, aiosqlite",
    "mariadb": "ours, MariaDB",
    "floor_mariadb": "floor, asyncmy",
    "redis": "ours, Redis",
    "floor_redis": "floor, redis-py",
    **{v: f"peer, {name}" for v, name in peers.LABELS.items()},
}


# ---------------------------------------------------------------------------------------
# Setup: wrk, databases, servers.


async def settle_postgres(url: str) -> None:
    """Between cells, untimed: vacuum and checkpoint what a Postgres cell left behind.

    Otherwise autovacuum and the checkpointer clean up after a Postgres cell during the
    next cell, on the same two cores, and charge whichever variant runs next.
    """
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        await conn.execute("VACUUM idempotency_records")
        if await conn.fetchval("SELECT to_regclass('idemkit_records') IS NOT NULL"):
            await conn.execute("VACUUM idemkit_records")  # the idemkit peer's own table
        await conn.execute("CHECKPOINT")
    finally:
        await conn.close()


async def prepare_sqlite(path: str) -> None:
    from asgi_idempotency import SQLStore

    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path + suffix)
    store = SQLStore(f"sqlite+aiosqlite:///{path}")
    try:
        await store.create_all()
    finally:
        await store.close()


async def prepare_mariadb(url: str) -> None:
    """Create database ``url`` afresh on MariaDB, with the schema (and its migration head)."""
    from asgi_idempotency import SQLStore

    await _mariadb_admin(url, "DROP DATABASE IF EXISTS `{}`", "CREATE DATABASE `{}`")
    store = SQLStore(url)
    try:
        await store.create_all()
    finally:
        await store.close()


async def drop_mariadb(url: str) -> None:
    await _mariadb_admin(url, "DROP DATABASE IF EXISTS `{}`")


async def _mariadb_admin(url: str, *statements: str) -> None:
    import asyncmy
    from sqlalchemy.engine import make_url

    u = make_url(url)
    conn = await asyncmy.connect(
        host=u.host, port=u.port or 3306, user=u.username, password=u.password or "",
        autocommit=True,
    )  # fmt: skip
    try:
        async with conn.cursor() as cur:
            await cur.execute("SET sql_notes = 0")  # asyncmy logs DROP IF EXISTS's note
            for statement in statements:
                await cur.execute(statement.format(u.database))
    finally:
        await conn.ensure_closed()


def postgres_default() -> str:
    """The Postgres variant that is the library's default, read from the library."""
    from asgi_idempotency.stores.sql.postgres_batched import DIALECT

    return "postgres_batched" if DIALECT.batching else "postgres_unbatched"


def held_connections(
    servers: dict[str, UvicornProcess], env: dict[str, dict[str, str]]
) -> dict[str, int]:
    """How many connections each variant's process holds to its store, seen from
    outside the app (``/proc``): TCP connections to the store's port, or for SQLite
    the descriptors open on the database file."""
    from sqlalchemy.engine import make_url

    held: dict[str, int] = {}
    for variant, server in servers.items():
        pid, e = server.process.pid, env[variant]
        if variant in POSTGRES:
            held[variant] = open_connections(pid, make_url(e["BENCH_PG_URL"]).port or 5432)
        elif variant in MARIADB:
            held[variant] = open_connections(pid, make_url(e["BENCH_MARIADB_URL"]).port or 3306)
        elif variant in REDIS:
            held[variant] = open_connections(pid, make_url(e["BENCH_REDIS_URL"]).port or 6379)
        elif "BENCH_SQLITE_PATH" in e:
            held[variant] = open_files(pid, e["BENCH_SQLITE_PATH"])
    return held


def store_processes(variant: str, env: dict[str, str]) -> Callable[[], list[int]] | None:
    """How to list the processes of ``variant``'s store server, whose CPU per request the
    run reads beside the app's: every Postgres process, or the one redis-server; ``None``
    for the stores in the app's own process (memory, SQLite) and MariaDB (not read)."""
    from sqlalchemy.engine import make_url

    if variant in POSTGRES:
        return postgres_processes
    if variant in REDIS:
        port = make_url(env["BENCH_REDIS_URL"]).port or 6379
        return functools.partial(redis_processes, port)
    return None


def check_floor_connections(held: dict[str, int], connections: int) -> None:
    """Refuse to measure a floor that does not hold what it claims: one connection per
    load connection (SQLite: one, as SQLite has one writer at a time)."""
    expected = {"floor_pg": connections, "floor_mariadb": connections,
                "floor_redis": connections, "floor_sqlite": 1}  # fmt: skip
    wrong = {v: n for v, n in held.items() if v in expected and n != expected[v]}
    if wrong:
        sys.exit(
            "floors not holding their connections (variant: held, expected): "
            + ", ".join(f"{v}: {n}, {expected[v]}" for v, n in wrong.items())
        )


# ---------------------------------------------------------------------------------------
# Round trips, counted on the Postgres wire (pgwire.WireCounter), per outcome.


async def count_round_trips(pg_url: str, connections: int) -> dict[str, dict[str, list[list[str]]]]:
    import logging

    import httpx

    from bench import app as bench_app
    from tests.helpers.pgwire import WireCounter

    logging.getLogger("asgi_idempotency").setLevel(logging.CRITICAL)  # 409/422 are expected

    host_port = pg_url.split("@", 1)[1].split("/", 1)[0]
    host, _, port = host_port.partition(":")
    out: dict[str, dict[str, list[list[str]]]] = {}
    async with WireCounter(host, int(port or 5432)) as wire:
        proxied = pg_url.replace(host_port, f"127.0.0.1:{wire.port}") + "?ssl=disable"
        for variant in ("postgres_unbatched", "floor_pg"):
            os.environ["BENCH_VARIANT"] = variant
            os.environ["BENCH_PG_URL"] = proxied
            os.environ["BENCH_FLOOR_POOL_SIZE"] = str(connections)
            asgi = bench_app.create()
            seen: dict[str, list[list[str]]] = {}
            async with asgi.router.lifespan_context(asgi):
                transport = httpx.ASGITransport(app=asgi)
                async with httpx.AsyncClient(transport=transport, base_url="http://b") as c:

                    async def call(key: str, body: dict[str, Any], headers: bool = True) -> int:
                        h = {"Idempotency-Key": key} if headers else {}
                        r = await c.post("/orders/o-42/refunds", json=body, headers=h)
                        return r.status_code

                    for _run in ("warm", "count"):  # warm: connect, prepare
                        k = f"rt-{uuid.uuid4().hex[:8]}"
                        steps: list[tuple[str, Any]] = [
                            ("fresh", call(k, {"amount": 1})),
                            ("replay", call(k, {"amount": 1})),
                            ("mismatch 422", call(k, {"amount": 2})),
                            ("no key (unguarded)", call(k, {"amount": 1}, headers=False)),
                        ]
                        for name, coro in steps:
                            wire.reset()
                            await coro
                            await asyncio.sleep(0.05)
                            seen[name] = [rt.verbs for rt in wire.reset()]
                        slow = f"rt-slow-{uuid.uuid4().hex[:8]}"
                        first = asyncio.create_task(call(slow, {"amount": 1, "delay": 0.5}))
                        await asyncio.sleep(0.2)
                        wire.reset()
                        await call(slow, {"amount": 1, "delay": 0.5})
                        seen["in flight 409"] = [rt.verbs for rt in wire.reset()]
                        await first
                        wire.reset()
                        r = await c.get("/health")
                        assert r.status_code == 200
                        seen["GET"] = [rt.verbs for rt in wire.reset()]
            out[variant] = seen
    return out


# ---------------------------------------------------------------------------------------
# Report.


def summarize(cells: dict[tuple[str, str], list[dict[str, Any]]]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for (workload, variant), runs in cells.items():
        statuses: dict[str, int] = {}
        for r in runs:
            for k, v in r["statuses"].items():
                statuses[k] = statuses.get(k, 0) + v
        table.setdefault(workload, {})[variant] = {
            "rps": statistics.median(r["rps"] for r in runs),
            "p50_ms": statistics.median(r["p50_us"] for r in runs) / 1000,
            "p99_ms": statistics.median(r["p99_us"] for r in runs) / 1000,
            "rounds": [round(r["rps"]) for r in runs],
            "p99_rounds_ms": [r["p99_us"] / 1000 for r in runs],
            "p50_rounds_ms": [r["p50_us"] / 1000 for r in runs],
            "cpu_us": statistics.median(r["cpu_us"] for r in runs),
            "cpu_rounds_us": [r["cpu_us"] for r in runs],
            # The store server's CPU per request (Postgres, Redis), None elsewhere.
            "store_cpu_us": (
                statistics.median(r["store_cpu_us"] for r in runs)
                if all("store_cpu_us" in r for r in runs)
                else None
            ),
            "store_cpu_rounds_us": [r.get("store_cpu_us") for r in runs],
            "statuses": statuses,
            "socket_errors": sum(r["socket_errors"] for r in runs),
        }
    return table


def paired_ratio(
    table: dict[str, Any], workload: str, a: str, b: str, key: str = "rounds"
) -> float:
    """The median over rounds of a's value / b's value in the same round.

    A round runs every variant back to back, so drift between rounds cancels out of
    each round's ratio, where a ratio of medians would mix rounds.
    """
    pairs = zip(table[workload][a][key], table[workload][b][key], strict=True)
    return float(statistics.median(x / y for x, y in pairs))


def check_targets(table: dict[str, Any]) -> list[tuple[str, bool, str]]:
    checks: list[tuple[str, bool, str]] = []

    def ratio(workload: str, a: str, b: str, key: str = "rounds") -> float:
        return paired_ratio(table, workload, a, b, key)

    for workload in ("fresh", "replay"):
        r = ratio(workload, "postgres_unbatched", "floor_pg")
        checks.append((f"PG unbatched {workload}: req/s >= 0.9x floor", r >= 0.9, f"{r:.2f}x"))
    for workload in ("fresh", "replay", "mix"):
        r = ratio(workload, "postgres_unbatched", "floor_pg", "p99_rounds_ms")
        checks.append((f"PG unbatched {workload}: p99 <= 1.2x floor", r <= 1.2, f"{r:.2f}x"))
    for workload in WORKLOADS:
        r = ratio(workload, "sqlite", "floor_sqlite")
        checks.append((f"SQLite {workload}: req/s >= 0.9x aiosqlite floor", r >= 0.9, f"{r:.2f}x"))
    # Issue #14, the batched Postgres store (its c1 p50 target: python -m bench.batching).
    r = ratio("fresh", "postgres_batched", "memory")
    checks.append(("PG batched fresh: req/s >= 0.9x ours on memory", r >= 0.9, f"{r:.2f}x"))
    r = ratio("fresh", "postgres_batched", "floor_pg")
    checks.append(("PG batched fresh: req/s >= 1.3x floor", r >= 1.3, f"{r:.2f}x"))
    r = ratio("replay", "postgres_batched", "floor_pg")
    checks.append(("PG batched replay: req/s >= 1.0x floor", r >= 1.0, f"{r:.2f}x"))
    for workload in WORKLOADS:
        r = ratio(workload, "postgres_batched", "floor_pg", "p99_rounds_ms")
        checks.append((f"PG batched {workload}: p99 <= floor's", r <= 1.0, f"{r:.2f}x"))
    if {"postgres_batched", "floor_pg"} <= set(table.get(C1, {})):
        r = ratio(C1, "postgres_batched", "floor_pg", "p50_rounds_ms")
        checks.append(("PG batched p50 at 1 connection <= 1.1x floor's", r <= 1.1, f"{r:.2f}x"))
    # Restated in #14: against the same minimal guard on a dict, not against no guard
    # (below the floor of any guard that buffers and captures in Python).
    for workload in ("fresh", "mix"):
        r = ratio(workload, "memory", "floor_memory")
        checks.append((f"memory {workload}: req/s >= 0.9x dict floor", r >= 0.9, f"{r:.2f}x"))
    return checks


def check_redis(table: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """The Redis targets that ran: >= 0.9x the raw redis-py floor, >= every peer measured."""
    checks: list[tuple[str, bool, str]] = []
    for workload in ("fresh", "replay"):
        if {"redis", "floor_redis"} <= set(table.get(workload, {})):
            r = paired_ratio(table, workload, "redis", "floor_redis")
            checks.append(
                (f"Redis {workload}: req/s >= 0.9x redis-py floor", r >= 0.9, f"{r:.2f}x")
            )
        for peer in (p for p in peers.PEERS if {"redis", p} <= set(table.get(workload, {}))):
            answered = table[workload][peer]["statuses"]
            if set(answered) != {"201"}:  # not doing the workload (replays that are 422s)
                log(f"note: peer {peers.LABELS[peer]} answered {answered} to {workload}; "
                    "no target against it")  # fmt: skip
                continue
            r = paired_ratio(table, workload, "redis", peer)
            name = f"Redis {workload}: req/s >= peer {peers.LABELS[peer]}"
            checks.append((name, r >= 1.0, f"{r:.2f}x"))
    return checks


def check_fair_floors(table: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """Issue #34's target that #43 does not restate (its others, req/s and p99 against the
    fair floors and the Postgres default's CPU, are #43's too: :func:`check_issue_43`):
    Redis's app CPU per fresh request against ours on the memory store."""
    if not {"redis", "memory"} <= set(table.get("fresh", {})):
        return []
    r = paired_ratio(table, "fresh", "redis", "memory", "cpu_rounds_us")
    return [("Redis fresh: CPU/request <= 1.15x ours on memory", r <= 1.15, f"{r:.2f}x")]


# Issue #43's targets: (name, workload, ours, theirs, measure, bound, at most?). ``ours`` may
# be "pg" (the library's Postgres default, read at run time). Measures: "cpu" (the app's
# CPU per request), "srv" (the store server's), "rps", "p99".
ISSUE_43 = [
    ("guard's tax: app CPU/fresh, memory ÷ no guard", "fresh", "memory", "none", "cpu", 1.25, True),
    ("PG default: app CPU/fresh ÷ ours on memory", "fresh", "pg", "memory", "cpu", 1.15, True),
    ("PG server CPU/fresh ÷ the fair floor's", "fresh", "pg", "floor_pg", "srv", 0.6, True),
    ("PG server CPU/replay ÷ the fair floor's", "replay", "pg", "floor_pg", "srv", 0.4, True),
    ("redis-server CPU/fresh ÷ the floor's", "fresh", "redis", "floor_redis", "srv", 1.0, True),
    ("redis-server CPU/replay ÷ the floor's", "replay", "redis", "floor_redis", "srv", 1.0, True),
    ("PG default fresh: req/s ÷ fair floor", "fresh", "pg", "floor_pg", "rps", 1.3, False),
    ("PG default replay: req/s ÷ fair floor", "replay", "pg", "floor_pg", "rps", 1.0, False),
    ("Redis fresh: req/s ÷ floor", "fresh", "redis", "floor_redis", "rps", 1.3, False),
    ("Redis replay: req/s ÷ floor", "replay", "redis", "floor_redis", "rps", 1.0, False),
    ("PG default fresh: p99 ÷ floor's", "fresh", "pg", "floor_pg", "p99", 1.25, True),
    ("PG default replay: p99 ÷ floor's", "replay", "pg", "floor_pg", "p99", 1.25, True),
    ("Redis fresh: p99 ÷ floor's", "fresh", "redis", "floor_redis", "p99", 1.25, True),
    ("Redis replay: p99 ÷ floor's", "replay", "redis", "floor_redis", "p99", 1.25, True),
    ("PG default fresh: req/s ÷ idemkit on PG", "fresh", "pg", "peer_idemkit_pg", "rps", 2.0,
     False),
    ("PG default replay: req/s ÷ idemkit on PG", "replay", "pg", "peer_idemkit_pg", "rps", 2.0,
     False),
    ("Redis fresh: req/s ÷ idemkit on Redis", "fresh", "redis", "peer_idemkit_redis", "rps", 2.0,
     False),
    ("Redis replay: req/s ÷ idemkit on Redis", "replay", "redis", "peer_idemkit_redis", "rps", 2.0,
     False),
]  # fmt: skip
_MEASURES = {"cpu": "cpu_rounds_us", "srv": "store_cpu_rounds_us", "rps": "rounds",
             "p99": "p99_rounds_ms"}  # fmt: skip


def check_issue_43(table: dict[str, Any]) -> list[tuple[str, bool, str]]:
    """Issue #43's targets whose two variants both ran, each as the median of its
    per-round ratios against its bound (``≤`` for costs, ``≥`` for throughput)."""
    checks: list[tuple[str, bool, str]] = []
    default = postgres_default()
    for name, workload, ours, theirs, measure, bound, at_most in ISSUE_43:
        ours = default if ours == "pg" else ours
        cells = table.get(workload, {})
        if not {ours, theirs} <= set(cells):
            continue
        key = _MEASURES[measure]
        if None in cells[ours][key] or None in cells[theirs][key]:
            continue
        r = paired_ratio(table, workload, ours, theirs, key)
        ok = r <= bound if at_most else r >= bound
        checks.append((f"#43 {name} {'<=' if at_most else '>='} {bound}", ok, f"{r:.2f}x"))
    return checks


def print_table(table: dict[str, Any]) -> None:
    log("")
    log(f"{'workload':8} {'variant':20} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'÷floor':>7} {'÷none':>7} {'CPU µs':>7} {'srv µs':>7}  rounds (req/s)        "
        "statuses")  # fmt: skip
    for workload in (w for w in [*WORKLOADS, C1] if w in table):
        row = table[workload]
        for variant in (v for v in VARIANTS + OPTIONAL if v in row):
            c = row[variant]
            floor = FLOOR.get(variant)
            vs_floor = ""
            if floor is not None and floor in row:
                vs_floor = f"{paired_ratio(table, workload, variant, floor):.2f}x"
            vs_none = (
                f"{paired_ratio(table, workload, variant, 'none'):.2f}x" if "none" in row else ""
            )
            statuses = " ".join(f"{k}:{v}" for k, v in sorted(c["statuses"].items()))
            srv = "" if c.get("store_cpu_us") is None else f"{c['store_cpu_us']:.0f}"
            log(f"{workload:8} {LABELS[variant]:20} {c['rps']:8.0f} {c['p50_ms']:8.2f} "
                f"{c['p99_ms']:8.2f} {vs_floor:>7} {vs_none:>7} {c['cpu_us']:7.0f} {srv:>7}  "
                f"{c['rounds']!s:22} {statuses}")  # fmt: skip
        log("")


def store_report(table: dict[str, Any]) -> list[dict[str, Any]]:
    """Each store that ran against its own floor, fresh and replay: req/s, p99 and the
    app's CPU per request, ours and the floor's, each with the median of its per-round
    ratios."""
    rows = []
    for store in STORES:
        floor = FLOOR[store]
        row: dict[str, Any] = {"store": store, "floor": floor}
        for workload in ("fresh", "replay"):
            cells = table.get(workload, {})
            if not {store, floor} <= set(cells):
                break
            ours, theirs = cells[store], cells[floor]
            row[workload] = {
                "rps": ours["rps"],
                "floor_rps": theirs["rps"],
                "ratio": paired_ratio(table, workload, store, floor),
                "p99_ms": ours["p99_ms"],
                "floor_p99_ms": theirs["p99_ms"],
                "p99_ratio": paired_ratio(table, workload, store, floor, "p99_rounds_ms"),
                "cpu_us": ours["cpu_us"],
                "floor_cpu_us": theirs["cpu_us"],
                "cpu_ratio": paired_ratio(table, workload, store, floor, "cpu_rounds_us"),
            }
        else:
            rows.append(row)
    return rows


def print_store_report(rows: list[dict[str, Any]]) -> None:
    log("Each store against its own floor (medians of rounds, ours / the floor's; ÷floor:")
    log("medians of per-round ratios; CPU: the app process's utime+stime per request):")
    log(f"  {'store':20} {'floor':18} {'workload':8} {'req/s':^15}{'÷floor':>6} "
        f"{'p99 ms':^15}{'÷floor':>6} {'CPU µs':^13}{'÷floor':>6}")  # fmt: skip
    default = postgres_default()
    for row in rows:
        label = LABELS[row["store"]] + (" *" if row["store"] == default else "")
        for workload in ("fresh", "replay"):
            c = row[workload]
            rps = f"{c['rps']:6.0f} / {c['floor_rps']:<6.0f}{c['ratio']:5.2f}x"
            p99 = f"{c['p99_ms']:6.1f} / {c['floor_p99_ms']:<6.1f}{c['p99_ratio']:5.2f}x"
            cpu = f"{c['cpu_us']:5.0f} / {c['floor_cpu_us']:<5.0f}{c['cpu_ratio']:5.2f}x"
            log(f"  {label:20} {LABELS[row['floor']]:18} {workload:8} {rps} {p99} {cpu}")
    log(f"  * the library's default on Postgres ({default}, read from the library)")
    log("")


def print_round_trips(trips: dict[str, dict[str, list[list[str]]]]) -> None:
    log("Round trips per outcome on the Postgres wire, unbatched (statements in each; no BEGIN):")
    log(f"  {'outcome':20} {'ours':>4}  {'floor':>5}   ours' statements")
    for outcome, ours in trips["postgres_unbatched"].items():
        floor = trips["floor_pg"][outcome]
        stmts = " | ".join("+".join(rt) for rt in ours) or "-"
        log(f"  {outcome:20} {len(ours):>4}  {len(floor):>5}   {stmts}")
    log("")


def chart(table: dict[str, Any], path: Path, stamp: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.4), dpi=80)
    width = 0.8 / len(VARIANTS)
    colors = [plt.get_cmap("tab20")(i) for i in range(len(VARIANTS))]
    middle = (len(VARIANTS) - 1) / 2
    for i, variant in enumerate(VARIANTS):
        xs = [w + (i - middle) * width for w in range(len(WORKLOADS))]
        ys = [table[w][variant]["rps"] for w in WORKLOADS]
        ax.bar(xs, ys, width, label=LABELS[variant], color=colors[i])
    ax.set_xticks(range(len(WORKLOADS)), ["fresh keys", "replays", "mix"])
    ax.set_ylabel("requests/s (median of rounds)")
    ax.set_title(f"asgi-idempotency, uvicorn 1 worker, wrk on loopback ({stamp})", fontsize=9)
    top = max(table[w][v]["rps"] for w in WORKLOADS for v in VARIANTS)
    ax.set_ylim(0, top * 1.3)  # room for the legend above the bars
    ax.legend(fontsize=7, ncol=6, loc="upper center")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def machine() -> str:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    system = f"{platform.system()} {platform.release()}"
    return f"{os.cpu_count()} CPU {cpu}, {system}, Python {platform.python_version()}"


# ---------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=int, default=5, help="seconds per cell (default 5)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    ap.add_argument("--connections", type=int, default=32, help="wrk connections (default 32)")
    ap.add_argument("--threads", type=int, default=1, help="wrk threads (default 1: 2 cores)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument(
        "--pg",
        default=os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/bench_idem"),
    )
    ap.add_argument(
        "--mariadb",
        default=os.environ.get(
            "BENCH_MARIADB_URL", "mariadb+asyncmy://root@127.0.0.1:3306/bench_idem"
        ),
    )
    ap.add_argument("--scale", action="store_true", help="also run the 10M-row scale checks (slow)")
    ap.add_argument("--no-chart", action="store_true")
    ap.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="keep start-up objects in the GC's scans (default: gc.freeze() in every variant)",
    )
    args = ap.parse_args()
    variants = args.variants.split(",")
    workloads = args.workloads.split(",")

    unknown = [v for v in variants if v not in VARIANTS + OPTIONAL]
    if unknown:
        sys.exit(f"unknown variants {unknown}; known: {', '.join(VARIANTS + OPTIONAL)}")
    peers.ensure_installed(variants)
    wrk = ensure_wrk()
    admin_url = args.pg.rsplit("/", 1)[0] + "/postgres"
    asyncio.run(prepare_postgres(admin_url, args.pg))
    if set(variants) & set(MARIADB):
        asyncio.run(prepare_mariadb(args.mariadb))
    tmp = Path(tempfile.mkdtemp(prefix="bench_idem_"))
    env = {
        "BENCH_PG_URL": args.pg,
        "BENCH_MARIADB_URL": args.mariadb,
        "BENCH_GC_FREEZE": "0" if args.no_gc_freeze else "1",
        # The fair floor (issue #14): one pool connection per load connection.
        "BENCH_FLOOR_POOL_SIZE": str(args.connections),
    }
    servers: dict[str, UvicornProcess] = {}
    server_env: dict[str, dict[str, str]] = {}
    with contextlib.ExitStack() as stack:
        if set(variants) & set(REDIS) and "BENCH_REDIS_URL" not in os.environ:
            from bench.redis_server import redis_server

            env["BENCH_REDIS_URL"] = stack.enter_context(redis_server(tmp / "redis"))
        elif "BENCH_REDIS_URL" in os.environ:
            env["BENCH_REDIS_URL"] = os.environ["BENCH_REDIS_URL"]
        for variant in variants:
            if variant in ("sqlite", "floor_sqlite"):
                path = str(tmp / f"{variant}.db")
                asyncio.run(prepare_sqlite(path))
                env_v = {**env, "BENCH_SQLITE_PATH": path}
            else:
                env_v = env
            servers[variant] = stack.enter_context(start_server(variant, env_v, tmp))
            server_env[variant] = env_v
        up = ", ".join(f"{v} {s.base_url}" for v, s in servers.items())
        log(f"servers up: {up}; logs in {tmp}")
        for server in servers.values():  # warm-up: connections, prepared statements, caches
            run_wrk(
                wrk, server, "mix", duration=1, connections=args.connections, threads=args.threads
            )
        held = held_connections(servers, server_env)
        log("connections to the store after warm-up: "
            + ", ".join(f"{v} {n}" for v, n in held.items()))  # fmt: skip
        check_floor_connections(held, args.connections)

        cells: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for rnd in range(args.rounds):
            for workload in workloads:
                # Rotate, and reverse every other round, so no variant always runs first
                # or always follows the same one.
                shift = (rnd + workloads.index(workload)) % len(variants)
                order = variants[shift:] + variants[:shift]
                if rnd % 2:
                    order.reverse()
                for variant in order:
                    result = run_wrk(
                        wrk, servers[variant], workload,
                        duration=args.duration, connections=args.connections, threads=args.threads,
                        store=store_processes(variant, server_env[variant]),
                    )  # fmt: skip
                    cells.setdefault((workload, variant), []).append(result)
                    if variant in POSTGRES:
                        asyncio.run(settle_postgres(args.pg))
                    log(f"round {rnd + 1}/{args.rounds} {workload:6} {variant:18} "
                        f"{result['rps']:7.0f} req/s  p50 {result['p50_us'] / 1000:6.2f} ms  "
                        f"p99 {result['p99_us'] / 1000:6.2f} ms  "
                        f"CPU {result['cpu_us']:5.0f} µs/req")  # fmt: skip
            c1 = [v for v in C1_VARIANTS if v in variants]
            if "fresh" in workloads:
                for variant in c1 if rnd % 2 == 0 else c1[::-1]:
                    result = run_wrk(
                        wrk, servers[variant], "fresh",
                        duration=args.duration, connections=1, threads=1,
                        store=store_processes(variant, server_env[variant]),
                    )  # fmt: skip
                    cells.setdefault((C1, variant), []).append(result)
                    asyncio.run(settle_postgres(args.pg))
                    log(
                        f"round {rnd + 1}/{args.rounds} {C1} {variant:18} "
                        f"{result['rps']:7.0f} req/s  p50 {result['p50_us'] / 1000:6.2f} ms"
                    )

    if set(variants) & set(MARIADB):
        asyncio.run(drop_mariadb(args.mariadb))
    table = summarize(cells)
    trips = asyncio.run(count_round_trips(args.pg, args.connections))
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    log(f"\n{stamp} on {machine()}")
    log(
        f"wrk -t{args.threads} -c{args.connections}, {args.duration:g} s per cell, "
        f"{args.rounds} alternating rounds; medians, and ratios as medians of per-round ratios"
    )
    print_table(table)
    stores = store_report(table)
    print_store_report(stores)
    print_round_trips(trips)

    complete = all(v in variants for v in VARIANTS) and all(w in workloads for w in WORKLOADS)
    checks = (check_targets(table) if complete else []) + check_redis(table)
    checks += check_fair_floors(table)
    checks += check_issue_43(table)
    for name, ok, value in checks:
        log(f"{'PASS' if ok else 'FAIL'}  {name:60} {value}")
    budget_ok = all(
        len(trips["postgres_unbatched"][o]) == n
        for o, n in {
            "fresh": 2,
            "replay": 1,
            "mismatch 422": 1,
            "in flight 409": 1,
            "no key (unguarded)": 0,
            "GET": 0,
        }.items()
    ) and not any(
        v in ("BEGIN", "COMMIT")
        for rts in trips["postgres_unbatched"].values()
        for rt in rts
        for v in rt
    )
    budget = "PG unbatched round trips: 2 / 1 / 1 / 1 / 0, no BEGIN"
    log(f"{'PASS' if budget_ok else 'FAIL'}  {budget:48}")

    scale: dict[str, Any] | None = None
    if args.scale:
        from bench import scale as scale_mod

        scale = scale_mod.run(args.pg, wrk, connections=args.connections, threads=args.threads)

    RESULTS.mkdir(exist_ok=True)
    record = {
        "date": stamp,
        "machine": machine(),
        "settings": vars(args),
        "table": table,
        "stores": stores,
        "postgres_default": postgres_default(),
        "connections_held": held,
        "round_trips": trips,
        "targets": [{"target": n, "pass": ok, "value": v} for n, ok, v in checks]
        + [{"target": "Postgres round trips", "pass": budget_ok, "value": ""}],
        "scale": scale,
    }
    file_stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    # A partial run (--variants/--workloads) never replaces latest.json or the chart.
    names = [f"{file_stamp}.json", "latest.json"] if complete else [f"partial-{file_stamp}.json"]
    for name in names:
        (RESULTS / name).write_text(json.dumps(record, indent=2) + "\n")
    if complete and not args.no_chart:
        chart(table, RESULTS / "chart.png", stamp)
        log(f"wrote {RESULTS / 'latest.json'} and {RESULTS / 'chart.png'}")


if __name__ == "__main__":
    main()
