"""``asgi-idempotency``: operate the records table from a shell or a cron job.

Commands: ``migrate``, ``prune``, ``inspect KEY``, ``stats``, ``audit``, ``demo``,
``check URL``.
The database (all but ``demo`` and ``check``) comes from ``--database-url`` or
``IDEMPOTENCY_DATABASE_URL``, through the URL rule the store and alembic share
(:mod:`asgi_idempotency.stores.urls`): ``postgres://``, ``postgresql://``, ``sqlite://``,
``mariadb://`` and ``mysql://`` URLs get their async driver (asyncpg, aiosqlite, asyncmy),
other drivers are refused, and passwords are never printed. ``inspect``, ``stats`` and
``audit`` also take a Redis URL (``redis://``, ``rediss://``, ``redis+cluster://``,
``rediss+cluster://``: the ``redis`` extra); ``prune`` on one explains that Redis
expires records itself and ``migrate`` that Redis needs no schema, both exiting 0.
Each URL's store comes from the store registry (:mod:`asgi_idempotency.stores.registry`,
where a store of one's own registers its schemes too), and each command asks the
store's declared capabilities (prune, migrations, stats), never the URL's scheme.
Every URL hint (``--help`` and the errors) lists the one set of spellings,
:data:`asgi_idempotency.stores.urls.ACCEPTED`.

Exit codes, for scripts (:class:`Exit`, :data:`EXIT_MEANINGS`; ``--help`` lists the same):

====  =========================================================================
0     success
1     inspect: no record for that key in the scope searched (host, principal);
      demo: the guarded run did not make exactly one refund; check: a check
      failed (each failing check is named); audit: suspected duplicates were
      found
2     usage error: bad arguments, a key digest prefix that matches several
      records, missing or malformed database URL, the demo extra not installed;
      migrate: the database is at a revision this version does not know; check:
      httpx not installed, a URL on another origin than the checked one
3     database unreachable or failing (refused, timed out, bad credentials, no
      such database or SQLite file)
4     the records table is missing: run `asgi-idempotency migrate`
70    unexpected internal error (a bug: the traceback is printed)
130   interrupted (Ctrl-C)
====  =========================================================================
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import importlib
import json
import math
import os
import re
import sys
import textwrap
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TextIO, TypeVar

from asgi_idempotency import __version__
from asgi_idempotency.core.errors import SchemaMissing, StoreError
from asgi_idempotency.stores.registry import StoreKind, kind_of
from asgi_idempotency.stores.urls import ACCEPTED, ENV_URL, redact, sqlite_path
from asgi_idempotency.stores.urls import async_url as normalize_url

__all__ = ["ENV_URL", "EXIT_MEANINGS", "Exit", "main", "normalize_url"]

_T = TypeVar("_T")


class Exit(enum.IntEnum):
    OK = 0
    NOT_FOUND = 1
    FOUND = 1  # audit: suspected duplicates were found (an alias of 1)
    USAGE = 2
    UNREACHABLE = 3
    NO_SCHEMA = 4
    INTERNAL = 70
    INTERRUPTED = 130


#: What each exit code means: ``--help`` shows these, the module docstring repeats them.
EXIT_MEANINGS: dict[Exit, str] = {
    Exit.OK: "success",
    Exit.NOT_FOUND: (
        "inspect: no record for that key in the scope searched (host, principal); "
        "demo: the guarded run did not make exactly one refund; "
        "check: a check failed (each failing check is named); "
        "audit: suspected duplicates were found"
    ),
    Exit.USAGE: (
        "usage error: bad arguments, a key digest prefix that matches several "
        "records, missing or malformed database URL, the demo extra not installed; "
        "migrate: the database is at a revision this version does not know; "
        "check: httpx not installed, a URL on another origin than the checked one"
    ),
    Exit.UNREACHABLE: (
        "database unreachable or failing (refused, timed out, bad credentials, "
        "no such database or SQLite file)"
    ),
    Exit.NO_SCHEMA: "the records table is missing: run `asgi-idempotency migrate`",
    Exit.INTERNAL: "unexpected internal error (a bug: the traceback is printed)",
    Exit.INTERRUPTED: "interrupted (Ctrl-C)",
}


def _exit_codes_help() -> str:
    lines = ["exit codes:"]
    for code, meaning in EXIT_MEANINGS.items():
        lines += textwrap.wrap(
            meaning, width=78, initial_indent=f"  {int(code):<5}", subsequent_indent=" " * 7
        )
    return "\n".join(lines)


class CLIError(Exception):
    """Ends the command with a message on stderr and an exit code."""

    def __init__(self, code: Exit, message: str) -> None:
        super().__init__(message)
        self.code = code


def _failure_table() -> tuple[tuple[type[StoreError], Exit, str], ...]:
    """Every store failure's exit code and what the command says, the first match winning.

    Stores raise :class:`StoreError` subclasses by type at their drivers' boundaries
    (a missing table is :class:`SchemaMissing` there), so the CLI decides by type alone.
    """
    from asgi_idempotency.ops.demo import CannotCreateDatabase

    return (
        (
            SchemaMissing,
            Exit.NO_SCHEMA,
            "the idempotency_records table does not exist in {url}: "
            "run `asgi-idempotency migrate` first",
        ),
        (
            CannotCreateDatabase,
            Exit.UNREACHABLE,
            "cannot run the demo on {url}: it creates a scratch database and drops it "
            "afterwards, and this user may not create databases (grant CREATEDB, or use "
            "a user who may)",
        ),
        (StoreError, Exit.UNREACHABLE, "cannot use the database at {url}: {reason}"),
    )


def _database_error(exc: StoreError, url: str) -> CLIError:
    """The exit code and the line for a store failure (:func:`_failure_table`)."""
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    for kind, code, text in _failure_table():
        if isinstance(exc, kind):
            return CLIError(code, text.format(url=redact(url), reason=reason))
    raise AssertionError("StoreError is the table's last row")  # pragma: no cover


def _store_errors(url: str) -> AbstractContextManager[None]:
    """The error boundary of the SQL driver ``url`` names: its failures become StoreError."""
    from sqlalchemy import make_url

    from asgi_idempotency.stores.sql.dialect import dialect_named

    try:
        return dialect_named(make_url(normalize_url(url)).get_backend_name()).errors
    except ValueError:  # not a SQL backend: the command itself says so
        return nullcontext()


def _fmt_time(value: datetime | None, now: datetime) -> str:
    if value is None:
        return "-"
    delta = (value - now).total_seconds()
    when = "from now" if delta > 0 else "ago"
    return f"{value.isoformat(timespec='seconds')} ({_fmt_span(abs(delta))} {when})"


def _fmt_span(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


# --- commands -----------------------------------------------------------------


async def _with_store(
    url: str, command_timeout: float, body: Callable[[Any], Awaitable[Exit]]
) -> Exit:
    kind = kind_of(url)
    try:
        store = kind.build(url, command_timeout=command_timeout, **kind.cli_options)
    except (ImportError, ValueError) as exc:  # its extra is missing, or it refused the URL
        raise CLIError(Exit.USAGE, str(exc)) from None
    try:
        return await body(store)
    except StoreError as exc:
        raise _database_error(exc, url) from exc
    finally:
        await store.close()


def _nothing_to(command: str, capability: str, kind: StoreKind) -> str:
    """What ``command`` says on a kind of store that lacks ``capability``, exiting 0."""
    return f"nothing to {command}: {kind.why_not(capability)}"


#: What ``prune`` says on Redis, where there is nothing for it to do.
REDIS_PRUNE = _nothing_to("prune", "prune", kind_of("redis://"))

#: What ``migrate`` says on Redis, where there is nothing for it to do.
REDIS_MIGRATE = _nothing_to("migrate", "migrations", kind_of("redis://"))


def cmd_migrate(args: argparse.Namespace, out: TextIO) -> Exit:
    url = _require_url(args, existing=False)
    kind = kind_of(url)
    if not kind.capabilities.migrations:
        # Success, like prune on Redis: a deploy step that runs migrate on every
        # deploy keeps working when the store moves to Redis.
        print(_nothing_to("migrate", "migrations", kind), file=out)
        return Exit.OK
    try:
        from asgi_idempotency.migrations import SchemaConflict, UnknownRevision, upgrade
    except ImportError as exc:
        raise CLIError(Exit.INTERNAL, f"this build carries no migrations: {exc}") from exc
    try:
        with _store_errors(url):
            upgrade(url)
    except SchemaConflict as exc:
        raise CLIError(Exit.UNREACHABLE, f"cannot migrate {redact(url)}: {exc}") from exc
    except UnknownRevision as exc:
        # Not a bug, and retrying will not help: the operator runs the wrong version.
        raise CLIError(Exit.USAGE, f"cannot migrate {redact(url)}: {exc}") from None
    except StoreError as exc:
        raise _database_error(exc, url) from exc
    print(f"migrated {redact(url)} to the latest revision", file=out)
    return Exit.OK


def cmd_prune(args: argparse.Namespace, out: TextIO) -> Exit:
    from asgi_idempotency.ops.retention import count_expired, prune_all

    url = _require_url(args)
    kind = kind_of(url)
    if not kind.capabilities.prune:
        note = _nothing_to("prune", "prune", kind)
        if args.json:
            print(json.dumps({"pruned": 0, "dry_run": args.dry_run, "note": note}), file=out)
        elif not args.quiet:
            print(note, file=out)
        return Exit.OK
    err: TextIO = sys.stderr
    show_progress = not args.json and not args.quiet and err.isatty()

    async def body(store: Any) -> Exit:
        now = None  # the store's own time decides what has expired
        started = time.perf_counter()
        expected = await count_expired(store, now=now) if (args.dry_run or show_progress) else 0
        if args.dry_run:
            pruned = expected
        else:

            def progress(done: int, _batch: int) -> None:
                share = f" ({100 * done / expected:.0f}%)" if expected else ""
                err.write(f"\rpruned {done:,} of {expected:,} expired records{share}")
                err.flush()

            pruned = await prune_all(
                store,
                batch_size=args.batch_size,
                now=now,
                pause=args.pause,
                max_batches=args.max_batches,
                progress=progress if show_progress else None,
            )
            if show_progress:
                err.write("\n")
        elapsed = time.perf_counter() - started
        if args.json:
            payload = {"pruned": pruned, "dry_run": args.dry_run, "elapsed_s": round(elapsed, 3)}
            print(json.dumps(payload), file=out)
        elif args.dry_run:
            print(
                f"{pruned:,} expired records would be pruned (dry run: nothing deleted)", file=out
            )
        elif not args.quiet:
            print(f"pruned {pruned:,} expired records in {elapsed:.1f}s", file=out)
        return Exit.OK

    return asyncio.run(_with_store(url, args.timeout, body))


# The logs' key_digest: the first 16 hex digits of the scoped key (64 in full).
_DIGEST = re.compile(r"[0-9a-fA-F]{16,64}")


def _header(value: str | None) -> bytes | None:
    """A header value given on the command line, as the server would hand it on."""
    return None if value is None else value.encode("utf-8", "surrogateescape")


def _searched(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """The scope ``inspect`` looked in, as shown, and what it may have lacked."""
    from asgi_idempotency.http.request import forwarded_hosts, host_name

    names = None if args.x_forwarded_host is None else args.x_forwarded_host.split(",")
    forwarded = None if args.forwarded is None else _header(args.forwarded)
    searched: dict[str, Any] = {
        "host": host_name(_header(args.host) or b"") or None,
        "principal": args.principal,
        "x_forwarded_host": None
        if names is None
        else [host_name(_header(n) or b"") for n in names],
        "forwarded_host": None
        if forwarded is None
        else [host_name(h) for h in forwarded_hosts(forwarded)],
    }
    hints = []
    if not args.host:
        hints.append(
            "records are scoped by host unless the app sets scope_by_host=False: pass "
            "--host as the app saw it (the request's Host header; a port is ignored)"
        )
    if not args.principal:
        hints.append(
            "searched as the anonymous caller: if the app's principal= names callers, "
            "pass --principal as it returned it"
        )
    if args.x_forwarded_host is None and args.forwarded is None:
        hints.append(
            "behind a proxy that passes X-Forwarded-Host or Forwarded, those hosts scope "
            "the record too: pass them with --x-forwarded-host or --forwarded"
        )
    return searched, hints


def cmd_inspect(args: argparse.Namespace, out: TextIO) -> Exit:
    from asgi_idempotency.core.errors import InvalidHost, InvalidKey
    from asgi_idempotency.core.keys import parse_key, scoped_key
    from asgi_idempotency.core.lifecycle import RecordState, state_of
    from asgi_idempotency.http.request import host_scope
    from asgi_idempotency.stores.base import RecordStatus

    url = _require_url(args)
    try:
        key = parse_key(args.key.encode("utf-8", "surrogateescape"))
    except InvalidKey as exc:
        raise CLIError(Exit.USAGE, f"not a valid Idempotency-Key: {exc.detail}") from None
    try:
        # The scope the middleware builds from the same headers (port dropped alike).
        where = host_scope(
            _header(args.host) or b"", _header(args.x_forwarded_host), _header(args.forwarded)
        )
    except InvalidHost as exc:
        raise CLIError(Exit.USAGE, f"not a valid host: {exc.detail}") from None
    digest = scoped_key(args.principal, key, where)
    # KEY may also be the key digest a log line carries: tried when no record has it as
    # a client key (a 16-hex client key is valid, so the key goes first).
    prefix = args.key.lower() if _DIGEST.fullmatch(args.key) else None

    async def body(store: Any) -> Exit:
        nonlocal digest
        record = await store.get(digest)
        if record is None and prefix is not None:
            found = await store.find(prefix, limit=2)
            if len(found) > 1:
                raise CLIError(
                    Exit.USAGE,
                    f"the key digest {prefix} matches more than one record: "
                    "give more of its 64 hex digits",
                )
            if found:
                record = found[0]
                digest = record.key
        now = datetime.now(UTC)
        if record is None:
            # Never a bare "it never ran": a record scoped by a host or principal the
            # command was not given is there all the same.
            searched, hints = _searched(args)
            if args.json:
                payload: dict[str, Any] = {
                    "key_digest": digest,
                    "found": False,
                    "searched": searched,
                    "hints": hints,
                }
                if prefix is not None:
                    payload["digest_prefix"] = prefix
                print(json.dumps(payload), file=out)
                return Exit.NOT_FOUND
            forwarded = [
                f"{name} {', '.join(searched[field]) or '(none)'}"
                for name, field in (
                    ("X-Forwarded-Host", "x_forwarded_host"),
                    ("Forwarded host=", "forwarded_host"),
                )
                if searched[field] is not None
            ]
            lines = [
                ("key digest", digest),
                ("host", searched["host"] or "none (--host not given)"),
                ("principal", repr(args.principal) if args.principal else "anonymous"),
                ("forwarded", "; ".join(forwarded) or "none"),
            ]
            print("no record for this key in the scope searched:", file=out)
            for label, value in lines:
                print(f"  {label:<12} {value}", file=out)
            if prefix is not None:
                print(f"nor a record whose key digest starts with {prefix}.", file=out)
            for hint in hints:
                print(f"- {hint}", file=out)
            print(
                "With the host and principal the app saw, no record means the key never "
                "ran here, was released after a failure, or was pruned.",
                file=out,
            )
            return Exit.NOT_FOUND
        current = state_of(record, now)
        expired = current is RecordState.EXPIRED
        abandoned = current is RecordState.ABANDONED
        response = record.response
        # A lease bounds a running request; once completed it means nothing, so it is not shown.
        completed = record.status is RecordStatus.COMPLETED
        if args.json:
            payload = {
                "key_digest": digest,
                "found": True,
                "status": str(record.status),
                "created_at": _iso(record.created_at),
                "locked_until": None if completed else _iso(record.locked_until),
                "expires_at": _iso(record.expires_at),
                "expired": expired,
                "abandoned": abandoned,
                "request_hash": record.request_hash,
                "response_status": None if response is None else response.status,
                "response_bytes": None if response is None else len(response.body),
            }
            print(json.dumps(payload), file=out)
            return Exit.OK
        state = str(record.status)
        if expired:
            state += " (expired: a new request with this key runs again; awaiting prune)"
        elif abandoned:
            state += " (lease ended: the worker died or hangs; the next retry takes over)"
        elif current is RecordState.RUNNING:
            state += " (running: its lease is live)"
        lines = [
            ("key digest", digest),
            ("status", state),
            ("created", _fmt_time(record.created_at, now)),
            *([] if completed else [("lease until", _fmt_time(record.locked_until, now))]),
            ("expires", _fmt_time(record.expires_at, now)),
            ("fingerprint", record.request_hash),
            (
                "response",
                "-"
                if response is None
                else f"{response.status} ({len(response.body):,} bytes stored)",
            ),
        ]
        for label, value in lines:
            print(f"{label:<12} {value}", file=out)
        return Exit.OK

    return asyncio.run(_with_store(url, args.timeout, body))


def cmd_stats(args: argparse.Namespace, out: TextIO) -> Exit:
    from asgi_idempotency.ops.retention import table_stats
    from asgi_idempotency.stores.base import capabilities

    url = _require_url(args)

    async def body(store: Any) -> Exit:
        if not capabilities(store).stats:
            why = kind_of(url).why_not("stats")
            raise CLIError(Exit.USAGE, f"stats: this store cannot count its records ({why})")
        stats = await table_stats(store)
        if args.json:
            payload = {
                "now": _iso(stats.now),
                "total": stats.total,
                "live": dict(stats.live),
                "expired": stats.expired,
                "abandoned": stats.abandoned,
                "oldest_in_progress": _iso(stats.oldest_in_progress),
            }
            print(json.dumps(payload), file=out)
            return Exit.OK
        print(f"{'records':<30} {stats.total:>12,}", file=out)
        for status in ("completed", "in_progress"):
            print(f"  {'live ' + status:<28} {stats.live.get(status, 0):>12,}", file=out)
        print(f"  {'in_progress, lease ended':<28} {stats.abandoned:>12,}", file=out)
        print(f"  {'expired, awaiting prune':<28} {stats.expired:>12,}", file=out)
        oldest = _fmt_time(stats.oldest_in_progress, stats.now)
        print(f"{'oldest live in_progress':<30} {oldest}", file=out)
        return Exit.OK

    return asyncio.run(_with_store(url, args.timeout, body))


def _duration(text: str) -> timedelta:
    from asgi_idempotency.ops.audit import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cmd_audit(args: argparse.Namespace, out: TextIO) -> Exit:
    from asgi_idempotency.migrations import schema_problem
    from asgi_idempotency.ops.audit import extra_keys_by_route, suspected_duplicates
    from asgi_idempotency.stores.base import capabilities

    url = _require_url(args)
    if args.format == "prometheus":
        try:
            from prometheus_client import CollectorRegistry, generate_latest

            from asgi_idempotency.observability.prometheus import PrometheusMetrics
        except ImportError as exc:
            raise CLIError(Exit.USAGE, f"--format prometheus: {exc}") from None

    async def body(store: Any) -> Exit:
        if capabilities(store).migrations:
            # Read-only, like stats: a table from before revision 0003 is reported (exit
            # 4), not upgraded (the app upgrades its own SQLite file at start).
            with _store_errors(url):
                async with store.engine.connect() as conn:
                    problem = await conn.run_sync(schema_problem)
            if problem is not None:
                raise CLIError(
                    Exit.NO_SCHEMA,
                    f"{problem} in {redact(url)}: run `asgi-idempotency migrate` first",
                )
        now = datetime.now(UTC)
        found = await suspected_duplicates(
            store, since=args.since, window=args.window, route=args.route, now=now
        )
        if args.format == "json":
            payload = {
                "now": _iso(now),
                "since": _iso(now - args.since),
                "window_s": args.window.total_seconds(),
                "route": args.route,
                "suspected": [
                    {
                        "route": run.route,
                        "caller_digest": run.scope_digest,
                        "request_digest": run.request_hash,
                        "requests": run.requests,
                        "keys": run.keys,
                        "first": _iso(run.first),
                        "last": _iso(run.last),
                    }
                    for run in found
                ],
            }
            print(json.dumps(payload), file=out)
        elif args.format == "prometheus":
            registry = CollectorRegistry()
            PrometheusMetrics(registry).observe_audit(found)
            out.write(generate_latest(registry).decode())
        elif not found:
            print(
                f"no suspected duplicates since {now - args.since:%Y-%m-%d %H:%M:%S} UTC "
                f"(window {_fmt_span(args.window.total_seconds())})",
                file=out,
            )
        else:
            extra = sum(extra_keys_by_route(found).values())
            print(
                f"{len(found)} suspected duplicate run{'s' if len(found) != 1 else ''} "
                f"({extra} request{'s' if extra != 1 else ''} repeated under another key): "
                "the same caller, route and body under different keys",
                file=out,
            )
            print(
                f"{'route':<32} {'caller':<16} {'request':<16} {'requests':>8} {'keys':>5}  "
                f"{'first':<19} last",
                file=out,
            )
            for run in found:
                print(
                    f"{run.route:<32} {run.scope_digest[:16]:<16} {run.request_hash[:16]:<16} "
                    f"{run.requests:>8} {run.keys:>5}  {run.first:%Y-%m-%d %H:%M:%S} "
                    f"{run.last:%Y-%m-%d %H:%M:%S}",
                    file=out,
                )
        return Exit.FOUND if found else Exit.OK

    return asyncio.run(_with_store(url, args.timeout, body))


def _require_demo_extra() -> None:
    """Both demos serve with uvicorn and call with httpx: the ``demo`` extra."""
    for name in ("uvicorn", "httpx"):
        try:
            importlib.import_module(name)
        except ImportError:
            raise CLIError(
                Exit.USAGE,
                f"the demo needs {name}, which is not installed: "
                "pip install 'asgi-idempotency[demo]'",
            ) from None


def cmd_demo(args: argparse.Namespace, out: TextIO) -> Exit:
    _require_demo_extra()
    if args.kill_after_write:
        return _kill_demo(_require_url(args, existing=False), out)
    # Without --database-url the incident demo brings its own throwaway SQLite files
    # (the environment's URL is the operator's store, not asked for here); with a
    # Postgres one it runs on scratch databases on that server, dropped afterwards.
    from asgi_idempotency.ops.demo import run_demo

    url = None
    if args.database_url:
        url = _require_url(args, existing=False)
        kind = kind_of(url)
        if not kind.capabilities.migrations:
            # It writes its refunds in a table of its own beside the records.
            raise CLIError(Exit.USAGE, f"the demo runs on Postgres or SQLite, not {kind.name}")
    code = _demo_database(url, lambda: run_demo(url))
    return Exit(code) if code in (Exit.OK, Exit.NOT_FOUND) else Exit.INTERNAL


def _demo_database(url: str | None, run: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """``asyncio.run(run())``, with the database's failures as exit 3 and one line."""
    if url is None:
        return asyncio.run(run())
    try:
        with _store_errors(url):
            return asyncio.run(run())
    except StoreError as exc:
        raise _database_error(exc, url) from exc


