"""The one rule for database URLs, shared by :class:`SQLStore`, the CLI and alembic's ``env.py``.

A URL that names a database but no driver gets the async one (asyncpg, aiosqlite,
asyncmy); one that names any other driver is refused with a :class:`ValueError` listing
the accepted spellings (:data:`ACCEPTED`), as is a SQLite URL with a host where its path
belongs. libpq's ``?sslmode=`` becomes asyncpg's ``?ssl=``. Redis URLs
(:data:`REDIS_SCHEMES`) pass through unchanged; :func:`is_redis` tells them apart.
Messages never carry a password: show URLs through :func:`redact`. The full table:
docs/guide/postgres.md.
"""

from __future__ import annotations

from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

__all__ = [
    "ACCEPTED",
    "ENV_URL",
    "REDIS_CLUSTER_SCHEMES",
    "REDIS_SCHEMES",
    "async_url",
    "is_redis",
    "redact",
    "sqlite_path",
]

#: The environment variable the CLI and alembic's ``env.py`` read the database URL from.
ENV_URL = "IDEMPOTENCY_DATABASE_URL"

#: URL schemes of :class:`~asgi_idempotency.stores.redis.RedisStore`: one server, or a
#: Redis Cluster (any one node as ``host:port``; the client discovers the rest).
REDIS_CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
REDIS_SCHEMES = ("redis", "rediss", *REDIS_CLUSTER_SCHEMES)

#: Every URL spelling the package takes, for every message and help text that shows
#: one (SQLStore, RedisStore, the CLI, alembic's env.py): a user who got the scheme
#: wrong sees the whole list in one place, whichever of them answered. Redis is listed
#: from :data:`REDIS_SCHEMES` so that the list cannot miss a scheme ``is_redis`` takes.
ACCEPTED = (
    "postgresql://, postgres:// or postgresql+asyncpg://user:password@host:port/db; "
    "sqlite:///path.db or sqlite+aiosqlite:///path.db (sqlite+aiosqlite:///./x.db for a "
    "path relative to the working directory); "
    "mariadb+asyncmy:// or mysql+asyncmy://user:password@host:port/db; for RedisStore "
    + ", ".join(f"{scheme}://host:port" for scheme in REDIS_SCHEMES[:-1])
    + f" or {REDIS_SCHEMES[-1]}://host:port (rediss: TLS; +cluster: any node of a Redis Cluster)"
)


def is_redis(url: str) -> bool:
    """Whether ``url`` names a Redis store (:data:`REDIS_SCHEMES`) rather than a database."""
    scheme, sep, _ = url.partition("://")
    return bool(sep) and scheme.lower() in REDIS_SCHEMES


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


def _parse(url: str) -> URL:
    try:
        return make_url(url)
    except (ArgumentError, ValueError) as exc:  # ValueError: a port that is not a number
        # The exception's text never repeats the URL (which may hold a password).
        raise ValueError(f"malformed database URL ({exc}): use {ACCEPTED}") from None


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
        raise ValueError(f"unsupported database URL scheme {parsed.drivername!r}: use {ACCEPTED}")
    canonical, async_driver = _ASYNC[backend]
    if driver not in ("", async_driver):
        raise ValueError(
            f"unsupported database URL scheme {parsed.drivername!r}: the store needs the "
            f"async driver {async_driver}, not {driver}: use {ACCEPTED}"
        )
    if canonical == "sqlite" and (parsed.host or parsed.port or parsed.username or parsed.password):
        raise ValueError(_sqlite_form(parsed))
    parsed = parsed.set(drivername=f"{canonical}+{async_driver}")
    if canonical == "postgresql" and "sslmode" in parsed.query:
        parsed = _ssl_from_sslmode(parsed)
    return parsed.render_as_string(hide_password=False)


def _sqlite_form(parsed: URL) -> str:
    # "sqlite://./x" parses as host "." and database "x": SQLAlchemy refuses it only
    # when the engine is made, and the CLI would look for the file "x". Say what the
    # path was meant to be, in the form that works (never the password, if any).
    meant = "/".join(part for part in (parsed.host, parsed.database) if part) or "x.db"
    return (
        f"malformed SQLite URL: a SQLite URL has no host, so the path follows three "
        f"slashes (four for an absolute path): sqlite+aiosqlite:///{meant}, as in "
        f"sqlite+aiosqlite:///./x.db; use {ACCEPTED}"
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

    A URL that cannot be parsed is not shown at all (it might hold a password where
    the parser did not expect one).
    """
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return "<malformed database URL>"
    if "password" in parsed.query:  # the drivers also take it as a query parameter
        parsed = parsed.update_query_dict({"password": "redacted"})
    return parsed.render_as_string(hide_password=True).replace("password=redacted", "password=***")


def sqlite_path(url: str) -> str | None:
    """The file a SQLite URL opens, or ``None`` (not SQLite, in memory, or a ``file:`` URI)."""
    parsed = _parse(url)
    if not parsed.drivername.lower().startswith("sqlite"):
        return None
    database = parsed.database
    if not database or database == ":memory:" or parsed.query.get("uri") == "true":
        return None
    return database
