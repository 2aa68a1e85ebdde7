"""What ``bench.run`` and ``bench.scale`` share: a Postgres database, a server, one wrk cell."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asgi_idempotency.ops._serve import UvicornProcess, uvicorn_process

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent  # on the servers' sys.path, so that they import ``bench.app``


def log(msg: str) -> None:
    """Print ``msg`` at once (the benchmark's progress, with output piped to a file)."""
    print(msg, flush=True)


async def prepare_postgres(admin_url: str, url: str) -> None:
    """Create database ``url`` afresh (through ``admin_url``), with the schema and its
    migration head recorded, as the middleware's startup check requires."""
    import asyncpg

    from asgi_idempotency import SQLStore

    dbname = url.rsplit("/", 1)[1]
    admin = await asyncpg.connect(admin_url)
    try:
        # The benchmark's own database: dropped, so no table from an older layout stays.
        await admin.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
        await admin.execute(f'CREATE DATABASE "{dbname}"')
    finally:
        await admin.close()
    store = SQLStore(url.replace("postgresql://", "postgresql+asyncpg://", 1))
    try:
        await store.create_all()
    finally:
        await store.close()
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("TRUNCATE idempotency_records")
    finally:
        await conn.close()


def start_server(
    variant: str, env: dict[str, str], log_dir: Path
) -> contextlib.AbstractContextManager[UvicornProcess]:
    """``variant`` of ``bench/app.py`` in uvicorn, up until the context exits (then killed)."""
    args = (
        "--factory", "--app-dir", str(ROOT), "--loop", "uvloop", "--http", "httptools",
        "--no-access-log",
    )  # fmt: skip
    return uvicorn_process(
        "bench.app:create",
        env={**env, "BENCH_VARIANT": variant},
        log=log_dir / f"{variant}.log",
        args=args,
        ready_path="/health",
    )


def post(base: str, key: str, body: bytes) -> int:
    """POST ``body`` as a refund under ``key``; return the status code."""
    req = urllib.request.Request(
        base + "/orders/o-42/refunds",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", "Idempotency-Key": key},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return int(r.status)


def run_wrk(
    wrk: str,
    server: UvicornProcess,
    workload: str,
    *,
    duration: float,
    connections: int,
    threads: int,
    store: Callable[[], list[int]] | None = None,
) -> dict[str, Any]:
    """One wrk cell on ``server``: req/s, latencies, statuses, and the CPU per request of
    the app's process (``cpu_us``) and, given ``store`` (the store server's processes,
    listed afresh before and after the cell), of the store's server (``store_cpu_us``)."""
    nonce = uuid.uuid4().hex[:12]
    post(server.base_url, f"{nonce}-replay", b'{"amount": 4500, "currency": "EUR"}')
    cmd = [
        wrk, f"-t{threads}", f"-c{connections}", f"-d{max(1, round(duration))}s",
        "--timeout", "10s",
        "-s", str(HERE / "wrk" / "guard.lua"), server.base_url, "--", workload, nonce,
    ]  # fmt: skip
    store_before = processes_cpu(store()) if store is not None else {}
    cpu_before = cpu_seconds(server.process.pid)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    cpu = cpu_seconds(server.process.pid) - cpu_before
    store_cpu = None
    if store is not None:
        after = processes_cpu(store())
        # A process that started during the cell counts from zero; one that ended
        # during it is lost (a backend's connection closed mid-cell: none in a warm pool).
        store_cpu = sum(t - store_before.get(pid, 0.0) for pid, t in after.items())
    line = next((x for x in out.splitlines() if x.startswith("BENCH_JSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no result:\n{out}")
    data: dict[str, Any] = json.loads(line.removeprefix("BENCH_JSON "))
    data["rps"] = data["requests"] / (data["duration_us"] / 1e6)
    # The app's own CPU per request: with two cores shared by the app, its store's
    # server and wrk, req/s moves with the neighbours; CPU per request much less.
    data["cpu_us"] = cpu * 1e6 / max(1, data["requests"])
    if store_cpu is not None:
        data["store_cpu_us"] = store_cpu * 1e6 / max(1, data["requests"])
    return data


def processes_cpu(pids: list[int]) -> dict[int, float]:
    """User + system CPU seconds of each of ``pids`` still running."""
    out: dict[int, float] = {}
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            out[pid] = cpu_seconds(pid)
    return out


def _processes(match: Callable[[str, bytes], bool]) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            comm = (entry / "comm").read_text().strip()
            if match(comm, (entry / "cmdline").read_bytes()):
                pids.append(int(entry.name))
    return pids


def postgres_processes() -> list[int]:
    """Every process of the Postgres server on this machine (``/proc``): the backends of
    every connection, and the writer, checkpointer and autovacuum, whose work a cell's
    writes cause too. Linux; the server must run here (loopback)."""
    return _processes(lambda comm, _cmdline: comm in ("postgres", "postmaster"))


def redis_processes(port: int) -> list[int]:
    """The ``redis-server`` listening on loopback ``port`` (its title names the port)."""
    mark = f":{port}".encode()
    return _processes(lambda comm, cmdline: comm == "redis-server" and mark in cmdline)


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (``/proc/<pid>/stat``, Linux)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    # Fields after the command name, which is in parentheses and may hold spaces:
    # utime and stime are the 14th and 15th fields of the whole line.
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def open_connections(pid: int, port: int) -> int:
    """Established TCP connections from process ``pid`` to loopback ``port`` (Linux).

    How the benchmark checks, from outside the app, how many connections a variant
    holds to its store: the sockets among ``/proc/<pid>/fd`` whose remote end, in
    ``/proc/<pid>/net/tcp`` and ``tcp6``, is ``port`` in state ESTABLISHED.
    """
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    count = 0
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                remote_port = int(fields[2].rsplit(":", 1)[1], 16)
                if remote_port == port and fields[3] == "01" and fields[9] in inodes:
                    count += 1
    return count


def open_files(pid: int, path: str) -> int:
    """File descriptors of process ``pid`` open on ``path`` (a SQLite database's
    connections each hold one on the database file)."""
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            count += os.readlink(fd) == path
    return count


RESULTS = HERE / "results"


def ensure_wrk() -> str:
    found = shutil.which("wrk")
    if found:
        return found
    log("wrk not found: installing it from Debian's packages (apt-get install -y wrk)")
    apt = ["apt-get", "-y", "-q", "install", "wrk"]
    if os.geteuid() != 0:
        apt = ["sudo", *apt]
    if subprocess.run(apt, check=False, capture_output=True).returncode != 0:
        update = ["apt-get", "-q", "update"] if os.geteuid() == 0 else ["sudo", "apt-get", "update"]
        subprocess.run(update, check=True, capture_output=True)
        subprocess.run(apt, check=True, capture_output=True)
    found = shutil.which("wrk")
    if not found:
        sys.exit("wrk could not be installed; install it (apt-get install wrk) and rerun")
    return found
