"""Stores built from URLs: each kind of store, its URL schemes, its extra and what it offers.

One :class:`StoreKind` per kind of store, registered once (ours in :data:`KINDS`
below; a store of your own with :func:`register`). :func:`kind_of` finds a URL's kind,
:func:`open_store` builds its store, and callers such as the CLI ask the kind's
:class:`~.base.Capabilities` (can it prune? does it have a schema to migrate?) rather
than look at the URL's scheme. A new backend is its module, one line here, and its extra.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from asgi_idempotency._extras import missing_extra
from asgi_idempotency.stores.base import Capabilities, Store

__all__ = ["KINDS", "StoreKind", "accepted", "kind_of", "kinds", "open_store", "register"]

#: URL schemes of :class:`~asgi_idempotency.stores.redis.RedisStore`: one server, or a
#: Redis Cluster (any one node as ``host:port``; the client discovers the rest).
#: Redis under Sentinel: the Sentinels as ``host:port,host:port``, then the master's
#: service name and the database (``redis+sentinel://h1:26379,h2:26379/mymaster/0``).
#: (Also importable from :mod:`.urls`, their home before the registry listed them.)
REDIS_CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
REDIS_SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
REDIS_SCHEMES = ("redis", "rediss", *REDIS_CLUSTER_SCHEMES, *REDIS_SENTINEL_SCHEMES)

# The SQL URL rule (urls.async_url), imported on first use: stores.urls takes the
# accepted spellings from this registry, so the registry names it rather than import it.
_SQL_URL = "asgi_idempotency.stores.urls:async_url"


def _resolve(target: str | Callable[..., Any]) -> Callable[..., Any]:
    """``target``, or the attribute a ``"module:attribute"`` string names (imported now)."""
    if not isinstance(target, str):
        return target
    module, _, attribute = target.partition(":")
    found: Callable[..., Any] = getattr(importlib.import_module(module), attribute)
    return found


@dataclass(frozen=True, slots=True)
class StoreKind:
    """One kind of store as URLs name it.

    Args:
        name: what messages call it (``"Redis"``).
        schemes: the URL schemes (before ``://``, lower case) that name this kind.
        factory: builds the store as ``factory(url, **options)``: the callable, or
            ``"module:attribute"``, imported on first use (so that a kind whose extra
            is not installed costs nothing until a URL names it). The CLI passes
            ``command_timeout`` (seconds any one call may take; its ``--timeout``).
        capabilities: what every store of this kind offers beyond the primitives
            (an instance may offer more, such as batching when asked for).
        extra: the pip extra that installs its driver, if any.
        drivers: a ``backend+driver`` scheme is this kind's when ``backend`` is one of
            :attr:`schemes` (SQL URLs: the URL rule then accepts or refuses the driver).
        normalize: the URL as the store reads it (the SQL URL rule,
            :func:`~asgi_idempotency.stores.urls.async_url`), the callable or
            ``"module:attribute"``; ``None``: as given.
        lacks: for a capability the kind lacks, why, as the CLI says it
            (``{"prune": "..."}``); a kind without a note gets a generic sentence.
        cli_options: more options for the store the CLI builds (one command at a
            time: the SQL stores' ``pool_size=1``).
        spelling: how its URLs are written, as every message that lists the accepted
            URLs shows them (:func:`accepted`); by default its schemes.
    """

    name: str
    schemes: tuple[str, ...]
    factory: str | Callable[..., Store]
    capabilities: Capabilities = field(default_factory=Capabilities)
    extra: str | None = None
    drivers: bool = False
    normalize: str | Callable[[str], str] | None = None
    lacks: Mapping[str, str] = field(default_factory=dict)
    cli_options: Mapping[str, Any] = field(default_factory=dict)
    spelling: str = ""

    def build(self, url: str, **options: Any) -> Store:
        """A store of this kind on ``url``; ``options`` go to the factory.

        Raises:
            ImportError: the kind's extra is not installed (the message names it).
            ValueError: the factory refused the URL or an option.
        """
        factory = self.factory
        if isinstance(factory, str):
            module, _, attribute = factory.partition(":")
            try:
                factory = getattr(importlib.import_module(module), attribute)
            except ImportError as exc:
                if self.extra is None or "pip install" in str(exc):
                    raise
                raise missing_extra(f"the {self.name} store", str(exc), self.extra) from exc
        store: Store = factory(url, **options)
        return store

    def url(self, url: str) -> str:
        """``url`` as this kind's store reads it.

        Raises:
            ValueError: the URL is malformed or names a driver the kind refuses.
        """
        if self.normalize is None:
            return url
        normalized: str = _resolve(self.normalize)(url)
        return normalized

    def spelled(self) -> str:
        """How this kind's URLs are written (:attr:`spelling`, else its schemes)."""
        return self.spelling or " or ".join(f"{scheme}://" for scheme in self.schemes)

    def why_not(self, capability: str) -> str:
        """Why this kind lacks ``capability`` (a :class:`~.base.Capabilities` field)."""
        return self.lacks.get(capability, f"the {self.name} store has no {capability}")


#: Our kinds of store, one entry each.
KINDS: list[StoreKind] = [
    StoreKind(
        "PostgreSQL", ("postgresql", "postgres"), "asgi_idempotency.stores.sql.store:SQLStore",
        Capabilities(transactions=True, migrations=True, audit=True, own_clock=True),
        drivers=True,
        normalize=_SQL_URL,
        cli_options={"pool_size": 1},
        spelling="postgresql://, postgres:// or postgresql+asyncpg://user:password@host:port/db "
        "(a primary and its standbys: host1:port,host2:port)",
    ),
    StoreKind(
        "SQLite", ("sqlite",), "asgi_idempotency.stores.sql.store:SQLStore",
        Capabilities(migrations=True, audit=True), drivers=True, normalize=_SQL_URL,
        cli_options={"pool_size": 1},
        spelling="sqlite:///path.db or sqlite+aiosqlite:///path.db (sqlite+aiosqlite:///./x.db "
        "for a path relative to the working directory)",
    ),
    StoreKind(
        "MariaDB", ("mariadb",), "asgi_idempotency.stores.sql.store:SQLStore",
        Capabilities(transactions=True, migrations=True, audit=True, own_clock=True),
        extra="mysql",
        drivers=True, normalize=_SQL_URL, cli_options={"pool_size": 1},
        spelling="mariadb+asyncmy://user:password@host:port/db",
    ),
    StoreKind(
        "MySQL", ("mysql",), "asgi_idempotency.stores.sql.store:SQLStore",
        Capabilities(migrations=True, audit=True, own_clock=True), extra="mysql", drivers=True,
        normalize=_SQL_URL, cli_options={"pool_size": 1},
        spelling="mysql+asyncmy://user:password@host:port/db",
        lacks={
            "transactions": "MySQL has neither SET STATEMENT nor RETURNING: use a "
            "mariadb+asyncmy:// URL on MariaDB for transactional mode",
        },
    ),
    StoreKind(
        "Redis", REDIS_SCHEMES,  # one server, Sentinel's master, a Cluster
        "asgi_idempotency.stores.redis:RedisStore",
        Capabilities(prune=False, audit=True, own_clock=True),
        extra="redis",
        spelling="for RedisStore "
        + ", ".join(f"{scheme}://host:port" for scheme in REDIS_SCHEMES[:4])
        + " or "
        + " or ".join(f"{scheme}://host:port,host:port/service/db" for scheme in REDIS_SCHEMES[4:])
        + " (rediss: TLS; +cluster: any node of a Redis Cluster; +sentinel: the Sentinels and "
        "the name of the master they watch)",
        lacks={
            "prune": "Redis expires each record itself when its retention ends (the key's "
            "TTL), so a Redis store needs no prune job",
            "migrations": "Redis needs no schema (each record is one key, written as it "
            "is claimed)",
        },
    ),
]  # fmt: skip


def register(kind: StoreKind) -> StoreKind:
    """Add a kind of store: :func:`open_store` and the CLI then take its URLs.

    A kind of the same name as one registered replaces it (its module imported again).

    Raises:
        ValueError: one of its schemes already names a kind of another name.
    """
    for other in KINDS:
        taken = set(other.schemes) & {scheme.lower() for scheme in kind.schemes}
        if taken and other.name != kind.name:
            raise ValueError(f"the URL scheme {sorted(taken)[0]!r} is already {other.name}'s")
    KINDS[:] = [other for other in KINDS if other.name != kind.name]
    KINDS.append(kind)
    return kind


def accepted() -> str:
    """Every URL spelling the registered kinds take, for every message and help text
    that shows them (SQLStore, RedisStore, the CLI, alembic's env.py): a user who got
    the scheme wrong sees the whole list, whichever of them answered."""
    return "; ".join(kind.spelled() for kind in KINDS)


def kinds() -> tuple[StoreKind, ...]:
    """Every registered kind, ours first."""
    return tuple(KINDS)


def kind_of(url: str) -> StoreKind:
    """The kind of store ``url`` names, by its scheme.

    Raises:
        ValueError: no kind takes the URL's scheme, or it is malformed (the message
            lists the accepted spellings and never includes the password).
    """
    scheme, sep, _ = url.partition("://")
    scheme = scheme.lower()
    if sep:
        for kind in KINDS:
            if scheme in kind.schemes:
                return kind
        backend = scheme.partition("+")[0]
        for kind in KINDS:
            if kind.drivers and backend in kind.schemes:
                return kind
    # The SQL URL rule says what is wrong with it, in its words (malformed, or which
    # schemes are accepted); a URL it would accept has a kind above.
    _resolve(_SQL_URL)(url)
    raise ValueError(f"unsupported store URL scheme {scheme!r}")  # pragma: no cover


def open_store(url: str, **options: Any) -> Store:
    """The store ``url`` names, built by its kind's factory with ``options``.

    Raises:
        ImportError: the kind's extra is not installed (the message names it).
        ValueError: no kind takes the URL, or its store refused it or an option.
    """
    return kind_of(url).build(url, **options)
