"""The HTTP conformance checks, in process against an ASGI app (``httpx.ASGITransport``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from asgi_idempotency.ops.check import CheckOptions, CheckResult, Outcome, run_checks
from asgi_idempotency.ops.check import Report as CheckReport

try:
    import httpx
except ImportError as exc:  # pragma: no cover - ops.check raises first
    from asgi_idempotency._extras import missing_extra

    raise missing_extra("asgi_idempotency.testing", "httpx", "client") from exc

__all__ = ["CheckReport", "CheckResult", "Outcome", "assert_conforms", "check_app"]

_BASE = "http://testserver"


def _pairs(
    headers: Mapping[str, str] | Iterable[tuple[str, str]] | None,
) -> tuple[tuple[str, str], ...]:
    if headers is None:
        return ()
    if isinstance(headers, Mapping):
        return tuple(headers.items())
    return tuple(headers)


async def check_app(
    app: Any,
    path: str,
    *,
    method: str = "POST",
    json: Any = None,
    data: bytes | str | None = None,
    headers: Mapping[str, str] | Iterable[tuple[str, str]] | None = None,
    other_caller_headers: Mapping[str, str] | Iterable[tuple[str, str]] | None = None,
    other_json: Any = None,
    storm: int = 10,
    max_requests: int = 50,
    mismatch_status: int = 422,
    key_required: bool = True,
    count_path: str | None = None,
    slow_path: str | None = None,
    hold: float = 0.25,
    fail_header: tuple[str, str] | None = None,
    request_timeout: float = 30.0,
    expect_wait: bool = False,
) -> CheckReport:
    """Run every check against ``path`` of the ASGI ``app``, in this event loop.

    The arguments mirror ``asgi-idempotency check``'s options (paths instead of URLs:
    ``count_path`` answers ``GET`` with the number of effects, ``slow_path`` runs
    longer than ``hold`` seconds; ``request_timeout`` is seconds per request;
    ``expect_wait`` for a route with ``Policy(wait=...)``: its in-flight check is
    ``in-flight-wait``, expecting the duplicate to wait for the first's answer). ``json``
    is serialised compactly; ``data`` is sent as is. The app's lifespan is not run:
    start what it needs around the call.
    Returns the report; raises ``ValueError`` for options out of range.
    """
    import json as _json

    body = b""
    content_type = None
    if json is not None:
        body = _json.dumps(json, separators=(",", ":")).encode()
        content_type = "application/json"
    elif data is not None:
        body = data.encode() if isinstance(data, str) else data
    other = None
    if other_json is not None:
        other = _json.dumps(other_json, separators=(",", ":")).encode()
    options = CheckOptions(
        url=_BASE + path,
        method=method.upper(),
        body=body,
        content_type=content_type,
        headers=_pairs(headers),
        other_caller_headers=_pairs(other_caller_headers),
        other_body=other,
        storm=storm,
        max_requests=max_requests,
        mismatch_status=mismatch_status,
        key_required=key_required,
        count_url=None if count_path is None else _BASE + count_path,
        slow_url=None if slow_path is None else _BASE + slow_path,
        hold=hold,
        fail_header=fail_header,
        timeout=request_timeout,
        expect_wait=expect_wait,
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url=_BASE) as client:
        return await run_checks(client, options)


async def assert_conforms(app: Any, path: str, **options: Any) -> CheckReport:
    """:func:`check_app`, then ``AssertionError`` with the table if any check failed.

    Checks not run do not fail the assertion (the table lists them with why); pass
    what they need (``other_caller_headers``, ``count_path``, ``fail_header``) to run them.
    """
    report = await check_app(app, path, **options)
    if not report.ok:
        raise AssertionError("Idempotency-Key checks failed:\n" + report.table())
    return report
