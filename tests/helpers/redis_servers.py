"""Real ``redis-server`` processes for the tests and the benchmark: one server, or 3 + 3.

Each server runs from the binary on PATH on a free loopback port, in a directory of
its own, with persistence off (``--save "" --appendonly no``), and is stopped by its
PID: on the fixture's teardown, and at interpreter exit should teardown not run.
The system Redis on 6379 is never touched.
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["NO_REDIS", "RedisCluster", "RedisServer", "start_cluster", "start_server"]

NO_REDIS = (
    "Redis is required for these tests and none could be started: install redis-server "
    "(7.0 or later; redis-cli for the cluster) on PATH, or set IDEMPOTENCY_TEST_REDIS_URL="
    "redis://host:port/db and IDEMPOTENCY_TEST_REDIS_CLUSTER=redis+cluster://host:port "
    "(servers whose data the tests may flush)."
)

_LIVE: dict[int, subprocess.Popen[bytes]] = {}


def _stop_all() -> None:
    for proc in list(_LIVE.values()):
        _stop(proc)


atexit.register(_stop_all)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    _LIVE.pop(proc.pid, None)


def _free_port(*, bus: bool = False) -> int:
    """A loopback port free now (and, for a cluster node, its bus port + 10000 too)."""
    for _ in range(50):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port == 6379 or (bus and port + 10000 > 65535):
            continue
        if bus:
            try:
                with socket.socket() as other:
                    other.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free loopback port")


def _ping(port: int, pid: int | None = None) -> bool:
    """The server on ``port`` answers (and, with ``pid``, is that process).

    Another test process (a pytest-xdist worker) may start its own server on the port
    this one picked between the probe and the bind: this process's server then exits,
    and the other's answer must not pass for its start.
    """
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            if pid is None:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
            sock.sendall(b"INFO server\r\n")
            answer = b""
            while b"process_id:" not in answer or not answer.endswith(b"\r\n\r\n"):
                chunk = sock.recv(4096)
                if not chunk:
                    break
                answer += chunk
            return f"process_id:{pid}\r\n".encode() in answer
    except OSError:
        return False


def redis_cli(port: int, *args: str, timeout: float = 10) -> str:
    done = subprocess.run(
        ["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return done.stdout


@dataclass
class RedisServer:
    """One ``redis-server`` process; ``restart`` brings it back on the same port and dir."""

    port: int
    directory: Path
    extra: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, *, within: float = 10) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on PATH")
        self.directory.mkdir(parents=True, exist_ok=True)
        log = open(self.directory / "redis.log", "ab")  # noqa: SIM115  # closed with the process
        self.proc = subprocess.Popen(
            [
                binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.directory), "--save", "", "--appendonly", "no",
                "--protected-mode", "no", *self.extra,
            ],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.directory,
        )  # fmt: skip
        log.close()
        _LIVE[self.proc.pid] = self.proc
        deadline = time.monotonic() + within
        while not _ping(self.port, self.proc.pid):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self.directory / "redis.log").read_text(errors="replace")[-400:]
                raise RuntimeError(f"redis-server on port {self.port} did not start: {tail}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is saved (persistence is off anyway)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)
            _LIVE.pop(self.proc.pid, None)

    def cli(self, *args: str) -> str:
        return redis_cli(self.port, *args)


def start_server(directory: Path, *extra: str) -> RedisServer:
    """A fresh server on a free port (a few tries: another process may take the port).

    ``extra`` arguments come last, so ``"--appendonly", "yes"`` overrides the default.
    """
    last: Exception | None = None
    for _ in range(3):
        server = RedisServer(_free_port(), directory, extra)
        try:
            server.start()
            return server
        except RuntimeError as exc:
            last = exc
    raise RuntimeError(str(last))


@dataclass
class RedisCluster:
    """Three primaries, and by default a replica each, on loopback (``redis-cli --cluster``)."""

    nodes: list[RedisServer]
    replicas: int = 3

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def info(self, port: int) -> dict[str, str]:
        text = redis_cli(port, "CLUSTER", "INFO")
        return dict(line.split(":", 1) for line in text.split() if ":" in line)

    def roles(self) -> dict[int, str]:
        """Port -> ``master`` / ``slave`` of every running node, as each reports itself."""
        roles = {}
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                roles[node.port] = redis_cli(node.port, "ROLE").split()[0]
        return roles

    def primary_of(self, key: str) -> RedisServer:
        """The node serving ``key``'s slot as a primary now (as node 0 of those running sees it)."""
        live = next(n for n in self.nodes if n.proc is not None and n.proc.poll() is None)
        slot = int(redis_cli(live.port, "CLUSTER", "KEYSLOT", key).strip())
        for line in redis_cli(live.port, "CLUSTER", "NODES").splitlines():
            fields = line.split()
            if "master" not in fields[2] or "fail" in fields[2]:
                continue
            for spec in fields[8:]:
                lo, _, hi = spec.partition("-")
                if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                    port = int(fields[1].split(":")[1].split("@")[0])
                    return next(n for n in self.nodes if n.port == port)
        raise AssertionError(f"no primary serves slot {slot}")

    def wait_replicas_linked(self, *, within: float = 30) -> None:
        """Until every replica has synced with its primary (it can take over only then)."""
        deadline = time.monotonic() + within
        while True:
            infos = [redis_cli(n.port, "INFO", "replication") for n in self.nodes]
            replicas = [i for i in infos if "role:slave" in i]
            linked = all("master_link_status:up" in i for i in replicas)
            if len(replicas) == self.replicas and linked:
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster's replicas did not sync with their primaries")
            time.sleep(0.1)

    def wait_ok(self, *, within: float = 30) -> None:
        deadline = time.monotonic() + within
        while True:
            live = [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]
            try:
                if all(self.info(n.port).get("cluster_state") == "ok" for n in live):
                    return
            except subprocess.SubprocessError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis cluster did not reach cluster_state:ok")
            time.sleep(0.1)


