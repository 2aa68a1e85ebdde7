"""``asgi-idempotency check URL``: an HTTP API's Idempotency-Key handling, checked from outside
(:mod:`asgi_idempotency.ops.check`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any, TextIO

from asgi_idempotency.ops.commands._common import CLIError, Exit, command, output

__all__ = ["check"]


@command("check")
def check(
    url: str,
    *,
    method: str = "POST",
    json_body: bytes | None = None,
    data: str | None = None,
    headers: Sequence[tuple[str, str]] = (),
    other_caller_headers: Sequence[tuple[str, str]] = (),
    other_json: bytes | None = None,
    other_data: str | None = None,
    storm: int = 10,
    max_requests: int = 50,
    count_url: str | None = None,
    slow_url: str | None = None,
    hold: float = 0.25,
    mismatch_status: int = 422,
    key_optional: bool = False,
    expect_wait: bool = False,
    fail_header: tuple[str, str] | None = None,
    request_timeout: float = 30.0,
    output_format: str = "table",
    out: TextIO | None = None,
) -> int:
    """Send what real clients send to ``url`` and report each check as pass, fail or not
    run (:class:`~asgi_idempotency.ops.check.CheckOptions` says what each option means;
    ``count_url`` and ``slow_url`` may be paths on ``url``'s origin). ``output_format``:
    ``table`` or ``json``.

    Returns 0 when no check failed, 1 when one did, 2 on a usage error, httpx missing,
    or when ``url``'s origin could not be reached (one line on stderr says which).
    """
    out = output(out)
    try:
        import httpx

        from asgi_idempotency.ops.check import CheckOptions, run_checks
    except ImportError:
        raise CLIError(
            Exit.USAGE,
            "check needs httpx, which is not installed: pip install 'asgi-idempotency[client]'",
        ) from None
    headers = tuple(headers)
    content_type = next((v for n, v in headers if n.lower() == "content-type"), None)
    body: bytes = json_body if json_body is not None else (data or "").encode()
    if json_body is not None and content_type is None:
        content_type = "application/json"
    other: bytes | None = None
    if other_json is not None:
        other = other_json
    elif other_data is not None:
        other = other_data.encode()

    def resolve(relative: str | None) -> str | None:
        return None if relative is None else str(httpx.URL(url).join(relative))

    try:
        options = CheckOptions(
            url=url,
            method=method.upper(),
            body=body,
            content_type=content_type,
            headers=headers,
            other_caller_headers=tuple(other_caller_headers),
            other_body=other,
            storm=storm,
            max_requests=max_requests,
            mismatch_status=mismatch_status,
            key_required=not key_optional,
            count_url=resolve(count_url),
            slow_url=resolve(slow_url),
            hold=hold,
            fail_header=fail_header,
            timeout=request_timeout,
            expect_wait=expect_wait,
        )
    except (ValueError, httpx.InvalidURL) as exc:
        raise CLIError(Exit.USAGE, str(exc)) from None

    async def run() -> Any:
        # No environment proxies: the requests go to the URL's origin and nowhere else.
        async with httpx.AsyncClient(trust_env=False) as client:
            return await run_checks(client, options)

    report = asyncio.run(run())
    if report.unreachable is not None:
        # Nothing was checked: not a verdict on the API, so not exit 1.
        raise CLIError(Exit.USAGE, f"cannot reach {report.unreachable}")
    if output_format == "json":
        print(json.dumps(report.to_dict(), indent=2), file=out)
    else:
        print(report.table(), file=out)
    return Exit.OK if report.ok else Exit.NOT_FOUND
