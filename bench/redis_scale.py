"""Fresh-key throughput on one Redis and on a 3-primary cluster, with 1, 2 and 4 app workers.

``python -m bench.redis_scale``: the benchmark app's ``redis`` variant (ours on
``RedisStore``) under ``uvicorn --workers N``, wrk's fresh-key workload, cells
alternating round after round, on one server, the 3+3 cluster the tests use, and the
3 primaries alone (no replication competing for the cores). Whether it scales with
workers depends on the cores the machine has free, so each cell also prints how busy
the machine's CPUs were (all processes, from ``/proc/stat``): a cell near 100% has no
core left for another worker, and its figure is a ceiling of the machine, not of
the store.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
from pathlib import Path
from typing import Any

from asgi_idempotency.ops._serve import uvicorn_process
from bench.harness import ROOT, ensure_wrk, log, run_wrk
from bench.redis_server import redis_cluster, redis_server
from bench.run import machine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=int, default=5, help="seconds per cell (default 5)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--workers", default="1,2,4")
    args = ap.parse_args()
    wrk = ensure_wrk()
    tmp = Path(tempfile.mkdtemp(prefix="bench_redis_scale_"))
    workers = [int(w) for w in args.workers.split(",")]
    uvicorn_args = (
        "--factory", "--app-dir", str(ROOT), "--loop", "uvloop", "--http", "httptools",
        "--no-access-log",
    )  # fmt: skip
    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        urls = {
            "one server": stack.enter_context(redis_server(tmp / "one")),
            "cluster 3+3": stack.enter_context(redis_cluster(tmp / "cluster")),
            "cluster 3+0": stack.enter_context(redis_cluster(tmp / "primaries", replicas=False)),
        }
        servers = {}
        for name, url in urls.items():
            for n in workers:
                env = {"BENCH_VARIANT": "redis", "BENCH_REDIS_URL": url, "BENCH_GC_FREEZE": "1"}
                log_file = tmp / f"{name.replace(' ', '_')}-{n}.log"
                servers[name, n] = stack.enter_context(
                    uvicorn_process(
                        "bench.app:create",
                        env=env,
                        log=log_file,
                        args=(*uvicorn_args, "--workers", str(n)),
                        ready_path="/health",
                    )
                )
        for server in servers.values():  # warm-up: connections, scripts, slot maps
            run_wrk(wrk, server, "fresh", duration=1, connections=args.connections, threads=1)
        order = list(servers)
        for rnd in range(args.rounds):
            for cell in order if rnd % 2 == 0 else reversed(order):
                before = _cpu_times()
                result = run_wrk(
                    wrk, servers[cell], "fresh",
                    duration=args.duration, connections=args.connections, threads=1,
                )  # fmt: skip
                result["cpu_busy"] = _busy(before, _cpu_times())
                cells.setdefault(cell, []).append(result)
                log(f"round {rnd + 1}/{args.rounds} {cell[0]:12} workers {cell[1]}  "
                    f"{result['rps']:7.0f} req/s  cpu busy {result['cpu_busy']:4.0%}")  # fmt: skip
    log(f"\n{machine()}; wrk -t1 -c{args.connections}, {args.duration} s per cell, "
        f"{args.rounds} rounds, fresh keys; medians")  # fmt: skip
    log(f"{'store':12} {'workers':>7} {'req/s':>8} {'p99 ms':>8} {'cpu busy':>9}  rounds")
    for (name, n), runs in cells.items():
        rps = statistics.median(r["rps"] for r in runs)
        p99 = statistics.median(r["p99_us"] for r in runs) / 1000
        busy = statistics.median(r["cpu_busy"] for r in runs)
        log(f"{name:12} {n:>7} {rps:8.0f} {p99:8.2f} {busy:9.0%}  "
            f"{[round(r['rps']) for r in runs]}")  # fmt: skip


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot (``/proc/stat``; idle and iowait idle)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total


def _busy(before: tuple[int, int], after: tuple[int, int]) -> float:
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total else 0.0


if __name__ == "__main__":
    main()