def _kill_demo(url: str, out: TextIO) -> Exit:
    from asgi_idempotency.ops.demo import kill_after_write, scratch_database

    if not url.startswith("postgresql"):
        raise CLIError(Exit.USAGE, "--kill-after-write needs a Postgres --database-url")

    def say(text: str) -> None:
        print(text, file=out, flush=True)

    async def both() -> tuple[tuple[int, int], tuple[int, int]]:
        # Its refunds and records go to a database of its own, not the user's.
        async with scratch_database(url, say=say) as scratch:
            default = await kill_after_write(scratch, transactional=False, say=say)
            say("")
            return default, await kill_after_write(scratch, transactional=True, say=say)

    default, transactional = _demo_database(url, both)
    say(
        f"\nDefault mode: {default[1]} refunds (the crash left one, the retry made another). "
        f"Transactional mode: {transactional[1]} refund."
    )
    return Exit.OK if (default, transactional) == ((1, 2), (0, 1)) else Exit.NOT_FOUND


def _header_arg(text: str) -> tuple[str, str]:
    """``'Name: value'`` as curl takes it."""
    name, sep, value = text.partition(":")
    if not sep or not name.strip() or name != name.strip() or " " in name:
        raise argparse.ArgumentTypeError(f"must be 'Name: value', got {text!r}")
    return name, value.strip()


