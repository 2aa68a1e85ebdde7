"""A PostgreSQL primary and a synchronous streaming standby, from the local binaries.

``initdb`` for the primary, ``pg_basebackup -R`` for the standby (which then streams
from it), ``synchronous_standby_names = '*'`` on the primary only, so a commit is
acknowledged once the standby has flushed it. Each server runs on a free loopback
port with its socket and data in a temporary directory of its own, as the
``postgres`` user when the tests run as root (the binaries refuse root). Servers
are stopped by their postmaster's PID: on :meth:`PgPair.stop`, and at interpreter exit
should that not run. The system Postgres on 5432 is never touched.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["NO_PG_BINARIES", "PgNode", "PgPair", "start_pair"]

NO_PG_BINARIES = (
    "The failover tests build a Postgres primary and a standby from the local binaries "
    "(initdb, pg_ctl, pg_basebackup, postgres) and found none: install Debian's "
    "postgresql package (15 or later; they live in /usr/lib/postgresql/<version>/bin) "
    "or put that directory on PATH."
)

_LIVE: dict[Path, PgNode] = {}


def _bin_dir() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_basebackup"), key=_version)
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("pg_basebackup")
    if on_path and all(shutil.which(b) for b in ("initdb", "pg_ctl", "postgres")):
        return Path(on_path).parent
    raise RuntimeError(NO_PG_BINARIES)


def _version(path: str) -> int:
    part = Path(path).parts[-3]
    return int(part) if part.isdigit() else 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _user() -> str | None:
    """Whom the binaries run as: ``postgres`` under root (they refuse root), else us."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise RuntimeError(
            "the tests run as root and the Postgres binaries refuse root: create the "
            "postgres user (Debian's postgresql package does), or run as another user"
        ) from None
    return "postgres"


def _run(*argv: str | Path, timeout: float = 60) -> str:
    done = subprocess.run(
        [str(a) for a in argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        user=_user(),
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{Path(argv[0]).name} failed: {(done.stderr or done.stdout)[-600:]}")
    return done.stdout


@dataclass
class PgNode:
    """One server: its data directory and port."""

    data: Path
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        _run(_bin_dir() / "pg_ctl", "-D", self.data, "-l", self.data / "server.log",
             "-w", "-t", "30", "start")  # fmt: skip
        _LIVE[self.data] = self

    def pid(self) -> int | None:
        """The postmaster's PID, or ``None`` when it is not running."""
        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
            os.kill(pid, 0)
        except (OSError, ValueError, IndexError):
            return None
        return pid

    def kill(self) -> None:
        """SIGKILL the postmaster and every process it started: a crashed machine."""
        pid = self.pid()
        if pid is None:
            return
        children = subprocess.run(
            ["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False
        ).stdout.split()
        for victim in [pid, *map(int, children)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        _LIVE.pop(self.data, None)

    def promote(self) -> None:
        _run(_bin_dir() / "pg_ctl", "-D", self.data, "-w", "-t", "30", "promote")

    def sql(self, statement: str) -> str:
        psql = _bin_dir() / "psql"
        return _run(psql, "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres",
                    "-d", "postgres", "-XAtqc", statement).strip()  # fmt: skip

    def stop(self) -> None:
        """Stop it by PID (immediate shutdown: nothing here needs a clean one)."""
        pid = self.pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGQUIT)
            deadline = time.monotonic() + 10
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            if _alive(pid):
                self.kill()
        _LIVE.pop(self.data, None)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (our pg_ctl child exited long ago; the postmaster is not our child) counts
    # as gone: /proc says so.
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
            return False
    return True


@dataclass
class PgPair:
    """A primary and its synchronous standby, in ``root`` (removed by :meth:`stop`)."""

    root: Path
    primary: PgNode
    standby: PgNode

    def url(self, form: str, database: str = "postgres") -> str:
        """The URL users write for the pair: ``libpq`` (``h1:p1,h2:p2``) or ``sqlalchemy``
        (``?host=h1:p1&host=h2:p2``), with ``target_session_attrs=read-write``."""
        first, second = self.primary.address, self.standby.address
        if form == "libpq":
            return (
                f"postgresql+asyncpg://postgres@{first},{second}/{database}"
                "?target_session_attrs=read-write"
            )
        return (
            f"postgresql+asyncpg://postgres@/{database}?host={first}&host={second}"
            "&target_session_attrs=read-write"
        )

    def wait_synchronous(self, *, within: float = 30) -> None:
        """Until the primary reports the standby as streaming and synchronous."""
        deadline = time.monotonic() + within
        while True:
            state = self.primary.sql("SELECT state, sync_state FROM pg_stat_replication")
            if state == "streaming|sync":
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the standby did not become synchronous: {state!r}")
            time.sleep(0.05)

    def stop(self) -> None:
        for node in (self.standby, self.primary):
            node.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def start_pair() -> PgPair:
    """initdb a primary, start it, copy it with ``pg_basebackup -R``, start the standby,
    then make the standby synchronous; returns once it streams synchronously.

    Raises:
        RuntimeError: the binaries are missing (:data:`NO_PG_BINARIES`) or a step failed
            (the message carries the tail of its output).
    """
    bin_dir = _bin_dir()
    root = Path(tempfile.mkdtemp(prefix="idem-pg-ha-"))
    user = _user()
    if user is not None:
        shutil.chown(root, user)
    primary = PgNode(root / "primary", _free_port())
    standby = PgNode(root / "standby", _free_port())
    pair = PgPair(root, primary, standby)
    try:
        _run(bin_dir / "initdb", "-D", primary.data, "-U", "postgres", "--auth=trust",
             "--no-sync", "-E", "UTF8", "--locale=C")  # fmt: skip
        _configure(primary, root)
        primary.start()
        _run(bin_dir / "pg_basebackup", "-D", standby.data, "-h", "127.0.0.1",
             "-p", str(primary.port), "-U", "postgres", "-R", "-X", "stream",
             "-c", "fast", "--no-sync")  # fmt: skip
        # The copy has the primary's settings: its own port, and no synchronous standby
        # of its own (promoted, it would wait for one that never comes, every commit).
        with (standby.data / "postgresql.auto.conf").open("a") as conf:
            conf.write(f"port = {standby.port}\nsynchronous_standby_names = ''\n")
        standby.start()
        primary.sql("ALTER SYSTEM SET synchronous_standby_names = '*'")
        primary.sql("SELECT pg_reload_conf()")
        pair.wait_synchronous()
        return pair
    except BaseException:
        pair.stop()
        raise


def _configure(node: PgNode, root: Path) -> None:
    with (node.data / "postgresql.auto.conf").open("a") as conf:
        conf.write(
            f"port = {node.port}\n"
            "listen_addresses = '127.0.0.1'\n"
            f"unix_socket_directories = '{root}'\n"
            "wal_level = replica\n"
            "max_wal_senders = 4\n"
            "hot_standby = on\n"
            # Throwaway data: no fsync (a SIGKILLed process loses nothing the kernel
            # holds; only a power cut would), and no autovacuum competing for the cores.
            "fsync = off\n"
            "autovacuum = off\n"
            "shared_buffers = '16MB'\n"
        )


def _stop_all() -> None:
    for node in list(_LIVE.values()):
        node.stop()


atexit.register(_stop_all)
