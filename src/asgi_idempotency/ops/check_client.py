"""What a run of the conformance checks sends, and how it reads the answers.

:class:`CheckOptions` says what to send and what to expect; the sender keeps every
request within the run's budget and on the URL's origin (no redirects followed).
"""

from __future__ import annotations

import json
import socket
import ssl
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

try:
    import httpx
except ImportError as exc:  # pragma: no cover - exercised by a subprocess test
    from asgi_idempotency._extras import missing_extra

    raise missing_extra("asgi_idempotency.ops.check", "httpx", "client") from exc

__all__ = [
    "HEADER",
    "REPLAYED",
    "CheckOptions",
    "Sender",
    "count_of",
    "derive_other_body",
    "fresh_key",
    "is_marked",
    "is_ok",
    "origin",
    "said",
    "shown",
    "unreachable_reason",
]

HEADER = "Idempotency-Key"
REPLAYED = "Idempotent-Replayed"


@dataclass(frozen=True, slots=True)
class CheckOptions:
    """What to send and what to expect.

    ``url`` is absolute. ``headers`` go on every request (the first caller's
    credentials); ``other_caller_headers`` replace headers of the same names for the
    second caller. ``count_url`` answers ``GET`` with the number of effects so far (a
    JSON integer, or an object with an integer ``count``). ``slow_url`` is an endpoint
    on the same origin that takes longer than ``hold`` seconds (the in-flight check
    sends its duplicate ``hold`` seconds after the first). ``fail_header`` makes the
    endpoint answer 5xx. ``timeout`` is seconds per request. ``expect_wait``: the route
    holds a duplicate until the first is done and replays its answer (this library's
    ``Policy(wait=...)``), so the in-flight check expects that instead of a 409
    (``in-flight-wait`` in ``in-flight-409``'s place).
    """

    url: str
    method: str = "POST"
    body: bytes = b""
    content_type: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    other_caller_headers: tuple[tuple[str, str], ...] = ()
    other_body: bytes | None = None
    storm: int = 10
    max_requests: int = 50
    mismatch_status: int = 422
    key_required: bool = True
    count_url: str | None = None
    slow_url: str | None = None
    hold: float = 0.25
    fail_header: tuple[str, str] | None = None
    timeout: float = 30.0
    expect_wait: bool = False

    def __post_init__(self) -> None:
        home = origin(self.url)
        for name in ("count_url", "slow_url"):
            other = getattr(self, name)
            if other is not None and origin(other) != home:
                raise ValueError(
                    f"{name} {other!r} is not on {home}: the checks send only to the URL's origin"
                )
        for name, _ in (*self.headers, *self.other_caller_headers):
            if name.lower() == HEADER.lower():
                raise ValueError(
                    f"the headers must not carry {HEADER}: each check chooses its own keys"
                )
        if self.storm < 2:
            raise ValueError(f"storm must be 2 or more, got {self.storm}")
        if self.max_requests < 1:
            raise ValueError(f"max_requests must be 1 or more, got {self.max_requests}")
        if not 100 <= self.mismatch_status <= 599:
            raise ValueError(f"mismatch_status must be an HTTP status, got {self.mismatch_status}")
        if not self.hold >= 0:
            raise ValueError(f"hold must be 0 or more seconds, got {self.hold}")


def unreachable_reason(exc: httpx.TransportError) -> str:
    """Why no connection was made, in a few words: refused, a name that did not resolve,
    TLS, a timeout. Never the URL (it may carry credentials), only what failed."""
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    text = " ".join(str(e) for e in chain).lower()
    if any(isinstance(e, ssl.SSLError) for e in chain) or "ssl" in text or "certificate" in text:
        reasons = [e.reason for e in chain if isinstance(e, ssl.SSLError) and e.reason]
        return "TLS failed" + (f" ({reasons[0]})" if reasons else "")
    if any(isinstance(e, socket.gaierror) for e in chain) or any(
        words in text for words in ("name or service not known", "nodename nor servname",
                                    "name resolution", "no address associated")
    ):  # fmt: skip
        return "the name did not resolve (DNS)"
    if any(isinstance(e, ConnectionRefusedError) for e in chain) or "refused" in text:
        return "connection refused"
    if isinstance(exc, httpx.ConnectTimeout):
        return "no connection within the request timeout"
    return f"no connection ({type(exc).__name__})"


def shown(url: str) -> str:
    """``url`` as a report may print it: without a user name or password."""
    return str(httpx.URL(url).copy_with(userinfo=b""))


def origin(url: str) -> str:
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"{url!r} is not an absolute http(s) URL")
    return f"{parsed.scheme}://{parsed.host}:{parsed.port or _DEFAULT_PORTS[parsed.scheme]}"


_DEFAULT_PORTS = {"http": 80, "https": 443}


