"""A Redis master, its replica and three Sentinels watching them, as real processes.

The servers are :class:`~tests.helpers.redis_servers.RedisServer` processes; each Sentinel is
``redis-server <its config> --sentinel`` (Debian ships no separate ``redis-sentinel``
binary on every release), on a free loopback port with its config in a directory of
its own (Sentinel rewrites it). Quick failure detection for tests:
``down-after-milliseconds`` 500, quorum 2. Every process is stopped by its PID, on
:meth:`SentinelGroup.stop` and at interpreter exit.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers.redis_servers import (
    _LIVE,
    RedisServer,
    _free_port,
    _ping,
    _stop,
    redis_cli,
    start_server,
)

__all__ = ["NO_SENTINEL", "SERVICE", "SentinelGroup", "start_group"]

NO_SENTINEL = (
    "The Sentinel tests run redis-server (7.0 or later, with --sentinel) and redis-cli "
    "from PATH and found none: install Debian's redis-server and redis-tools packages."
)

SERVICE = "mymaster"
DOWN_AFTER_MS = 500


@dataclass
class Sentinel:
    port: int
    directory: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self, master_port: int, *, within: float = 10) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(NO_SENTINEL)
        self.directory.mkdir(parents=True, exist_ok=True)
        conf = self.directory / "sentinel.conf"
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\nprotected-mode no\ndir {self.directory}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {master_port} 2\n"
            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
            # A failed election is tried again after twice this: 4 s, not 6 minutes.
            f"sentinel failover-timeout {SERVICE} 2000\n"
        )
        log = open(self.directory / "sentinel.log", "ab")  # noqa: SIM115  # closed with the process
        self.proc = subprocess.Popen(
            [binary, str(conf), "--sentinel"], stdout=log, stderr=subprocess.STDOUT,
            cwd=self.directory,
        )  # fmt: skip
        log.close()
        _LIVE[self.proc.pid] = self.proc
        deadline = time.monotonic() + within
        while not _ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self.directory / "sentinel.log").read_text(errors="replace")[-400:]
                raise RuntimeError(f"Sentinel on port {self.port} did not start: {tail}")
            time.sleep(0.05)

    def ask(self, *args: str) -> list[str]:
        return redis_cli(self.port, "SENTINEL", *args).split()

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)


@dataclass
class SentinelGroup:
    """The master, its replica and three Sentinels."""

    master: RedisServer
    replica: RedisServer
    sentinels: list[Sentinel]

    def url(self, query: str = "") -> str:
        """``redis+sentinel://`` naming every Sentinel, the service and database 0."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}/0" + (f"?{query}" if query else "")

    def master_port(self) -> int:
        """The master's port as the first Sentinel that answers names it."""
        for sentinel in self.sentinels:
            try:
                return int(sentinel.ask("get-master-addr-by-name", SERVICE)[1])
            except (subprocess.SubprocessError, IndexError, ValueError):
                continue
        raise RuntimeError("no Sentinel answered")

    def wait_promoted(self, port: int, *, within: float = 30) -> None:
        """Until every Sentinel names ``port`` as the master."""
        deadline = time.monotonic() + within
        while True:
            named = set()
            for sentinel in self.sentinels:
                try:
                    named.add(int(sentinel.ask("get-master-addr-by-name", SERVICE)[1]))
                except (subprocess.SubprocessError, IndexError, ValueError):
                    named.add(0)
            if named == {port}:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Sentinels did not promote {port}: they name {named}")
            time.sleep(0.02)

    def wait_linked(self, replica: RedisServer, *, within: float = 30) -> None:
        deadline = time.monotonic() + within
        while "master_link_status:up" not in replica.cli("INFO", "replication"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replica on {replica.port} did not sync")
            time.sleep(0.05)

    def wait_ready(self, *, within: float = 30) -> None:
        """Until each Sentinel knows the replica and the two other Sentinels (they elect a
        leader among those they know: a failover needs them)."""
        deadline = time.monotonic() + within
        while True:
            ready = all(
                len(s.ask("replicas", SERVICE)) > 0 and _count(s.ask("sentinels", SERVICE)) == 2
                for s in self.sentinels
            )
            if ready:
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the Sentinels did not discover the replica and each other")
            time.sleep(0.1)

    def rejoin(self, server: RedisServer, master_port: int) -> None:
        """Start ``server`` again (a killed old master), as the replica of ``master_port``:
        what an orchestrator does with a node that comes back. (Sentinel would turn a
        returning old master into a replica too, but only some 10 s after it answers.)"""
        server.extra = (*server.extra, "--replicaof", "127.0.0.1", str(master_port))
        server.start()
        self.wait_linked(server)

    def stop(self) -> None:
        for sentinel in self.sentinels:
            sentinel.stop()
        self.replica.stop()
        self.master.stop()


def _count(entries: list[str]) -> int:
    """How many instances ``SENTINEL sentinels`` listed (each has one ``name`` field)."""
    return entries.count("name")


def start_group(directory: Path) -> SentinelGroup:
    """Start the master, its replica (synced), then the Sentinels; return once ready.

    Raises:
        RuntimeError: a binary is missing (:data:`NO_SENTINEL`) or a process did not come up.
    """
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        raise RuntimeError(NO_SENTINEL)
    started: list[RedisServer | Sentinel] = []
    try:
        # No delay before a replica's first sync: the replica of a restarted master
        # would wait 5 s for it.
        master = start_server(directory / "master", "--repl-diskless-sync-delay", "0")
        started.append(master)
        replica = start_server(
            directory / "replica", "--repl-diskless-sync-delay", "0",
            "--replicaof", "127.0.0.1", str(master.port),
        )  # fmt: skip
        started.append(replica)
        sentinels: list[Sentinel] = []
        for i in range(3):
            sentinel = Sentinel(_free_port(), directory / f"sentinel{i}")
            sentinel.start(master.port)
            started.append(sentinel)
            sentinels.append(sentinel)
        group = SentinelGroup(master, replica, sentinels)
        group.wait_linked(replica)
        group.wait_ready()
        return group
    except BaseException:
        for process in reversed(started):
            process.stop()
        raise
