"""What every command shares: exit codes, the error that ends a command, the database URL,
the store, and how times are shown.

A command is a plain function with typed parameters that returns its exit code
(:func:`command` turns its :class:`CLIError` into a line on stderr and that code).
"""

from __future__ import annotations

import enum
import functools
import os
import sys
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AbstractContextManager, nullcontext
from datetime import datetime
from pathlib import Path
from typing import Any, ParamSpec, TextIO, TypeVar

from asgi_idempotency.core.errors import SchemaMissing, StoreError
from asgi_idempotency.core.keys import check_namespace
from asgi_idempotency.stores.registry import StoreKind, kind_of
from asgi_idempotency.stores.urls import ENV_URL, redact, sqlite_path
from asgi_idempotency.stores.urls import async_url as normalize_url

__all__ = [
    "EXIT_MEANINGS",
    "CLIError",
    "Exit",
    "command",
    "database_error",
    "fmt_span",
    "fmt_time",
    "header",
    "host_of",
    "iso",
    "namespace_of",
    "nothing_to",
    "output",
    "plural",
    "require_url",
    "run_on_database",
    "store_errors",
    "with_store",
]

_P = ParamSpec("_P")
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
        "check: httpx not installed, a URL on another origin than the checked one, "
        "the URL could not be reached (refused, no such name, TLS failed)"
    ),
    Exit.UNREACHABLE: (
        "database unreachable or failing (refused, timed out, bad credentials, "
        "no such database or SQLite file)"
    ),
    Exit.NO_SCHEMA: "the records table is missing: run `asgi-idempotency migrate`",
    Exit.INTERNAL: "unexpected internal error (a bug: the traceback is printed)",
    Exit.INTERRUPTED: "interrupted (Ctrl-C)",
}


class CLIError(Exception):
    """Ends the command with a message on stderr and an exit code."""

    def __init__(self, code: Exit, message: str) -> None:
        super().__init__(message)
        self.code = code


def reported(name: str, call: Callable[[], int]) -> int:
    """``call()``'s exit code; a :class:`CLIError` printed as one line (its code), an
    interrupt as one line (130), anything else a traceback and 70: a bug."""
    try:
        return int(call())
    except CLIError as exc:
        print(f"asgi-idempotency {name}: {exc}", file=sys.stderr)
        return int(exc.code)
    except KeyboardInterrupt:
        print(f"asgi-idempotency {name}: interrupted", file=sys.stderr)
        return int(Exit.INTERRUPTED)
    except Exception:
        traceback.print_exc()
        print(f"asgi-idempotency {name}: internal error (a bug; please report it)", file=sys.stderr)
        return int(Exit.INTERNAL)


def command(name: str) -> Callable[[Callable[_P, int]], Callable[_P, int]]:
    """Makes ``func`` the command ``name``: its :class:`CLIError` becomes one line on stderr
    (``asgi-idempotency NAME: ...``) and its code, Ctrl-C 130, any other exception the
    traceback and 70. The function keeps its signature and returns an int."""

    def decorate(func: Callable[_P, int]) -> Callable[_P, int]:
        @functools.wraps(func)
        def run(*args: _P.args, **kwargs: _P.kwargs) -> int:
            return reported(name, functools.partial(func, *args, **kwargs))

        return run

    return decorate


def output(out: TextIO | None) -> TextIO:
    """Where a command prints: ``out``, else standard output as it is at the call."""
    return sys.stdout if out is None else out


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``1 request``, ``2 requests``, ``1,000 requests``."""
    return f"{count:,} {noun if count == 1 else (nouns or noun + 's')}"


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


def database_error(exc: StoreError, url: str) -> CLIError:
    """The exit code and the line for a store failure (:func:`_failure_table`)."""
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    for kind, code, text in _failure_table():
        if isinstance(exc, kind):
            return CLIError(code, text.format(url=redact(url), reason=reason))
    raise AssertionError("StoreError is the table's last row")  # pragma: no cover


def store_errors(url: str) -> AbstractContextManager[None]:
    """The error boundary of the SQL driver ``url`` names: its failures become StoreError."""
    from sqlalchemy import make_url

    from asgi_idempotency.stores.sql.dialect import dialect_named

    try:
        return dialect_named(make_url(normalize_url(url)).get_backend_name()).errors
    except ValueError:  # not a SQL backend: the command itself says so
        return nullcontext()


def fmt_time(value: datetime | None, now: datetime) -> str:
    if value is None:
        return "-"
    delta = (value - now).total_seconds()
    when = "from now" if delta > 0 else "ago"
    return f"{value.isoformat(timespec='seconds')} ({fmt_span(abs(delta))} {when})"


def fmt_span(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


async def with_store(
    url: str, command_timeout: float, body: Callable[[Any], Awaitable[Exit]]
) -> Exit:
    """``body(store)`` on the store ``url`` names, closed afterwards; its failures as
    :class:`CLIError` (:func:`database_error`)."""
    kind = kind_of(url)
    try:
        store = kind.build(url, command_timeout=command_timeout, **kind.cli_options)
    except (ImportError, ValueError) as exc:  # its extra is missing, or it refused the URL
        raise CLIError(Exit.USAGE, str(exc)) from None
    try:
        return await body(store)
    except StoreError as exc:
        raise database_error(exc, url) from exc
    finally:
        await store.close()


def run_on_database(url: str | None, run: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """``asyncio.run(run())``, with the database's failures as exit 3 and one line."""
    import asyncio

    if url is None:
        return asyncio.run(run())
    try:
        with store_errors(url):
            return asyncio.run(run())
    except StoreError as exc:
        raise database_error(exc, url) from exc


def nothing_to(command: str, capability: str, kind: StoreKind) -> str:
    """What ``command`` says on a kind of store that lacks ``capability``, exiting 0."""
    return f"nothing to {command}: {kind.why_not(capability)}"


def require_url(database_url: str | None, *, existing: bool = True) -> str:
    """The command's database URL (``database_url``, else ``$IDEMPOTENCY_DATABASE_URL``),
    as its store reads it (SQL: with its async driver).

    With ``existing``, a SQLite file must already be there: opening a missing one would
    create an empty database, hiding a typo in the path behind "table missing".
    """
    url: str | None = database_url or os.environ.get(ENV_URL)
    if not url:
        raise CLIError(Exit.USAGE, f"no database: pass --database-url URL or set {ENV_URL}")
    try:
        url = kind_of(url).url(url)
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


# The middleware's namespace rule (issue #41 item 4): 1 to 64 letters, digits, ".", "_", "-".


def namespace_of(namespace: str) -> str:
    """``namespace`` as the middleware takes it ("" for none); else a usage error."""
    if not namespace:
        return namespace
    try:
        return check_namespace(namespace)  # the middleware's own rule
    except ValueError as exc:
        raise CLIError(Exit.USAGE, str(exc)) from None


def header(value: str | None) -> bytes | None:
    """A header value given on the command line, as the server would hand it on."""
    return None if value is None else value.encode("utf-8", "surrogateescape")


def host_of(host: str, x_forwarded_host: str | None, forwarded: str | None) -> str:
    """The host part of the scope the middleware builds from the same headers (the port
    dropped alike); an invalid one is a usage error."""
    from asgi_idempotency.core.errors import InvalidHost
    from asgi_idempotency.http.request import host_scope

    try:
        return host_scope(header(host) or b"", header(x_forwarded_host), header(forwarded))
    except InvalidHost as exc:
        raise CLIError(Exit.USAGE, f"not a valid host: {exc.detail}") from None