def _json_body(text: str) -> bytes:
    try:
        json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"is not JSON ({exc})") from None
    return text.encode()


def _storm(text: str) -> int:
    value = _count(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be 2 or more, got {text!r}")
    return value


def _status(text: str) -> int:
    value = _count(text)
    if not 400 <= value <= 599:
        raise argparse.ArgumentTypeError(f"must be a 4xx or 5xx status, got {text!r}")
    return value


def cmd_check(args: argparse.Namespace, out: TextIO) -> Exit:
    try:
        import httpx

        from asgi_idempotency.ops.check import CheckOptions, run_checks
    except ImportError:
        raise CLIError(
            Exit.USAGE,
            "check needs httpx, which is not installed: pip install 'asgi-idempotency[client]'",
        ) from None
    headers = tuple(args.header)
    content_type = next((v for n, v in headers if n.lower() == "content-type"), None)
    body: bytes = args.json if args.json is not None else (args.data or "").encode()
    if args.json is not None and content_type is None:
        content_type = "application/json"
    other: bytes | None = None
    if args.other_json is not None:
        other = args.other_json
    elif args.other_data is not None:
        other = args.other_data.encode()

    def resolve(url: str | None) -> str | None:
        return None if url is None else str(httpx.URL(args.url).join(url))

    try:
        options = CheckOptions(
            url=args.url,
            method=args.method.upper(),
            body=body,
            content_type=content_type,
            headers=headers,
            other_caller_headers=tuple(args.other_caller_header),
            other_body=other,
            storm=args.storm,
            max_requests=args.max_requests,
            mismatch_status=args.mismatch_status,
            key_required=not args.key_optional,
            count_url=resolve(args.count_url),
            slow_url=resolve(args.slow_url),
            hold=args.hold,
            fail_header=args.fail_header,
            timeout=args.request_timeout,
        )
    except (ValueError, httpx.InvalidURL) as exc:
        raise CLIError(Exit.USAGE, str(exc)) from None

    async def run() -> Any:
        # No environment proxies: the requests go to the URL's origin and nowhere else.
        async with httpx.AsyncClient(trust_env=False) as client:
            return await run_checks(client, options)

    report = asyncio.run(run())
    if args.format == "json":
        print(json.dumps(report.to_dict(), indent=2), file=out)
    else:
        print(report.table(), file=out)
    return Exit.OK if report.ok else Exit.NOT_FOUND


def _require_url(args: argparse.Namespace, *, existing: bool = True) -> str:
    """The command's database URL, with its async driver.

    With ``existing``, a SQLite file must already be there: opening a missing one would
    create an empty database, hiding a typo in the path behind "table missing".
    """
    url: str | None = args.database_url or os.environ.get(ENV_URL)
    if not url:
        raise CLIError(Exit.USAGE, f"no database: pass --database-url URL or set {ENV_URL}")
    try:
        url = kind_of(url).url(url)  # as its store reads it (SQL: with its async driver)
    except ValueError as exc:
        raise CLIError(Exit.USAGE, str(exc)) from None
    path = sqlite_path(url)
    if existing and path is not None and not Path(path).exists():
        raise CLIError(
            Exit.UNREACHABLE,
            f"no SQLite database at {Path(path).absolute()}: the file does not exist "
            "(check the path; `asgi-idempotency migrate` creates it)",
        )
    return url


# --- parser -------------------------------------------------------------------


# argparse names a type function in its message when it raises ValueError ("invalid
# _positive_float value"), so these raise ArgumentTypeError with the whole sentence.
_MAX_COUNT = 2**31 - 1  # fits every SQL integer type a LIMIT may be bound as


def _count(text: str) -> int:
    """A whole number from 1 to ``_MAX_COUNT`` (rows, batches)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if not 1 <= value <= _MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be between 1 and {_MAX_COUNT:,}, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    return value


def _timeout(text: str) -> float:
    """Seconds, more than 0 and finite."""
    value = _seconds(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text!r}")
    return value


def _pause(text: str) -> float:
    """Seconds, 0 or more and finite."""
    value = _seconds(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asgi-idempotency",
        description="Operate the idempotency records table.",
        epilog=_exit_codes_help(),
        # Keeps the epilog's one line per exit code; the description is one line anyway.
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    # Accepted before or after the command; the one after wins.
    common = argparse.ArgumentParser(add_help=False)
    for p, default in ((parser, None), (common, argparse.SUPPRESS)):
        p.add_argument(
            "--database-url",
            default=default,
            # ACCEPTED: the same list every URL error shows, Redis schemes included.
            help=f"{ACCEPTED} (default: ${ENV_URL})",
        )
        p.add_argument(
            "--timeout",
            type=_timeout,
            default=10.0 if default is None else default,
            help="seconds to wait for the database per statement (default 10)",
        )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "migrate", parents=[common], help="upgrade the schema to the latest revision"
    )
    p.set_defaults(func=cmd_migrate)

    p = sub.add_parser("prune", parents=[common], help="delete expired records in batches")
    p.add_argument(
        "--batch-size", type=_count, default=1000, help="rows per statement (default 1000)"
    )
    p.add_argument("--dry-run", action="store_true", help="count what would go; delete nothing")
    p.add_argument("--pause", type=_pause, default=0.0, help="seconds between batches (default 0)")
    p.add_argument(
        "--max-batches", type=_count, default=1_000_000, help="stop after this many batches"
    )
    p.add_argument("--quiet", action="store_true", help="print nothing on success")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_prune)

    p = sub.add_parser(
        "inspect",
        parents=[common],
        help="show the record for a key: did it run, when, with what result",
        description=(
            "KEY is the Idempotency-Key as the client sent it, or the key_digest a log "
            "line carries (16 to 64 hex digits), tried when no record has KEY as its key. "
            "A key is looked up in one scope: the host (--host, and --x-forwarded-host or "
            "--forwarded when a proxy passed them on) and the principal (--principal), "
            "each as the app saw it; a digest needs neither. "
            "Exit code 0 when a record exists (expired or not), 1 when none does, 2 when "
            "a digest prefix matches several records."
        ),
    )
    p.add_argument(
        "key",
        metavar="KEY",
        help="the Idempotency-Key as the client sent it, or the key digest from the logs",
    )
    p.add_argument(
        "--principal",
        default="",
        help="who owns the key (default: anonymous); a digest needs none",
    )
    p.add_argument(
        "--host",
        default="",
        metavar="HOST",
        help="the Host header the request reached the app with, e.g. shop.example or "
        "shop.example:8443 (the port is ignored, as the middleware ignores it); records "
        "are scoped by host unless the app sets scope_by_host=False; a digest needs none",
    )
    p.add_argument(
        "--x-forwarded-host",
        default=None,
        metavar="VALUE",
        help="the X-Forwarded-Host header the request carried, if any (a proxy's; it "
        "scopes the record beside Host)",
    )
    p.add_argument(
        "--forwarded",
        default=None,
        metavar="VALUE",
        help="the Forwarded header the request carried, if any (its host= parameters "
        "scope the record beside Host)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser(
        "stats", parents=[common], help="row counts by status, expired, oldest in progress"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser(
        "audit",
        parents=[common],
        help="find likely duplicates keys could not catch (a key minted inside a retry loop)",
        description=(
            "Lists runs of requests from one caller (host and principal, as a digest) to "
            "one route with the same body under different Idempotency-Keys, each within "
            "--window of the one before, claimed in the last --since: what a client that "
            "mints its key inside its retry loop leaves behind. Reads the records every "
            "worker wrote (records not yet expired). Exit code 0 when nothing is found, "
            "1 when something is, 2 on a usage error, 3 when the store is unreachable, 4 "
            "when the schema is missing or not migrated."
        ),
    )
    p.add_argument(
        "--since",
        type=_duration,
        default=timedelta(hours=1),
        help="how far back to look: 30s, 10m, 1h, 2d (default 1h)",
    )
    p.add_argument(
        "--window",
        type=_duration,
        default=timedelta(minutes=10),
        help="the longest gap between two requests of one run (default 10m)",
    )
    p.add_argument("--route", metavar="TEMPLATE", help="only this route template, e.g. /refunds")
    p.add_argument(
        "--format",
        choices=("table", "json", "prometheus"),
        default="table",
        help="prometheus: the gauge idempotency_audit_suspected_regenerated_keys{route} "
        "as exposition text (for node_exporter's textfile collector)",
    )
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser(
        "demo",
        help="replay the refund incident with and without the guard (throwaway databases)",
        description=(
            "Exit code 0 when the guarded run made 1 refund and the unguarded 2, else 1. "
            "With --kill-after-write (Postgres): a worker SIGKILLed after writing a refund, "
            "in the default and the transactional mode; 0 when they end with 2 and 1 refunds. "
            "On Postgres both run on scratch databases created on the server the URL names "
            "and dropped afterwards (the user needs CREATEDB); without a URL, or on SQLite, "
            "on throwaway SQLite files."
        ),
    )
    p.add_argument(
        "--database-url",
        default=None,
        help="a Postgres server to run on (scratch databases; required for --kill-after-write)",
    )
    p.add_argument(
        "--kill-after-write",
        action="store_true",
        help="crash a worker between its write and its answer, in both modes (needs Postgres)",
    )
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "check",
        help="check an HTTP API's Idempotency-Key handling (any API, any host)",
        description=(
            "Sends what real clients send to URL and reports each check as pass, fail or "
            "not run (with why). Every check makes real effects on the API (a sandbox "
            "refunds for real there). Sends at most --max-requests requests, all to URL's "
            "origin, following no redirect. Exit code 0 when no check failed, 1 when one "
            "did (each is named), 2 on a usage error. Needs httpx (the client extra)."
        ),
    )
    p.add_argument("url", metavar="URL", help="the endpoint that takes an Idempotency-Key")
    p.add_argument("--method", default="POST", help="the request's method (default POST)")
    body = p.add_mutually_exclusive_group()
    body.add_argument("--json", type=_json_body, metavar="BODY", help="a JSON body to send")
    body.add_argument("--data", metavar="BODY", help="a body to send as is")
    p.add_argument(
        "--header",
        type=_header_arg,
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="a header on every request, e.g. the caller's credentials (repeatable)",
    )
    p.add_argument(
        "--other-caller-header",
        type=_header_arg,
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="a second caller's header, replacing --header of the same name (repeatable)",
    )
    other = p.add_mutually_exclusive_group()
    other.add_argument(
        "--other-json",
        type=_json_body,
        metavar="BODY",
        help="another valid body for the key-reuse check (default: the first number + 1)",
    )
    other.add_argument("--other-data", metavar="BODY", help="the same, sent as is")
    p.add_argument(
        "--storm", type=_storm, default=10, help="concurrent duplicates in the storm (default 10)"
    )
    p.add_argument(
        "--max-requests",
        type=_count,
        default=50,
        help="never send more requests than this; checks that would are not run (default 50)",
    )
    p.add_argument(
        "--count-url",
        metavar="URL",
        help="a URL (or path) on the same origin whose GET answers the number of effects "
        '(a JSON integer or {"count": n}): the storm counts effects there',
    )
    p.add_argument(
        "--slow-url",
        metavar="URL",
        help="an endpoint (or path) on the same origin that runs longer than --hold, "
        "for the in-flight check (default: URL)",
    )
    p.add_argument(
        "--hold",
        type=_pause,
        default=0.25,
        help="seconds between the first request and its duplicate in the in-flight check "
        "(default 0.25; the endpoint must run longer)",
    )
    p.add_argument(
        "--mismatch-status",
        type=_status,
        default=422,
        help="the status the API documents for a key reused with another body (default 422)",
    )
    p.add_argument(
        "--key-optional",
        action="store_true",
        help="the route does not require a key: the missing-key check is not run",
    )
    p.add_argument(
        "--fail-header",
        type=_header_arg,
        metavar="'NAME: VALUE'",
        help="a header that makes the endpoint answer 5xx, for the 5xx-releases-key check",
    )
    p.add_argument(
        "--request-timeout",
        type=_timeout,
        default=30.0,
        help="seconds to wait for each answer (default 30)",
    )
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.set_defaults(func=cmd_check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit code (see the module docstring)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) and usage errors (2)
        return exc.code if isinstance(exc.code, int) else Exit.USAGE
    out = sys.stdout
    try:
        code: Exit = args.func(args, out)
    except CLIError as exc:
        print(f"asgi-idempotency {args.command}: {exc}", file=sys.stderr)
        return int(exc.code)
    except KeyboardInterrupt:
        print(f"asgi-idempotency {args.command}: interrupted", file=sys.stderr)
        return int(Exit.INTERRUPTED)
    except Exception:
        traceback.print_exc()
        print(
            f"asgi-idempotency {args.command}: internal error (a bug; please report it)",
            file=sys.stderr,
        )
        return int(Exit.INTERNAL)
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
