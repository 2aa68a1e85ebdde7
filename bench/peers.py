"""Other Redis-backed idempotency libraries, served beside ours: the ``peer_*`` variants.

``python -m bench.run --variants redis,floor_redis,peer_mobius,peer_pyidempotent,...``

Each peer is a PyPI package that is *not* a dependency of asgi-idempotency, nor of its
``dev``/``bench`` extras: ``bench.run`` pip-installs the pinned versions below into the
running interpreter when a ``peer_*`` variant is named (:func:`ensure_installed`, which
says what it installs), and the app imports them by name at run time, so nothing here is
typed against them and none of their code is in this repository.

Every peer serves the refund route of ``bench/app.py`` on the harness's redis-server, on
a database of its own (``PEER_DB``), configured as its docs show for production: its
Redis backend, a 24 h response TTL, the ``Idempotency-Key`` header, and 409 for an
in-flight duplicate and 422 for a reused key with another body wherever it has them.
The two middleware peers guard the very same Starlette handler. The two decorator
peers cache a handler's *return value*, not a ``Response``, so they guard a FastAPI
route doing the same work and returning the same JSON as a dict (FastAPI serializes it).

Dropped (bench/results/NOTES.md, "Redis peers"): ``kasper-idempotent``.

idemkit, the best peer measured (issue #43's target is twice its req/s), runs on
Postgres and on Redis (``peer_idemkit_pg``, ``peer_idemkit_redis``): its own ASGI
middleware in front of the very same Starlette handler, each backend built with its
``from_url`` as its README shows (its default pool and timeouts), single-tenant (as
ours, ``ANONYMOUS``), a 24 h record, a key required on POST. Its version is pinned in
``bench/requirements.txt``, which :func:`ensure_installed` installs.
"""

# No ``from __future__ import annotations``: FastAPI resolves the decorator peers'
# handler annotations at run time, from names local to the functions below.

import asyncio
import contextlib
import importlib
import importlib.util
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

from starlette.applications import Starlette

# variant -> (pip requirement, the module it provides)
PEERS: dict[str, tuple[str, str]] = {
    "peer_mobius": ("mobius-idempotence-library[redis]==0.2.1", "mobius_idempotence"),
    "peer_pyidempotent": ("pyidempotent[redis,fastapi]==0.1.0", "pyidempotent"),
    "peer_fastapi_idempotency_key": (
        "fastapi-idempotency-key[redis]==0.1.1",
        "fastapi_idempotency_key",
    ),
    "peer_fastidempotent": ("fastidempotent[redis]==0.1.0", "fastidempotent"),
}
# The best peer, on Postgres and on Redis: installed from bench/requirements.txt.
IDEMKIT = {"peer_idemkit_pg": "idemkit", "peer_idemkit_redis": "idemkit"}
REQUIREMENTS = Path(__file__).resolve().parent / "requirements.txt"
# Each peer on its own Redis database (ours and the floor share 0, on their own prefixes).
PEER_DB = {name: i for i, name in enumerate([*PEERS, "peer_idemkit_redis"], start=1)}
LABELS = {
    "peer_mobius": "mobius",
    "peer_pyidempotent": "pyidempotent",
    "peer_fastapi_idempotency_key": "fastapi-idem",
    "peer_fastidempotent": "fastidempot",
    "peer_idemkit_pg": "idemkit, PG",
    "peer_idemkit_redis": "idemkit, Redis",
}
TTL_S = 24 * 3600


def ensure_installed(variants: list[str]) -> None:
    """pip-install the peers named in ``variants`` that the running venv lacks."""
    if any(v in IDEMKIT for v in variants) and importlib.util.find_spec("idemkit") is None:
        print(
            f"bench: installing {REQUIREMENTS.name} into {sys.prefix} (bench only, not "
            "dependencies of asgi-idempotency)",
            file=sys.stderr,
            flush=True,
        )
        pip = [sys.executable, "-m", "pip", "install", "-q", "-r", str(REQUIREMENTS)]
        subprocess.run(pip, check=True)
    missing = [
        PEERS[v][0]
        for v in variants
        if v in PEERS and importlib.util.find_spec(PEERS[v][1]) is None
    ]
    if not missing:
        return
    print(
        f"bench: installing peer libraries for the comparison into {sys.prefix} "
        f"(bench only, not dependencies of asgi-idempotency): {' '.join(missing)}",
        file=sys.stderr,
        flush=True,
    )
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *missing], check=True)


def _db_url(base: str, variant: str) -> str:
    return f"{base.rsplit('/', 1)[0]}/{PEER_DB[variant]}"


async def _refund_dict(order_id: str, payload: dict[str, Any]) -> dict[str, Any]:
    """bench/app.py's ``refund``, returning its JSON as a dict."""
    if "delay" in payload:
        await asyncio.sleep(float(payload["delay"]))
    return {"refund_id": str(uuid.uuid4()), "order_id": order_id, "amount": payload["amount"]}


def create(
    variant: str, redis_url: str, lifespan: Any, routes: Any, health: Any, pg_url: str = ""
) -> Starlette:
    """The refund app guarded by the peer ``variant``, on its own database of ``redis_url``
    (idemkit on Postgres: its own table in ``pg_url``'s database); ``routes`` and
    ``health`` are bench/app.py's, passed in so this module imports none of it.
    """
    if variant == "peer_idemkit_pg":
        return _idemkit(variant, pg_url, routes, lifespan)
    url = _db_url(redis_url, variant)
    if variant == "peer_idemkit_redis":
        return _idemkit(variant, url, routes, lifespan)
    if variant == "peer_fastapi_idempotency_key":
        return _fastapi_idempotency_key(url, routes, lifespan)
    if variant == "peer_fastidempotent":
        return _fastidempotent(url, routes, lifespan)
    if variant == "peer_mobius":
        return _mobius(url, health, lifespan)
    if variant == "peer_pyidempotent":
        return _pyidempotent(url, health, lifespan)
    raise ValueError(f"unknown BENCH_VARIANT {variant!r}")