def start_cluster(directory: Path, *, replicas: bool = True) -> RedisCluster:
    """3 primaries + 3 replicas (``--cluster-replicas 1``), node timeout 1 s for quick failover.

    ``replicas=False``: the 3 primaries alone (the benchmark's cheaper cluster: no
    replication traffic competing for the cores).
    """
    if shutil.which("redis-cli") is None:
        raise RuntimeError("redis-cli is not on PATH")
    nodes: list[RedisServer] = []
    try:
        for i in range(6 if replicas else 3):
            # A few tries, as start_server makes: another test process (an xdist worker
            # starting its own cluster) may take the port, or its bus port, meanwhile.
            for attempt in range(3):
                node = RedisServer(
                    _free_port(bus=True),
                    directory / f"node{i}",
                    # No 5 s wait before a replica's first sync: a replica that never
                    # synced would refuse to take over from a dead primary.
                    extra=("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                           "--cluster-node-timeout", "1000", "--repl-diskless-sync-delay", "0"),
                )  # fmt: skip
                try:
                    node.start()
                    break
                except RuntimeError:
                    if attempt == 2:
                        raise
            nodes.append(node)
        addresses = [f"127.0.0.1:{n.port}" for n in nodes]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *addresses,
             "--cluster-replicas", "1" if replicas else "0", "--cluster-yes"],
            capture_output=True, check=True, timeout=60,
        )  # fmt: skip
        cluster = RedisCluster(nodes, replicas=3 if replicas else 0)
        cluster.wait_ok()
        cluster.wait_replicas_linked()
        return cluster
    except BaseException:
        for node in nodes:
            node.stop()
        raise


@contextlib.contextmanager
def stopped_at_exit(server: RedisServer | RedisCluster) -> Iterator[None]:
    try:
        yield
    finally:
        server.stop()
