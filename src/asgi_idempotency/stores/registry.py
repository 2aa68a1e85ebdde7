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
from asgi_idempotency.stores.urls import REDIS_SCHEMES, async_url

__all__ = ["KINDS", "StoreKind", "kind_of", "kinds", "open_store", "register"]


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
            :func:`~asgi_idempotency.stores.urls.async_url`); ``None``: as given.
        lacks: for a capability the kind lacks, why, as the CLI says it
            (``{"prune": "..."}``); a kind without a note gets a generic sentence.
        cli_options: more options for the store the CLI builds (one command at a
            time: the SQL stores' ``pool_size=1``).
    """

    name: str
    schemes: tuple[str, ...]
    factory: str | Callable[..., Store]
    capabilities: Capabilities = field(default_factory=Capabilities)
    extra: str | None = None
    drivers: bool = False
    normalize: Callable[[str], str] | None = None
    lacks: Mapping[str, str] = field(default_factory=dict)
    cli_options: Mapping[str, Any] = field(default_factory=dict)

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
        return url if self.normalize is None else self.normalize(url)

    def why_not(self, capability: str) -> str:
        """Why this kind lacks ``capability`` (a :class:`~.base.Capabilities` field)."""
        return self.lacks.get(capability, f"the {self.name} store has no {capability}")


#: Our kinds of store, one entry each.
KINDS: list[StoreKind] = [
    StoreKind(
        "PostgreSQL", ("postgresql", "postgres"), "asgi_idempotency.stores.sql.store:SQLStore",
        Capabilities(transactions=True, migrations=True, audit=True, own_clock=True),
        drivers=True,
        normalize=async_url,
        cli_options={"pool_size": 1},
    ),
    StoreKind(
        "SQLite", ("sqlite",), "asgi_idempotency.stores.sql.store:SQLStore",
        Capabilities(migrations=True, audit=True), drivers=True, normalize=async_url,
        cli_options={"pool_size": 1},
    ),
    StoreKind(
        "MariaDB", ("mariadb",), "asgi_idempotency.stores.sql.store:SQLStore",
        Capabilities(transactions=True, migrations=True, audit=True, own_clock=True),
        extra="mysql",
        drivers=True, normalize=async_url, cli_options={"pool_size": 1},
    ),
    StoreKind(
        "MySQL", ("mysql",), "asgi_idempotency.stores.sql.store:SQLStore",
        Capabilities(migrations=True, audit=True, own_clock=True), extra="mysql", drivers=True,
        normalize=async_url, cli_options={"pool_size": 1},
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
    async_url(url)
    raise ValueError(f"unsupported store URL scheme {scheme!r}")  # pragma: no cover


def open_store(url: str, **options: Any) -> Store:
    """The store ``url`` names, built by its kind's factory with ``options``.

    Raises:
        ImportError: the kind's extra is not installed (the message names it).
        ValueError: no kind takes the URL, or its store refused it or an option.
    """
    return kind_of(url).build(url, **options)
