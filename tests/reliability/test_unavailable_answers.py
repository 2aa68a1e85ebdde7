"""Every infrastructure fault answers 503 problem+json that tells a client nothing about the store.

Each store is pointed at something that fails at connect: an unknown role, an unknown
database, a wrong password (a Postgres of our own with password authentication), a
closed port, a name DNS cannot resolve, a Redis that is not there. The answer is the
same 503 every time, with ``Retry-After`` and ``Cache-Control: no-store``, and its body
names no host, port, user, database or driver message; the reason, with the password
masked, goes to the ``asgi_idempotency`` log with the key's digest. A bug of ours (a
``TypeError``) is not a store fault: it stays an exception, never a 503.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from sqlalchemy.engine import make_url
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asgi_idempotency import MemoryStore, Policy, SQLStore
from asgi_idempotency.core.keys import scoped_key
from asgi_idempotency.stores.base import NewClaim, Record, Store
from tests.apps import guarded
from tests.conftest import NO_POSTGRES, _pg_ctl

pytestmark = pytest.mark.anyio

KEY = "order-42-" + uuid.uuid4().hex[:8]
PASSWORD = "S3cret-" + uuid.uuid4().hex[:12]


def _app(store: Store, calls: list[int]) -> Starlette:
    async def pay(request: Request) -> Response:
        calls.append(1)
        return JSONResponse({"ok": True}, status_code=201)

    return guarded(store, [Route("/pay", pay, methods=["POST"])], policies={"POST /pay": Policy()})


async def _post(store: Store) -> tuple[httpx.Response, list[int]]:
    calls: list[int] = []
    transport = httpx.ASGITransport(app=_app(store, calls))  # no lifespan: checked per request
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            response = await client.post("/pay", json={}, headers={"Idempotency-Key": KEY})
    finally:
        await store.close()
    return response, calls


def _assert_unavailable(
    response: httpx.Response, calls: list[int], caplog: pytest.LogCaptureFixture, *,
    reason: str, secrets: list[str],
) -> None:  # fmt: skip
    assert response.status_code == 503, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert int(response.headers["retry-after"]) >= 1
    assert response.headers["cache-control"] == "no-store"
    assert response.json()["detail"].startswith("The idempotency store is unavailable")
    for secret in [*secrets, KEY, PASSWORD, reason]:
        assert secret not in response.text, secret
    assert calls == []  # the handler did not run
    # The operator's side: the reason and the key's digest, never the password or raw key.
    digest = scoped_key("", KEY, "t")[:16]  # the client's host: records are scoped by it
    errors = [r.getMessage() for r in caplog.records if "idempotency.store_error" in r.getMessage()]
    assert any(reason in m and f"key_digest={digest}" in m for m in errors), errors
    assert PASSWORD not in caplog.text
    assert KEY not in caplog.text


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def pg_with_password() -> Iterator[str]:
    """A throwaway Postgres that checks passwords (scram-sha-256); yields its URL without one.

    The run's shared server trusts every local connection, so a wrong password needs a
    server of its own. Postgres refuses to run as root: as root, it runs as ``postgres``.
    """
    pg_ctl = _pg_ctl()
    if pg_ctl is None:
        pytest.fail(f"{NO_POSTGRES} (no pg_ctl for the password-checking server)", pytrace=False)
    initdb = str(Path(pg_ctl).with_name("initdb"))
    as_user: list[str] = []
    home = Path(tempfile.mkdtemp(prefix="idem-pg-password-"))
    if os.geteuid() == 0:
        as_user = ["runuser", "-u", "postgres", "--"]
        shutil.chown(home, "postgres")
    data, port = home / "data", _free_port()
    (home / "pw").write_text(PASSWORD)
    os.chmod(home / "pw", 0o644)
    try:
        subprocess.run(
            [*as_user, initdb, "-D", str(data), "-U", "postgres", "--auth=scram-sha-256",
             f"--pwfile={home / 'pw'}"],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        options = f"-p {port} -k {home} -c listen_addresses=127.0.0.1 -c fsync=off"
        subprocess.run(
            [*as_user, pg_ctl, "-D", str(data), "-w", "-o", options, "-l", str(home / "log"),
             "start"],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        shutil.rmtree(home, ignore_errors=True)
        pytest.fail(f"{NO_POSTGRES} ({type(exc).__name__}: {exc})", pytrace=False)
    try:
        yield f"postgresql+asyncpg://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            [*as_user, pg_ctl, "-D", str(data), "-m", "immediate", "stop"],
            check=False, capture_output=True, timeout=60,
        )  # fmt: skip
        shutil.rmtree(home, ignore_errors=True)


def _parts(url: str) -> list[str]:
    u = make_url(url)
    return [str(u.username), str(u.host), str(u.port), str(u.database)]


@pytest.mark.postgres
@pytest.mark.parametrize("fault", ["unknown role", "unknown database"])
async def test_postgres_refusing_the_connection_is_a_503(
    fault: str, pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    u = make_url(pg_url)
    suffix = uuid.uuid4().hex[:10]
    if fault == "unknown role":
        url = u.set(username=f"nosuchrole_{suffix}")
        reason = "InvalidAuthorizationSpecificationError"
    else:
        url, reason = u.set(database=f"nosuchdb_{suffix}"), "InvalidCatalogNameError"
    rendered = url.render_as_string(hide_password=False)
    caplog.set_level(logging.ERROR, logger="asgi_idempotency")
    response, calls = await _post(SQLStore(rendered, command_timeout=5))
    _assert_unavailable(response, calls, caplog, reason=reason, secrets=_parts(rendered))
    assert suffix in caplog.text  # the log names what was refused


@pytest.mark.postgres
async def test_postgres_wrong_password_is_a_503_and_the_password_is_logged_nowhere(
    pg_with_password: str, caplog: pytest.LogCaptureFixture
) -> None:
    wrong = make_url(pg_with_password).set(password=PASSWORD[::-1])
    rendered = wrong.render_as_string(hide_password=False)
    caplog.set_level(logging.ERROR, logger="asgi_idempotency")
    response, calls = await _post(SQLStore(rendered, command_timeout=5))
    _assert_unavailable(
        response, calls, caplog, reason="InvalidPasswordError",
        secrets=[*_parts(rendered), PASSWORD[::-1]],
    )  # fmt: skip
    assert PASSWORD[::-1] not in caplog.text


@pytest.mark.postgres
async def test_postgres_right_password_gets_past_authentication(pg_with_password: str) -> None:
    # The server above does check passwords: with the right one the schema is missing,
    # which is the operator's 503 and names the fix, but still not the database's URL.
    url = make_url(pg_with_password).set(password=PASSWORD).render_as_string(hide_password=False)
    response, calls = await _post(SQLStore(url, command_timeout=5))
    assert response.status_code == 503
    assert calls == []
    assert response.headers["cache-control"] == "no-store"
    assert "asgi-idempotency migrate --database-url" in response.json()["detail"]
    for secret in [*_parts(url), PASSWORD]:
        assert secret not in response.text, secret


@pytest.mark.postgres
async def test_postgres_closed_port_is_a_503(
    refused_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    port = urlsplit(refused_url).port
    url = f"postgresql+asyncpg://someone:{PASSWORD}@127.0.0.1:{port}/somedb"
    caplog.set_level(logging.ERROR, logger="asgi_idempotency")
    response, calls = await _post(SQLStore(url, command_timeout=5))
    _assert_unavailable(response, calls, caplog, reason="ConnectionRefusedError",
                        secrets=["someone", "127.0.0.1", str(port), "somedb"])  # fmt: skip


@pytest.mark.postgres
async def test_postgres_unresolvable_host_is_a_503(caplog: pytest.LogCaptureFixture) -> None:
    host = f"idem-{uuid.uuid4().hex[:8]}.invalid"  # RFC 6761: never resolves
    url = f"postgresql+asyncpg://someone:{PASSWORD}@{host}:5432/somedb"
    caplog.set_level(logging.ERROR, logger="asgi_idempotency")
    response, calls = await _post(SQLStore(url, command_timeout=5))
    _assert_unavailable(response, calls, caplog, reason="gaierror",
                        secrets=["someone", host, "5432", "somedb"])  # fmt: skip


@pytest.mark.redis
async def test_redis_closed_port_is_a_503(
    refused_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    from asgi_idempotency.stores.redis import RedisStore

    port = urlsplit(refused_url).port
    url = f"redis://someone:{PASSWORD}@127.0.0.1:{port}/0"
    caplog.set_level(logging.ERROR, logger="asgi_idempotency")
    response, calls = await _post(RedisStore(url, command_timeout=2))
    _assert_unavailable(response, calls, caplog, reason="ConnectionError",
                        secrets=["someone", "127.0.0.1", str(port)])  # fmt: skip


async def test_a_store_bug_is_not_a_503() -> None:
    class Buggy(MemoryStore):
        async def insert(self, new: NewClaim) -> Record | None:
            raise TypeError("a bug of ours, not an outage")

    calls: list[int] = []
    transport = httpx.ASGITransport(app=_app(Buggy(), calls))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        with pytest.raises(TypeError, match="a bug of ours"):
            await client.post("/pay", json={}, headers={"Idempotency-Key": KEY})
    assert calls == []


def test_a_driver_message_quoting_a_dsn_loses_its_password() -> None:
    from asgi_idempotency.core.errors import StoreError

    exc = ValueError(f"invalid DSN postgresql://bob:{PASSWORD}@db:5432/x; password={PASSWORD}")
    message = str(StoreError.wrap(exc))
    assert PASSWORD not in message
    assert message == "ValueError: invalid DSN postgresql://bob:***@db:5432/x; password=***"
    assert StoreError.wrap(exc).detail.startswith("The idempotency store is unavailable")


def test_in_progress_is_not_cacheable_either() -> None:
    from asgi_idempotency.core.errors import KeyMismatch, RequestInProgress

    assert (b"cache-control", b"no-store") in RequestInProgress("x", retry_after=1).headers()
    assert all(name != b"cache-control" for name, _ in KeyMismatch("x").headers())
