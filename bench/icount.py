"""Instructions per request in process, under valgrind: ``python -m bench.icount``.

Wall-clock figures from :mod:`bench.inprocess` move by tens of percent on a shared
machine; instruction counts do not. Each cell (variant, workload) runs twice under
``valgrind --tool=cachegrind --cache-sim=no``, with ``small`` and ``large`` requests
after the same start-up and warm-up, and the difference in instructions divided by
``large - small`` is the cost of one request, start-up cancelled out. The hash seed is
fixed so that both runs take the same paths through dicts and sets.

Instructions are not time (a cache miss costs no instruction), so a change is judged
by both: this for the direction and size, ``bench.inprocess`` for the microseconds.

Each store that ran beside its floor (``memory`` and ``floor_memory``, the default
comparison; ``redis`` and ``floor_redis``) is then printed as a ratio per workload:
``python -m bench.icount --variants memory,floor_memory`` is issue #34's measure of the
guard's own cost per request, fresh and replay.

The Redis variants (``--variants redis,floor_redis``) run against ``BENCH_REDIS_URL``,
or, unset, a throwaway ``redis-server`` (:mod:`bench.redis_server`) started for the
whole comparison. Only the app process is counted: the server's own work per script
is not, so compare the scripts' server-side cost separately.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import inprocess

_IREFS = re.compile(rb"I\s+refs:\s+([\d,]+)")


# Ours and the floor it is compared with, where both ran.
FLOORS = {"memory": "floor_memory", "redis": "floor_redis"}


def _cell(variant: str, workload: str, n: int) -> None:
    os.environ["BENCH_VARIANT"] = variant
    os.environ["BENCH_FLOOR_POOL_SIZE"] = "1"  # one request at a time
    from bench import app as bench_app

    async def main() -> None:
        asgi = bench_app.create()
        async with asgi.router.lifespan_context(asgi):
            await inprocess._measure(asgi, "fresh", 200)  # warm-up, as bench.inprocess does
            await inprocess._measure(asgi, workload, n)

    import uvloop

    uvloop.run(main())  # the loop bench.inprocess and the HTTP benchmark run on


def _instructions(variant: str, workload: str, n: int) -> int:
    cmd = [
        "valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
        sys.executable, "-m", "bench.icount", "--cell", variant, workload, str(n),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(cmd, env=env, capture_output=True, check=True)
    found = _IREFS.search(done.stderr)
    if found is None:
        raise RuntimeError(f"no instruction count in valgrind's output:\n{done.stderr.decode()}")
    return int(found.group(1).replace(b",", b""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", type=int, default=1000, help="requests in the first run")
    ap.add_argument("--large", type=int, default=3000, help="requests in the second run")
    ap.add_argument("--variants", default=",".join(inprocess.VARIANTS))
    ap.add_argument("--workloads", default="fresh,replay")
    ap.add_argument("--cell", nargs=3, metavar=("VARIANT", "WORKLOAD", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cell:
        variant, workload, n = args.cell
        _cell(variant, workload, int(n))
        return
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed (apt-get install valgrind)")
    with contextlib.ExitStack() as stack:
        if "redis" in args.variants and not os.environ.get("BENCH_REDIS_URL"):
            from bench.redis_server import redis_server

            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="icount-redis-"))
            os.environ["BENCH_REDIS_URL"] = stack.enter_context(redis_server(Path(tmp)))
        _compare(args)


def _compare(args: argparse.Namespace) -> None:
    variants, workloads = args.variants.split(","), args.workloads.split(",")
    per: dict[tuple[str, str], float] = {}
    for workload in workloads:
        for variant in variants:
            small = _instructions(variant, workload, args.small)
            large = _instructions(variant, workload, args.large)
            per[workload, variant] = (large - small) / (args.large - args.small)
            print(f"{workload:7} {variant:13} {per[workload, variant]:10.0f} instructions/request",
                  flush=True)  # fmt: skip
    for ours, floor in FLOORS.items():
        if ours in variants and floor in variants:
            ratios = ", ".join(f"{w} {per[w, ours] / per[w, floor]:.2f}x" for w in workloads)
            print(f"{ours} / {floor}: {ratios}", flush=True)


if __name__ == "__main__":
    main()