class _BudgetSpent(AssertionError):
    """A check tried to send past its budget or off the URL's origin (a bug here)."""


class Sender:
    """Sends within the budget: a check reserves what it may send before it sends."""

    def __init__(self, client: httpx.AsyncClient, options: CheckOptions) -> None:
        self.client = client
        self.options = options
        self.origin = origin(options.url)
        self.sent = 0
        self.reserved = 0

    def reserve(self, n: int) -> bool:
        if self.sent + n > self.options.max_requests:
            return False
        self.reserved = self.sent + n
        return True

    async def send(
        self,
        method: str,
        url: str,
        *,
        key: str | None = None,
        keys: Sequence[str] = (),
        body: bytes | None = None,
        headers: Sequence[tuple[str, str]] | None = None,
        extra: Sequence[tuple[str, str]] = (),
    ) -> httpx.Response:
        # Both are bugs here (a check sending more than it reserved, or elsewhere than
        # the options allow): refused before anything is sent.
        if self.sent >= min(self.reserved, self.options.max_requests):
            raise _BudgetSpent(f"request {self.sent + 1} exceeds what the check reserved")
        if origin(url) != self.origin:
            raise _BudgetSpent(f"{url} is not on {self.origin}")
        self.sent += 1
        sent_headers = list(self.options.headers if headers is None else headers)
        if body is None:
            body = self.options.body if method not in ("GET", "HEAD") else b""
        if body and self.options.content_type and not _has(sent_headers, "content-type"):
            sent_headers.append(("Content-Type", self.options.content_type))
        if key is not None:
            sent_headers.append((HEADER, key))
        sent_headers += [(HEADER, k) for k in keys]
        sent_headers += list(extra)
        request = self.client.build_request(
            method, url, content=body or None, headers=sent_headers, timeout=self.options.timeout
        )
        return await self.client.send(request, follow_redirects=False)


def _has(headers: Sequence[tuple[str, str]], name: str) -> bool:
    return any(n.lower() == name for n, _ in headers)


def fresh_key() -> str:
    return f"check-{uuid.uuid4()}"


def is_ok(response: httpx.Response) -> bool:
    return 200 <= response.status_code < 300


def is_marked(response: httpx.Response) -> bool:
    marker: str = response.headers.get(REPLAYED, "")
    return marker.strip().lower() == "true"


def said(response: httpx.Response) -> str:
    """The status and, for a problem+json answer, its title: what the API said."""
    text = str(response.status_code)
    if "json" in response.headers.get("content-type", ""):
        try:
            data = response.json()
        except ValueError:
            return text
        if isinstance(data, dict) and isinstance(data.get("title"), str):
            return f"{text} ({data['title'][:80]})"
    return text


def derive_other_body(body: bytes, content_type: str | None) -> bytes | None:
    """A body that differs from ``body`` but stays valid for the same route, or None.

    JSON: the first number gets 1 added, else the first string gets ``-other``, else a
    field ``idempotency_check`` is added. A form: a field ``idempotency_check=1``
    appended. Anything else: None (pass ``other_body``).
    """
    if not body:
        return None
    try:
        data = json.loads(body)
    except ValueError:
        if content_type and "x-www-form-urlencoded" in content_type:
            return body + b"&idempotency_check=1"
        return None
    changed, done = _alter(data)
    if not done:
        if isinstance(data, dict):
            changed = {**data, "idempotency_check": 1}
        elif isinstance(data, list):
            changed = [*data, 1]
        else:
            return None
    return json.dumps(changed, separators=(",", ":")).encode()


def _alter(value: Any) -> tuple[Any, bool]:
    """``value`` with its first number (else first string) changed, and whether one was."""
    for kinds in ((float,), (str,)):
        changed, done = _alter_first(value, kinds)
        if done:
            return changed, True
    return value, False


def _alter_first(value: Any, kinds: tuple[type, ...]) -> tuple[Any, bool]:
    if isinstance(value, bool):
        return value, False
    if isinstance(value, str) and str in kinds:
        return value + "-other", True
    if isinstance(value, int | float) and float in kinds:
        return value + 1, True
    if isinstance(value, dict):
        for k, v in value.items():
            changed, done = _alter_first(v, kinds)
            if done:
                return {**value, k: changed}, True
    if isinstance(value, list):
        for i, v in enumerate(value):
            changed, done = _alter_first(v, kinds)
            if done:
                return [*value[:i], changed, *value[i + 1 :]], True
    return value, False


def count_of(response: httpx.Response) -> int | None:
    if not is_ok(response):
        return None
    try:
        data = response.json()
    except ValueError:
        return None
    if isinstance(data, dict):
        data = data.get("count")
    return data if isinstance(data, int) and not isinstance(data, bool) else None
