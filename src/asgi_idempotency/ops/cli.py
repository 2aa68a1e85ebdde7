"""``asgi-idempotency``: operate the records table from a shell or a cron job.

Commands: ``migrate``, ``prune``, ``inspect KEY``, ``stats``, ``audit``,
``scope-digest PRINCIPAL``, ``demo``, ``check URL``. Each is a plain function with typed
parameters that returns its exit code, one module per command in
:mod:`asgi_idempotency.ops.commands` (callable from Python without this parser); this
module is the one argparse layer over them.
The database (all but ``scope-digest``, ``demo`` and ``check``) comes from ``--database-url`` or
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
      httpx not installed, a URL on another origin than the checked one, the URL
      could not be reached (refused, no such name, TLS failed)
3     database unreachable or failing (refused, timed out, bad credentials, no
      such database or SQLite file)
4     the records table is missing: run `asgi-idempotency migrate`
70    unexpected internal error (a bug: the traceback is printed)
130   interrupted (Ctrl-C)
====  =========================================================================
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import math
import sys
import textwrap
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TextIO

from asgi_idempotency import __version__
from asgi_idempotency.ops import commands
from asgi_idempotency.ops.commands._common import (
    EXIT_MEANINGS,
    Exit,
    nothing_to,
    reported,
)
from asgi_idempotency.stores.registry import kind_of
from asgi_idempotency.stores.urls import ACCEPTED, ENV_URL
from asgi_idempotency.stores.urls import async_url as normalize_url

__all__ = [
    "ENV_URL",
    "EXIT_MEANINGS",
    "REDIS_MIGRATE",
    "REDIS_PRUNE",
    "Exit",
    "build_parser",
    "main",
    "normalize_url",
]

#: What ``prune`` says on Redis, where there is nothing for it to do.
REDIS_PRUNE = nothing_to("prune", "prune", kind_of("redis://"))

#: What ``migrate`` says on Redis, where there is nothing for it to do.
REDIS_MIGRATE = nothing_to("migrate", "migrations", kind_of("redis://"))

_Command = Callable[[argparse.Namespace, TextIO], int]


def _from_args(func: Callable[..., int]) -> _Command:
    """The command ``func`` called with the parsed options its parameters name."""
    names = [n for n in inspect.signature(func).parameters if n != "out"]

    def call(args: argparse.Namespace, out: TextIO) -> int:
        given = vars(args)
        return func(**{n: given[n] for n in names if n in given}, out=out)

    call.__doc__ = func.__doc__
    return call


# One per command, looked up when the parser is built (a test may replace one).
cmd_migrate = _from_args(commands.migrate)
cmd_prune = _from_args(commands.prune)
cmd_inspect = _from_args(commands.inspect)
cmd_stats = _from_args(commands.stats)
cmd_audit = _from_args(commands.audit)
cmd_scope_digest = _from_args(commands.scope_digest)
cmd_demo = _from_args(commands.demo)
cmd_check = _from_args(commands.check)


def _exit_codes_help() -> str:
    lines = ["exit codes:"]
    for code, meaning in EXIT_MEANINGS.items():
        lines += textwrap.wrap(
            meaning, width=78, initial_indent=f"  {int(code):<5}", subsequent_indent=" " * 7
        )
    return "\n".join(lines)


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


def _duration(text: str) -> timedelta:
    from asgi_idempotency.ops.audit import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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


def _namespace_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--namespace",
        default="",
        metavar="NAME",
        help="the namespace the app gave IdempotencyMiddleware (namespace=), if any: "
        "keys and caller digests are scoped by it",
    )


def _scope_options(p: argparse.ArgumentParser) -> None:
    """A caller's scope as the middleware built it: host, forwarded hosts, namespace."""
    p.add_argument(
        "--host",
        default="",
        metavar="HOST",
        help="the Host header the request reached the app with, e.g. shop.example or "
        "shop.example:8443 (the port is ignored, as the middleware ignores it); records "
        "are scoped by host unless the app sets scope_by_host=False",
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
    _namespace_option(p)


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
    p.add_argument("--json", dest="as_json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_prune)

    p = sub.add_parser(
        "inspect",
        parents=[common],
        help="show the record for a key: did it run, when, with what result",
        description=(
            "KEY is the Idempotency-Key as the client sent it, or the key_digest a log "
            "line carries (16 to 64 hex digits), tried when no record has KEY as its key. "
            "A key is looked up in one scope: the host (--host, and --x-forwarded-host or "
            "--forwarded when a proxy passed them on), the principal (--principal) and the "
            "namespace (--namespace), each as the app saw it; a digest needs none of them "
            "(the audit lists the digests of the records it suspects). "
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
    _scope_options(p)
    p.add_argument("--json", dest="as_json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser(
        "stats", parents=[common], help="row counts by status, expired, oldest in progress"
    )
    p.add_argument("--json", dest="as_json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser(
        "audit",
        parents=[common],
        help="find likely duplicates keys could not catch (a key minted inside a retry loop)",
        description=(
            "Lists runs of requests from one caller (host and principal, as a digest: "
            "scope-digest PRINCIPAL prints a caller's) to "
            "one route with the same body under different Idempotency-Keys, each within "
            "--window of the one before, claimed in the last --since: what a client that "
            "mints its key inside its retry loop leaves behind, with the key digests of its "
            "records (inspect takes them). Reads the records every "
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
    _namespace_option(p)
    p.add_argument(
        "--format",
        dest="output_format",
        choices=("table", "json", "prometheus"),
        default="table",
        help="prometheus: the gauge idempotency_audit_suspected_regenerated_keys{route} "
        "alone, as exposition text (for node_exporter's textfile collector)",
    )
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser(
        "scope-digest",
        help="print the caller digest the audit shows for a principal (host, namespace)",
        description=(
            "The audit names callers only by a digest of (namespace, host, principal). "
            "This prints that digest for PRINCIPAL as the app's principal= returns it, "
            "with the host and namespace as the middleware saw them, so a finding's "
            "caller column can be matched to a merchant. Needs no database."
        ),
    )
    p.add_argument(
        "principal",
        metavar="PRINCIPAL",
        help="the caller as the app's principal= returns it ('' for the anonymous caller)",
    )
    _scope_options(p)
    p.set_defaults(func=cmd_scope_digest)

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
            "did (each is named), 2 on a usage error or when URL cannot be reached (one "
            "line says what). Needs httpx (the client extra)."
        ),
    )
    p.add_argument("url", metavar="URL", help="the endpoint that takes an Idempotency-Key")
    p.add_argument("--method", default="POST", help="the request's method (default POST)")
    body = p.add_mutually_exclusive_group()
    body.add_argument(
        "--json", dest="json_body", type=_json_body, metavar="BODY", help="a JSON body to send"
    )
    body.add_argument("--data", metavar="BODY", help="a body to send as is")
    p.add_argument(
        "--header",
        dest="headers",
        type=_header_arg,
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="a header on every request, e.g. the caller's credentials (repeatable)",
    )
    p.add_argument(
        "--other-caller-header",
        dest="other_caller_headers",
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
        "--expect-wait",
        action="store_true",
        help="the route holds a duplicate until the first is done and replays its answer "
        "(Policy(wait=...)): the in-flight check expects that, not 409 (in-flight-wait)",
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
    p.add_argument("--format", dest="output_format", choices=("table", "json"), default="table")
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
    return reported(args.command, functools.partial(args.func, args, out))


if __name__ == "__main__":
    sys.exit(main())
