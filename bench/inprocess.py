"""The guard's own cost without HTTP: ``python -m bench.inprocess``.

Calls the benchmark's app (``bench/app.py``) directly as an ASGI callable, one request
at a time, in the variants that need no database (no guard, the dict floor, ours on
the memory store), and prints microseconds per request for fresh keys and replays.
Alternating rounds, median shown. What it isolates is Python work per request; the
HTTP benchmark adds the server, the network and concurrency.

The Redis variants (``redis``, ``floor_redis``) are not in :data:`VARIANTS`: they need
``BENCH_REDIS_URL``; ``python -m bench.icount --variants redis,floor_redis`` runs them
through :func:`_measure` against a throwaway ``redis-server``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from typing import Any

VARIANTS = ["none", "floor_memory", "memory"]
BODY = b'{"amount": 4500, "currency": "EUR"}'


def _scope(key: bytes) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/orders/o-42/refunds", "raw_path": b"/orders/o-42/refunds",
        "root_path": "", "query_string": b"", "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 5555), "state": {},
        "headers": [
            (b"host", b"bench"), (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(BODY)), (b"idempotency-key", key),
        ],
    }  # fmt: skip


async def _measure(app: Any, workload: str, n: int) -> float:
    statuses: list[int] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    async def call(key: bytes) -> None:
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": BODY, "more_body": False}
            await asyncio.Event().wait()  # the client never leaves
            raise AssertionError

        await app(_scope(key), receive, send)

    replay_key = f"replay-{uuid.uuid4().hex}".encode()
    keys = [
        replay_key if workload == "replay" else f"fresh-{uuid.uuid4().hex}".encode()
        for _ in range(n)
    ]
    await call(replay_key)
    start = time.perf_counter()
    for key in keys:
        await call(key)
    elapsed = time.perf_counter() - start
    if set(statuses) != {201}:
        raise RuntimeError(f"unexpected statuses {sorted(set(statuses))}")
    return elapsed / n * 1e6


async def _run(variant: str, workloads: list[str], n: int) -> dict[str, float]:
    os.environ["BENCH_VARIANT"] = variant
    from bench import app as bench_app

    asgi = bench_app.create()
    async with asgi.router.lifespan_context(asgi):
        await _measure(asgi, "fresh", 200)  # warm-up
        return {w: await _measure(asgi, w, n) for w in workloads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20000, help="per cell (default 20000)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import uvloop

    workloads = ["fresh", "replay"]
    cells: dict[tuple[str, str], list[float]] = {}
    for rnd in range(args.rounds):
        order = VARIANTS if rnd % 2 == 0 else VARIANTS[::-1]
        for variant in order:
            for workload, us in uvloop.run(_run(variant, workloads, args.requests)).items():
                cells.setdefault((workload, variant), []).append(us)
    for workload in workloads:
        for variant in VARIANTS:
            runs = cells[(workload, variant)]
            print(
                f"{workload:7} {variant:13} {statistics.median(runs):7.1f} us/request  "
                f"rounds {[round(r, 1) for r in runs]}"
            )


if __name__ == "__main__":
    main()
