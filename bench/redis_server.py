"""A throwaway ``redis-server`` for the benchmark's Redis variants (never the system one).

Started from the binary on PATH on a free loopback port, persistence off (``--save ""
--appendonly no``: the benchmark measures the guard, not the disk), stopped by its PID.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

__all__ = ["redis_cluster", "redis_server"]


def _free_port() -> int:
    """A loopback port free now, whose cluster bus port (+10000) is free too."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket() as bus:
                bus.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port


@contextmanager
def redis_server(directory: Path, *extra: str) -> Iterator[str]:
    """Yield the ``redis://`` URL of a fresh server in ``directory``; stop it afterwards."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not on PATH: install it, or set BENCH_REDIS_URL")
    port = _free_port()
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / "redis.log").open("wb") as out:
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory),
             "--save", "", "--appendonly", "no", "--maxmemory-policy", "noeviction", *extra],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {port}")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@contextmanager
def redis_cluster(directory: Path) -> Iterator[str]:
    """Yield the ``redis+cluster://`` URL of a fresh 3-primary, 3-replica loopback cluster."""
    with ExitStack() as stack:
        urls = [
            stack.enter_context(
                redis_server(
                    directory / f"node{i}",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--repl-diskless-sync-delay",
                    "0",
                )
            )
            for i in range(6)
        ]
        nodes = [u.removeprefix("redis://").removesuffix("/0") for u in urls]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", "1",
             "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        host, port = nodes[0].split(":")
        deadline = time.monotonic() + 30
        while "cluster_state:ok" not in subprocess.run(
            ["redis-cli", "-h", host, "-p", port, "CLUSTER", "INFO"],
            capture_output=True, text=True, check=False,
        ).stdout:  # fmt: skip
            if time.monotonic() > deadline:
                raise RuntimeError("the benchmark's Redis cluster did not come up")
            time.sleep(0.1)
        yield f"redis+cluster://{nodes[0]}"
