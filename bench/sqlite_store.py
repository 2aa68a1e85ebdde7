"""SQLite store A/B, no HTTP: ``python -m bench.sqlite_store``.

Times ``SQLStore`` on a SQLite file through ``lifecycle.claim`` then ``store.complete``
(fresh keys, a pair per request) and replays of one key, at 32 concurrent tasks and
at 1. Each cell runs in a fresh process on a fresh database file.

``--compare NAME=SRC`` (repeatable) adds a variant whose ``asgi_idempotency`` is
imported from ``SRC`` (e.g. ``git archive <commit> src | tar -x -C /tmp/before``,
then ``before=/tmp/before/src``); ``NAME=SRC:ENV=VALUE`` also sets an environment
variable in that variant's processes. Rounds alternate the order of the variants
(A B, B A, ...) so that drift on a shared machine falls on both; medians are printed
with every round's figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CELLS = [("fresh", 32), ("fresh", 1), ("replay", 32)]


async def _cell(path: str, workload: str, concurrency: int, n: int) -> float:
    from asgi_idempotency import SQLStore
    from asgi_idempotency.core.lifecycle import claim
    from asgi_idempotency.stores.base import StoredResponse

    now = datetime.now(UTC)
    lease, ttl = timedelta(seconds=30), timedelta(days=1)
    response = StoredResponse(201, ((b"content-type", b"application/json"),), b'{"id":"x"}')
    # SQLStore's batching argument; older code, compared from a git ref, has none.
    batching = os.environ.get("BENCH_SQLITE_BATCH")
    kwargs: dict[str, Any] = {} if batching is None else {"batching": batching == "1"}
    store = SQLStore(f"sqlite+aiosqlite:///{path}", **kwargs)
    await store.create_all()
    run = uuid.uuid4().hex[:8]
    await claim(store, f"{run}-r", "h", "t", now=now, lease=lease, ttl=ttl)
    await store.complete(f"{run}-r", "t", response, now=now, ttl=ttl)

    async def fresh(i: int) -> None:
        key, token = f"{run}-{i}-{uuid.uuid4().hex}", uuid.uuid4().hex
        await claim(store, key, "h", token, now=now, lease=lease, ttl=ttl)
        await store.complete(key, token, response, now=now, ttl=ttl)

    async def replay(i: int) -> None:
        await claim(store, f"{run}-r", "h", "t2", now=now, lease=lease, ttl=ttl)

    op = fresh if workload == "fresh" else replay
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            await op(i)

    async def timed(count: int, offset: int) -> float:
        start = time.perf_counter()
        await asyncio.gather(*(one(offset + i) for i in range(count)))
        return count / (time.perf_counter() - start)

    try:
        await timed(300, 10**9)  # warm-up: connection, statement cache, pages
        return await timed(n, 0)
    finally:
        await store.close()


def _child(args: argparse.Namespace) -> None:
    import uvloop

    with tempfile.TemporaryDirectory(prefix="bench_sqlite_") as tmp:
        rate = uvloop.run(_cell(f"{tmp}/s.db", args.workload, args.concurrency, args.n))
    print(json.dumps({"rate": rate}))


def _spawn(src: str, env: dict[str, str], workload: str, concurrency: int, n: int) -> float:
    child_env = {**os.environ, **env}
    if src:
        child_env["PYTHONPATH"] = os.pathsep.join([src, str(HERE.parent)])
    cmd = [sys.executable, "-m", "bench.sqlite_store", "--child", "--workload", workload]
    cmd += ["--concurrency", str(concurrency), "--n", str(n)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=child_env)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["rate"])


def _variant(spec: str) -> tuple[str, str, dict[str, str]]:
    name, _, rest = spec.partition("=")
    src, *pairs = rest.split(":")
    return name, src, dict(p.split("=", 1) for p in pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4000, help="operations per cell (default 4000)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--compare", action="append", default=[], metavar="NAME=SRC[:ENV=V]")
    ap.add_argument("--this", default="this", help="name of the variant from this checkout")
    ap.add_argument("--cells", default=",".join(f"{w}@{c}" for w, c in CELLS))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workload", default="fresh", help=argparse.SUPPRESS)
    ap.add_argument("--concurrency", type=int, default=32, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return
    variants: list[tuple[str, str, dict[str, str]]] = [(args.this, "", {})]
    variants += [_variant(s) for s in args.compare]
    cells = [(w, int(c)) for w, c in (x.split("@") for x in args.cells.split(","))]
    results: dict[tuple[str, str, int], list[float]] = {}
    for rnd in range(args.rounds):
        order = variants if rnd % 2 == 0 else variants[::-1]
        for workload, concurrency in cells:
            n = args.n if concurrency > 1 else args.n // 2
            for name, src, env in order:
                rate = _spawn(src, env, workload, concurrency, n)
                results.setdefault((name, workload, concurrency), []).append(rate)
                print(f"round {rnd} {workload}@{concurrency} {name}: {rate:.0f}/s", flush=True)
    for workload, concurrency in cells:
        base = results[(variants[0][0], workload, concurrency)]
        for name, _, _ in variants:
            runs = results[(name, workload, concurrency)]
            med = statistics.median(runs)
            # The median of per-round ratios: drift between rounds cancels out.
            ratio = statistics.median(r / b for r, b in zip(runs, base, strict=True))
            print(
                f"{workload:6} c={concurrency:<3} {name:12} median {med:7.0f}/s  "
                f"{ratio:.2f}x {variants[0][0]} (median of rounds)  "
                f"min {min(runs):.0f} max {max(runs):.0f}  rounds {[round(r) for r in runs]}"
            )


if __name__ == "__main__":
    main()
