"""A lone request's latency on Redis, pipelined or not: ``python -m bench.redis_lone``.

Requests one at a time (no concurrency), each a claim and its completion through
:mod:`asgi_idempotency.core.lifecycle` on :class:`RedisStore`, ``batching=True`` against
``batching=False``, in interleaved rounds on the same server (``BENCH_REDIS_URL``, or a
throwaway ``redis-server``). Pipelining must cost a lone request nothing: it is sent at
once, with no timer. Prints each variant's median (p50) per claim + complete and the
ratio batched / unbatched.

``--concurrency N`` runs N such request loops at once instead: what pipelining is for
(the pairs per second of each variant are printed too).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

from asgi_idempotency import StoredResponse
from asgi_idempotency.core import lifecycle
from asgi_idempotency.stores.redis import RedisStore

RESPONSE = StoredResponse(201, ((b"content-type", b"application/json"),), b'{"id":1}')
LEASE, TTL = timedelta(seconds=30), timedelta(hours=1)


async def _round(store: RedisStore, n: int, concurrency: int = 1) -> tuple[list[float], float]:
    """Latencies of ``n`` claim + complete pairs over ``concurrency`` loops, and the wall time."""
    started = time.perf_counter()
    loops = [_loop(store, n // concurrency) for _ in range(concurrency)]
    times = [t for loop in await asyncio.gather(*loops) for t in loop]
    return times, time.perf_counter() - started


async def _loop(store: RedisStore, n: int) -> list[float]:
    times = []
    for _ in range(n):
        key, token = uuid.uuid4().hex * 2, uuid.uuid4().hex
        started = time.perf_counter()
        now = datetime.now(UTC)
        claim = await lifecycle.claim(store, key, "h", token, now=now, lease=LEASE,
                                      ttl=TTL)  # fmt: skip
        assert claim.owned
        assert await store.complete(key, token, RESPONSE, now=now, ttl=TTL)
        times.append(time.perf_counter() - started)
    return times


async def _main(url: str, rounds: int, n: int, concurrency: int) -> None:
    stores = {"batched": RedisStore(url), "unbatched": RedisStore(url, batching=False)}
    samples: dict[str, list[float]] = {name: [] for name in stores}
    wall: dict[str, float] = {name: 0.0 for name in stores}
    try:
        for store in stores.values():
            await _round(store, 200, concurrency)  # connect, load the scripts, warm up
        for _ in range(rounds):
            for name, store in stores.items():
                times, took = await _round(store, n, concurrency)
                samples[name] += times
                wall[name] += took
    finally:
        for store in stores.values():
            await store.close()
    p50 = {name: statistics.median(values) for name, values in samples.items()}
    for name, value in p50.items():
        rate = len(samples[name]) / wall[name]
        print(f"{name:9} p50 {value * 1e6:7.1f} us per claim + complete, {rate:7.0f} pairs/s "
              f"({len(samples[name])}, concurrency {concurrency})")  # fmt: skip
    print(f"ratio batched/unbatched p50: {p50['batched'] / p50['unbatched']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("-n", type=int, default=1000, help="requests per variant per round")
    ap.add_argument("--concurrency", type=int, default=1, help="request loops at once")
    args = ap.parse_args()
    import uvloop

    with contextlib.ExitStack() as stack:
        url = os.environ.get("BENCH_REDIS_URL")
        if not url:
            from bench.redis_server import redis_server

            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="lone-redis-"))
            url = stack.enter_context(redis_server(Path(tmp)))
        uvloop.run(_main(url, args.rounds, args.n, args.concurrency))


if __name__ == "__main__":
    main()
