"""The one rule for database URLs, shared by :class:`SQLStore`, the CLI and alembic's ``env.py``.

A URL that names a database but no driver gets the async one (asyncpg, aiosqlite,
asyncmy); one that names any other driver is refused with a :class:`ValueError` listing
the accepted spellings (:data:`ACCEPTED`, the registry's :func:`.registry.accepted`), as
is a SQLite URL with a host where its path belongs. libpq's ``?sslmode=`` becomes
asyncpg's ``?ssl=``, and libpq's multi-host form
(``postgresql://user@h1:5432,h2:5432/db?target_session_attrs=read-write``, a primary and
its standby as HA guides and cloud consoles write them) becomes the host and port lists
SQLAlchemy's asyncpg dialect takes (``?host=h1,h2&port=5432,5432``; its own
``?host=h1:5432&host=h2:5432`` spelling becomes the same). Redis URLs
(:data:`REDIS_SCHEMES`) pass through unchanged; :func:`.registry.kind_of` tells them apart.
Messages never carry a password: show URLs through :func:`redact`, which shows every
host of a multi-host URL. The full table: docs/guide/postgres.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

# The Redis schemes are the registry's (its Redis line); importable from here as before.
from asgi_idempotency.stores.registry import REDIS_CLUSTER_SCHEMES as REDIS_CLUSTER_SCHEMES
from asgi_idempotency.stores.registry import REDIS_SCHEMES as REDIS_SCHEMES
from asgi_idempotency.stores.registry import REDIS_SENTINEL_SCHEMES as REDIS_SENTINEL_SCHEMES
from asgi_idempotency.stores.registry import accepted

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

__all__ = [
    "ACCEPTED",  # noqa: F822 - the registry's list, read when asked (__getattr__)
    "ENV_URL",
    "REDIS_CLUSTER_SCHEMES",
    "REDIS_SCHEMES",
    "REDIS_SENTINEL_SCHEMES",
    "async_url",
    "host_list",
    "redact",
    "sqlite_path",
]

#: The environment variable the CLI and alembic's ``env.py`` read the database URL from.
ENV_URL = "IDEMPOTENCY_DATABASE_URL"


def __getattr__(name: str) -> str:
    # ACCEPTED: the list of every kind the registry holds now, ours and any registered.
    if name == "ACCEPTED":
        return accepted()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Backend (the part of the scheme before "+") -> (canonical backend, the one async driver).
_ASYNC = {
    "postgresql": ("postgresql", "asyncpg"),
    "postgres": ("postgresql", "asyncpg"),
    "sqlite": ("sqlite", "aiosqlite"),
    # SQLAlchemy names the dialect after the URL: mariadb:// is "mariadb" (MariaDB's
    # SQL only), mysql:// is "mysql", which detects a MariaDB server when it connects.
    "mariadb": ("mariadb", "asyncmy"),
    "mysql": ("mysql", "asyncmy"),
}


#: libpq's port, where a host of a multi-host URL names none.
PG_PORT = 5432


def host_list(url: str, default_port: int) -> list[tuple[str, int]] | None:
    """The hosts of a URL that names several before its path, libpq's multi-host form
    (``scheme://user:password@h1:5432,h2,[::1]:5433/...``), each with its port
    (``default_port`` where it names none); ``None`` when the URL names one host or none.

    Raises:
        ValueError: an empty host in the list, or a port that is not a number from 1 to
            65535 (the message names the host, never the password).
    """
    netloc = urlsplit(url).netloc
    hosts = netloc.rpartition("@")[2]
    if "," not in hosts:
        return None
    return [_host_port(entry, default_port) for entry in hosts.split(",")]


def _host_port(entry: str, default_port: int) -> tuple[str, int]:
    """``host``, ``host:port``, ``[v6]`` or ``[v6]:port``; a bare IPv6 address (only in a
    ``?host=`` list, where no port can follow it) is the host alone."""
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        port = rest.removeprefix(":")
        bad = not rest.startswith(":") and rest != ""
    elif entry.count(":") > 1:
        host, port, bad = entry, "", False
    else:
        host, _, port = entry.partition(":")
        bad = False
    if bad or not host or (port and not (port.isdigit() and 0 < int(port) < 65536)):
        raise ValueError(
            f"malformed host {entry!r} in a multi-host URL: write host1:port1,host2:port2, "
            f"or host1,host2 for port {default_port}"
        )
    return host, int(port) if port else default_port


def _libpq_hosts(url: str) -> str:
    """libpq's ``postgresql://user@h1:p1,h2:p2/db`` as ``postgresql://user@/db?host=h1,h2&port=p1,p2``:
    the host and port lists SQLAlchemy's asyncpg dialect passes to asyncpg, which tries
    them in order (and, with ``target_session_attrs=read-write``, takes the primary)."""
    hosts = host_list(url, PG_PORT)
    if hosts is None:
        return url
    scheme = url.partition("://")[0]
    backend = scheme.lower().partition("+")[0]
    if _ASYNC.get(backend, ("",))[0] != "postgresql":
        raise ValueError(
            f"several hosts before the path are PostgreSQL's (libpq's) form; "
            f"{scheme}:// takes one host"
        )
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    if any(name in ("host", "port") for name, _ in query):
        raise ValueError("hosts both before the path and as ?host= or ?port=: write one of the two")
    userinfo, at, _ = parts.netloc.rpartition("@")
    lists = [("host", ",".join(h for h, _ in hosts)), ("port", ",".join(str(p) for _, p in hosts))]
    # Not urlunsplit: with no user it would drop the "//" before an empty host.
    return f"{parts.scheme}://{userinfo}{at}{parts.path}?{urlencode(lists + query)}"


def _query_hosts(parsed: URL) -> URL:
    """SQLAlchemy's ``?host=h1:p1&host=h2`` (and ``?host=h1,h2`` with or without
    ``?port=``) as one spelling, ``?host=h1,h2&port=p1,p2``, every port given (asyncpg's
    dialect wants them all; libpq's 5432 where one is missing)."""
    given = parsed.query.get("host")
    entries = list(given) if isinstance(given, tuple) else (given or "").split(",")
    if len(entries) < 2:
        return parsed
    ports = parsed.query.get("port")
    if ports is None:
        pairs = [_host_port(entry, PG_PORT) for entry in entries]
    else:
        numbers = list(ports) if isinstance(ports, tuple) else ports.split(",")
        if len(numbers) != len(entries):
            raise ValueError("the ?host= and ?port= lists differ in length")
        pairs = [
            (_host_port(h, PG_PORT)[0], _host_port(f"h:{p}" if p else "h", PG_PORT)[1])
            for h, p in zip(entries, numbers, strict=True)
        ]
    return parsed.difference_update_query(["host", "port"]).update_query_pairs(
        [("host", ",".join(h for h, _ in pairs)), ("port", ",".join(str(p) for _, p in pairs))]
    )


def _parse(url: str) -> URL:
    # SQLAlchemy only here and in redact(): RedisStore reads this module's Redis
    # schemes and host lists, and must not load SQLAlchemy to do it.
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(_libpq_hosts(url))
    except (ArgumentError, ValueError) as exc:  # ValueError: a port that is not a number
        # The exception's text never repeats the URL (which may hold a password).
        raise ValueError(f"malformed database URL ({exc}): use {accepted()}") from None


def async_url(url: str) -> str:
    """``url`` with its async driver: asyncpg for PostgreSQL, aiosqlite for SQLite, asyncmy
    for MariaDB and MySQL.

    The rest of the URL (credentials, host, database, query) is kept as given.

    Raises:
        ValueError: ``url`` is malformed, names a database other than PostgreSQL,
            SQLite, MariaDB or MySQL, or names another driver than asyncpg, aiosqlite
            or asyncmy (such as the synchronous psycopg2). The message lists the
            accepted spellings and never includes the password.
    """
    parsed = _parse(url)
    backend, _, driver = parsed.drivername.lower().partition("+")
    if backend not in _ASYNC:
        raise ValueError(f"unsupported database URL scheme {parsed.drivername!r}: use {accepted()}")
    canonical, async_driver = _ASYNC[backend]
    if driver not in ("", async_driver):
        raise ValueError(
            f"unsupported database URL scheme {parsed.drivername!r}: the store needs the "
            f"async driver {async_driver}, not {driver}: use {accepted()}"
        )
    if canonical == "sqlite" and (parsed.host or parsed.port or parsed.username or parsed.password):
        raise ValueError(_sqlite_form(parsed))
    parsed = parsed.set(drivername=f"{canonical}+{async_driver}")
    if canonical == "postgresql" and "sslmode" in parsed.query:
        parsed = _ssl_from_sslmode(parsed)
    if canonical == "postgresql" and "host" in parsed.query:
        try:
            parsed = _query_hosts(parsed)
        except ValueError as exc:
            raise ValueError(f"malformed database URL ({exc}): use {accepted()}") from None
    return parsed.render_as_string(hide_password=False)


def _sqlite_form(parsed: URL) -> str:
    # "sqlite://./x" parses as host "." and database "x": SQLAlchemy refuses it only
    # when the engine is made, and the CLI would look for the file "x". Say what the
    # path was meant to be, in the form that works (never the password, if any).
    meant = "/".join(part for part in (parsed.host, parsed.database) if part) or "x.db"
    return (
        f"malformed SQLite URL: a SQLite URL has no host, so the path follows three "
        f"slashes (four for an absolute path): sqlite+aiosqlite:///{meant}, as in "
        f"sqlite+aiosqlite:///./x.db; use {accepted()}"
    )


_SSL_MODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")


def _ssl_from_sslmode(parsed: URL) -> URL:
    mode = parsed.query["sslmode"]
    if not isinstance(mode, str) or mode not in _SSL_MODES:
        raise ValueError(
            f"unsupported sslmode {mode!r} in the database URL: use one of {_SSL_MODES}"
        )
    if parsed.query.get("ssl", mode) != mode:
        raise ValueError("the database URL gives both sslmode and ssl, with different values")
    return parsed.difference_update_query(["sslmode"]).update_query_dict({"ssl": mode})


def redact(url: str) -> str:
    """``url`` as it may be shown or logged: any password replaced by ``***``.

    Every host of a multi-host URL is shown (a Postgres primary and its standbys, Redis
    Sentinels), as written; query parameters whose name ends in ``password`` are
    replaced too. A URL that cannot be parsed is not shown at all (it might hold a
    password where the parser did not expect one).
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        if host_list(url, PG_PORT) is not None:
            return _redact_hosts(url)
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return "<malformed database URL>"
    secret = [name for name in parsed.query if name.endswith("password")]
    if secret:  # the drivers also take it as a query parameter
        parsed = parsed.update_query_dict(dict.fromkeys(secret, "redacted"))
    shown = parsed.render_as_string(hide_password=True).replace("=redacted", "=***")
    # SQLAlchemy escapes the host and port lists' separators: show them as written.
    return shown.replace("%2C", ",").replace("%3A", ":") if "host=" in shown else shown


def _redact_hosts(url: str) -> str:
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    query = "&".join(
        f"{name}=***" if unquote(name).endswith("password") else f"{name}={value}"
        for name, _, value in (pair.partition("=") for pair in parts.query.split("&") if pair)
    )
    netloc = f"{user}{':***' if colon else ''}{at}{hosts}"
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def sqlite_path(url: str) -> str | None:
    """The file a SQLite URL opens, or ``None`` (not SQLite, in memory, or a ``file:`` URI)."""
    if not url.lower().startswith("sqlite"):
        return None  # before parsing: a Sentinel URL's host list is no database URL
    parsed = _parse(url)
    database = parsed.database
    if not database or database == ":memory:" or parsed.query.get("uri") == "true":
        return None
    return database