def _idemkit(variant: str, url: str, routes: list[Any], lifespan: Any) -> Starlette:
    from starlette.middleware import Middleware

    ik = importlib.import_module("idemkit")
    init: Any = None
    if variant == "peer_idemkit_pg":
        pg = importlib.import_module("idemkit.backends.postgres")
        backend = pg.PostgresBackend.from_url(url)
        init = pg.init_pg  # its table, created as its CLI's ``init`` does
    else:
        backend = importlib.import_module("idemkit.backends.redis").RedisBackend.from_url(url)
    config = ik.HttpConfig(
        scope_mode="single_tenant", require_key_for_mutations=True,
        expires_after_seconds=float(TTL_S),
    )  # fmt: skip

    @contextlib.asynccontextmanager
    async def with_schema(app: Starlette) -> AsyncIterator[None]:
        if init is not None:
            await init(url)
        async with lifespan(app):
            yield

    middleware = [Middleware(ik.IdempotencyMiddleware, backend=backend, config=config)]
    return Starlette(routes=routes, middleware=middleware, lifespan=with_schema)


def _fastapi_idempotency_key(url: str, routes: list[Any], lifespan: Any) -> Starlette:
    from starlette.middleware import Middleware

    mw = importlib.import_module("fastapi_idempotency_key")
    backends = importlib.import_module("fastapi_idempotency_key.backends.redis")
    backend = backends.RedisBackend(redis_url=url)
    middleware = [
        Middleware(mw.IdempotencyMiddleware, backend=backend, default_ttl=TTL_S, required=True)
    ]
    return Starlette(routes=routes, middleware=middleware, lifespan=lifespan)


def _fastidempotent(url: str, routes: list[Any], lifespan: Any) -> Starlette:
    from starlette.middleware import Middleware

    fi = importlib.import_module("fastidempotent")
    backends = importlib.import_module("fastidempotent.backends.redis")
    backend = backends.RedisBackend(url=url, ttl=TTL_S)

    @contextlib.asynccontextmanager
    async def with_backend(app: Starlette) -> AsyncIterator[None]:
        await backend.init()  # its README: the backend connects in the app's start-up
        async with lifespan(app):
            yield
        await backend.close()

    middleware = [
        Middleware(fi.IdempotencyMiddleware, backend=backend, ttl=TTL_S, methods=["POST"])
    ]
    return Starlette(routes=routes, middleware=middleware, lifespan=with_backend)


def _mobius(url: str, health: Any, lifespan: Any) -> Starlette:
    from fastapi import FastAPI, Request

    mob = importlib.import_module("mobius_idempotence")
    backends = importlib.import_module("mobius_idempotence.backends.redis")
    backend = backends.RedisBackend(url, response_ttl=TTL_S)
    manager = mob.IdempotencyManager(backend, mob.IdempotencyConfig(fail_open=False))
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None, lifespan=lifespan)

    @app.post("/orders/{order_id}/refunds", status_code=201)
    @mob.idempotent(manager, status_code=201)  # type: ignore[untyped-decorator]
    async def refund(order_id: str, request: Request) -> dict[str, Any]:
        import orjson

        payload = orjson.loads(await request.body())
        return await _refund_dict(order_id, payload)

    app.add_route("/health", health, methods=["GET"])
    return app


def _pyidempotent(url: str, health: Any, lifespan: Any) -> Starlette:
    import redis.asyncio as aioredis
    from fastapi import Body, FastAPI, Request
    from fastapi.responses import JSONResponse

    pyi = importlib.import_module("pyidempotent")
    backends = importlib.import_module("pyidempotent.backends.redis")
    backend = backends.RedisBackend(aioredis.from_url(url))
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None, lifespan=lifespan)

    # Its README maps its exceptions to HTTP statuses in the app's own handlers.
    for exc, status in (
        (pyi.IdempotencyConflict, 422),
        (pyi.IdempotencyProcessing, 409),
        (pyi.IdempotencyKeyMissing, 400),
    ):

        async def handler(_request: Request, _exc: Exception, status: int = status) -> JSONResponse:
            return JSONResponse({"status": status}, status_code=status)

        app.add_exception_handler(exc, handler)

    # The body is a parameter so that its fingerprint (a hash of the arguments, less the
    # Request) covers it.
    @app.post("/orders/{order_id}/refunds", status_code=201)
    @pyi.idempotent(backend=backend, ttl=TTL_S, key_header="Idempotency-Key")  # type: ignore[untyped-decorator]
    async def refund(
        request: Request, order_id: str, payload: Annotated[dict[str, Any], Body()]
    ) -> dict[str, Any]:
        return await _refund_dict(order_id, payload)

    app.add_route("/health", health, methods=["GET"])
    return app


def redis_url_for(variant: str, base: str) -> str:
    """The URL a peer variant's app uses (for flushing its database)."""
    return _db_url(base, variant)


if __name__ == "__main__":  # pragma: no cover - a manual check: pip-install every peer
    ensure_installed(list(PEERS))
    print("peers installed:", ", ".join(PEERS), file=sys.stderr)
    os._exit(0)
