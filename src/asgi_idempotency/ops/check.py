"""Conformance checks for any HTTP API that claims ``Idempotency-Key`` support.

The checks send what real clients send (a retry, a storm of duplicates, the same key
with another body, a key list, a duplicate while the first runs, another caller, the
quoted key form, a retry after a 5xx) and judge the answers against
draft-ietf-httpapi-idempotency-key-header and this library's stronger guarantees.
They run over any ``httpx.AsyncClient``: a real URL (``asgi-idempotency check``) or an
ASGI app in process (``httpx.ASGITransport``, :mod:`asgi_idempotency.testing`).

Every check has a request budget declared before it sends anything: the run never
sends more than ``max_requests``, and never to another origin than the URL's (no
redirects are followed). A check that lacks what it needs (a count URL, a second
caller, an endpoint that fails on demand, budget) is "not run" with the reason, never
a pass.
"""

from __future__ import annotations

import asyncio
import enum
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

try:
    import httpx
except ImportError as exc:  # pragma: no cover - exercised by a subprocess test
    from asgi_idempotency._extras import missing_extra

    raise missing_extra("asgi_idempotency.ops.check", "httpx", "client") from exc

__all__ = [
    "CHECKS",
    "CheckOptions",
    "CheckResult",
    "Outcome",
    "Report",
    "derive_other_body",
    "run_checks",
]

HEADER = "Idempotency-Key"
REPLAYED = "Idempotent-Replayed"

#: Every check, in the order it runs: (name, what it asks of the API).
CHECKS: tuple[tuple[str, str], ...] = (
    ("first-request", "a request with a new key is accepted (2xx)"),
    ("replay", "a retry after the first completed gets its answer byte for byte"),
    ("replay-marked", "the replay carries Idempotent-Replayed: true"),
    ("storm-one-effect", "N concurrent duplicates make one effect"),
    ("quoted-key", 'the Structured-Field string form ("abc") is the same key as abc'),
    ("other-caller", "another caller with the same key gets its own answer"),
    ("key-reuse", "the same key with another body is refused (422)"),
    ("key-list", "a list of keys in one header is refused (400)"),
    ("two-key-headers", "two Idempotency-Key headers are refused (400)"),
    ("missing-key", "no key on a route that requires one is refused (400)"),
    ("in-flight-409", "a duplicate while the first runs gets 409 with Retry-After"),
    ("5xx-releases-key", "after a 5xx the key is released: a retry runs again"),
)
_TITLES = dict(CHECKS)


class Outcome(enum.StrEnum):
    PASS = "pass"
    FAIL = "fail"
    NOT_RUN = "not run"


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One check's outcome; ``detail`` says what was seen (or why it did not run)."""

    name: str
    outcome: Outcome
    detail: str
    requests: int = 0

    @property
    def title(self) -> str:
        return _TITLES[self.name]


@dataclass(frozen=True, slots=True)
class CheckOptions:
    """What to send and what to expect.

    ``url`` is absolute. ``headers`` go on every request (the first caller's
    credentials); ``other_caller_headers`` replace headers of the same names for the
    second caller. ``count_url`` answers ``GET`` with the number of effects so far (a
    JSON integer, or an object with an integer ``count``). ``slow_url`` is an endpoint
    on the same origin that takes longer than ``hold`` seconds (the in-flight check
    sends its duplicate ``hold`` seconds after the first). ``fail_header`` makes the
    endpoint answer 5xx. ``timeout`` is seconds per request.
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

    def __post_init__(self) -> None:
        origin = _origin(self.url)
        for name in ("count_url", "slow_url"):
            other = getattr(self, name)
            if other is not None and _origin(other) != origin:
                raise ValueError(
                    f"{name} {other!r} is not on {origin}: the checks send only to the URL's origin"
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


def _origin(url: str) -> str:
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"{url!r} is not an absolute http(s) URL")
    return f"{parsed.scheme}://{parsed.host}:{parsed.port or _DEFAULT_PORTS[parsed.scheme]}"


_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True, slots=True)
class Report:
    """Every check's result, in :data:`CHECKS` order, and how many requests went out."""

    url: str
    results: tuple[CheckResult, ...]
    requests_sent: int
    max_requests: int

    def _named(self, outcome: Outcome) -> list[str]:
        return [r.name for r in self.results if r.outcome is outcome]

    @property
    def failed(self) -> list[str]:
        return self._named(Outcome.FAIL)

    @property
    def passed(self) -> list[str]:
        return self._named(Outcome.PASS)

    @property
    def not_run(self) -> list[str]:
        return self._named(Outcome.NOT_RUN)

    @property
    def ok(self) -> bool:
        """No check failed (checks not run are not passes, and are listed apart)."""
        return not self.failed

    def result(self, name: str) -> CheckResult:
        for r in self.results:
            if r.name == name:
                return r
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "ok": self.ok,
            "passed": self.passed,
            "failed": self.failed,
            "not_run": self.not_run,
            "requests_sent": self.requests_sent,
            "max_requests": self.max_requests,
            "checks": [
                {
                    "name": r.name,
                    "title": r.title,
                    "outcome": str(r.outcome),
                    "detail": r.detail,
                    "requests": r.requests,
                }
                for r in self.results
            ],
        }

    def table(self) -> str:
        """A plain-text table, then a summary naming every failing check."""
        width = max(len(r.name) for r in self.results)
        lines = [f"{'check':<{width}}  {'result':<7}  detail"]
        for r in self.results:
            lines.append(f"{r.name:<{width}}  {r.outcome!s:<7}  {r.detail}")
        lines.append("")
        summary = (
            f"{len(self.passed)} passed, {len(self.failed)} failed, {len(self.not_run)} not run; "
            f"{self.requests_sent} requests sent (at most {self.max_requests}) to {self.url}"
        )
        lines.append(summary)
        if self.failed:
            lines.append("failed: " + ", ".join(self.failed))
        return "\n".join(lines)


class _BudgetSpent(AssertionError):
    """A check tried to send past its budget or off the URL's origin (a bug here)."""


class _Sender:
    """Sends within the budget: a check reserves what it may send before it sends."""

    def __init__(self, client: httpx.AsyncClient, options: CheckOptions) -> None:
        self.client = client
        self.options = options
        self.origin = _origin(options.url)
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
        if _origin(url) != self.origin:
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


def _fresh_key() -> str:
    return f"check-{uuid.uuid4()}"


def _ok(response: httpx.Response) -> bool:
    return 200 <= response.status_code < 300


def _marked(response: httpx.Response) -> bool:
    marker: str = response.headers.get(REPLAYED, "")
    return marker.strip().lower() == "true"


def _said(response: httpx.Response) -> str:
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


@dataclass
class _Facts:
    """What earlier checks learnt about the API, for the later ones to judge by."""

    first: httpx.Response | None = None
    first_key: str = ""
    marks_replays: bool | None = None
    ids_in_bodies: bool | None = None
    results: list[CheckResult] = field(default_factory=list)


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


def _count_of(response: httpx.Response) -> int | None:
    if not _ok(response):
        return None
    try:
        data = response.json()
    except ValueError:
        return None
    if isinstance(data, dict):
        data = data.get("count")
    return data if isinstance(data, int) and not isinstance(data, bool) else None


_Check = Callable[[_Sender, CheckOptions, _Facts], Awaitable[CheckResult]]


def _result(name: str, outcome: Outcome, detail: str, requests: int) -> CheckResult:
    return CheckResult(name, outcome, detail, requests)


async def _first_request(s: _Sender, o: CheckOptions, f: _Facts) -> CheckResult:
    f.first_key = _fresh_key()
    before = s.sent
    try:
        r = await s.send(o.method, o.url, key=f.first_key)
    except httpx.TransportError as exc:
        detail = f"could not reach {o.url}: {type(exc).__name__}: {exc}"
        return _result("first-request", Outcome.FAIL, detail, s.sent - before)
    if not _ok(r):
        return _result(
            "first-request",
            Outcome.FAIL,
            f"answered {_said(r)}: the checks need a request the API accepts with a new key "
            "(check the credentials in --header, the method and the body)",
            1,
        )
    f.first = r
    return _result("first-request", Outcome.PASS, f"answered {r.status_code}", 1)


async def _replay(s: _Sender, o: CheckOptions, f: _Facts) -> list[CheckResult]:
    assert f.first is not None
    r = await s.send(o.method, o.url, key=f.first_key)
    marked = _marked(r)
    if r.status_code == f.first.status_code and r.content == f.first.content:
        f.marks_replays = marked
        replay = _result("replay", Outcome.PASS, f"{r.status_code}, the same body byte for byte", 1)
        if marked:
            mark = _result("replay-marked", Outcome.PASS, f"{REPLAYED}: true", 0)
        else:
            mark = _result("replay-marked", Outcome.FAIL, f"no {REPLAYED}: true on the replay", 0)
        return [replay, mark]
    if r.status_code != f.first.status_code:
        detail = f"the retry answered {_said(r)}, the first {f.first.status_code}"
    else:
        detail = f"the retry got another body ({len(r.content)} bytes): it ran again"
    return [
        _result("replay", Outcome.FAIL, detail, 1),
        _result("replay-marked", Outcome.NOT_RUN, "the retry was not a replay", 0),
    ]


async def _count(s: _Sender, o: CheckOptions) -> int | None:
    assert o.count_url is not None
    return _count_of(await s.send("GET", o.count_url, body=b""))


async def _storm(s: _Sender, o: CheckOptions, f: _Facts) -> CheckResult:
    name = "storm-one-effect"
    key = _fresh_key()
    before = await _count(s, o) if o.count_url else None
    if o.count_url and before is None:
        return _result(name, Outcome.NOT_RUN, "--count-url did not answer a count", 1)
    answers = await asyncio.gather(
        *(s.send(o.method, o.url, key=key) for _ in range(o.storm)), return_exceptions=True
    )
    after = await _count(s, o) if o.count_url else None
    used = o.storm + (2 if o.count_url else 0)
    responses = [a for a in answers if isinstance(a, httpx.Response)]
    errors = [a for a in answers if not isinstance(a, httpx.Response)]
    for a in errors:
        if not isinstance(a, httpx.TransportError):
            raise a
    statuses: dict[int, int] = {}
    for r in responses:
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
    seen = ", ".join(f"{n} x {code}" for code, n in sorted(statuses.items()))
    if errors:
        seen += f", {len(errors)} x no answer ({type(errors[0]).__name__})"
    bodies = {r.content for r in responses if _ok(r)}
    if len(bodies) > 1:
        f.ids_in_bodies = True
    if o.count_url:
        if before is None or after is None:
            return _result(name, Outcome.NOT_RUN, "--count-url did not answer a count", used)
        effects = after - before
        outcome = Outcome.PASS if effects == 1 else Outcome.FAIL
        return _result(
            name,
            outcome,
            f"{o.storm} requests ({seen}): {effects} effect{'' if effects == 1 else 's'} counted",
            used,
        )
    if not bodies:
        return _result(name, Outcome.FAIL, f"{o.storm} requests, none succeeded ({seen})", used)
    if len(bodies) > 1:
        return _result(
            name,
            Outcome.FAIL,
            f"{o.storm} requests ({seen}): {len(bodies)} different answers, {len(bodies)} effects",
            used,
        )
    assert f.first is not None
    if bodies == {f.first.content}:
        f.ids_in_bodies = False
        return _result(
            name,
            Outcome.NOT_RUN,
            "answers under different keys have the same body, so bodies cannot tell effects "
            "apart: name a URL that counts them (--count-url)",
            used,
        )
    f.ids_in_bodies = True
    return _result(name, Outcome.PASS, f"{o.storm} requests ({seen}): one answer", used)


def _same_answer(f: _Facts, r: httpx.Response) -> bool:
    assert f.first is not None
    return r.status_code == f.first.status_code and r.content == f.first.content


async def _quoted_key(s: _Sender, o: CheckOptions, f: _Facts) -> CheckResult:
    name = "quoted-key"
    r = await s.send(o.method, o.url, key=f'"{f.first_key}"')
    if not _same_answer(f, r):
        what = "another body: it ran again" if _ok(r) else _said(r)
        return _result(name, Outcome.FAIL, f"the quoted key got {what}, not the replay", 1)
    if _marked(r) or (f.marks_replays is not True and f.ids_in_bodies):
        return _result(name, Outcome.PASS, "the quoted key got the replay", 1)
    if f.marks_replays:
        return _result(name, Outcome.FAIL, "the quoted key ran again (answer not marked)", 1)
    return _result(
        name, Outcome.NOT_RUN, "cannot tell a replay: bodies carry no id, replays no mark", 1
    )


def _other_headers(o: CheckOptions) -> list[tuple[str, str]]:
    replaced = {n.lower() for n, _ in o.other_caller_headers}
    return [(n, v) for n, v in o.headers if n.lower() not in replaced] + list(
        o.other_caller_headers
    )


async def _other_caller(s: _Sender, o: CheckOptions, f: _Facts) -> CheckResult:
    name = "other-caller"
    r = await s.send(o.method, o.url, key=f.first_key, headers=_other_headers(o))
    if r.status_code in (401, 403, 407):
        return _result(
            name, Outcome.NOT_RUN, f"the other caller's headers were refused ({_said(r)})", 1
        )
    if not _ok(r):
        return _result(
            name, Outcome.FAIL, f"answered {_said(r)}: the first caller's record was in the way", 1
        )
    if _marked(r):
        return _result(name, Outcome.FAIL, "got the first caller's stored answer (marked)", 1)
    if not _same_answer(f, r) or f.marks_replays:
        return _result(name, Outcome.PASS, f"its own answer ({r.status_code})", 1)
    if f.ids_in_bodies:
        return _result(name, Outcome.FAIL, "got the first caller's answer byte for byte", 1)
    return _result(
        name, Outcome.NOT_RUN, "cannot tell a replay: bodies carry no id, replays no mark", 1
    )


async def _key_reuse(s: _Sender, o: CheckOptions, f: _Facts) -> CheckResult:
    name = "key-reuse"
    other = o.other_body if o.other_body is not None else derive_other_body(o.body, o.content_type)
    if other is None or other == o.body:
        return _result(
            name, Outcome.NOT_RUN, "no other body to send (pass --other-json or --other-data)", 0
        )
    r = await s.send(o.method, o.url, key=f.first_key, body=other)
    # The other body under a new key must be accepted: else a refusal could be the
    # body's own validation error, not the key's.
    control = await s.send(o.method, o.url, key=_fresh_key(), body=other)
    if r.status_code == o.mismatch_status and _ok(control):
        return _result(name, Outcome.PASS, f"answered {_said(r)}", 2)
    if not _ok(control) and not _ok(r):
        return _result(
            name,
            Outcome.NOT_RUN,
            f"the other body is refused under a new key too ({_said(control)}): "
            "pass a valid one with --other-json or --other-data",
            2,
        )
    if _ok(r):
        what = "the first answer" if _same_answer(f, r) else "a new answer: it ran"
        detail = f"answered {r.status_code} with {what}, expected {o.mismatch_status}"
    else:
        detail = f"answered {_said(r)}, expected {o.mismatch_status}"
    return _result(name, Outcome.FAIL, detail, 2)


async def _refused(s: _Sender, o: CheckOptions, name: str, what: str, **send: Any) -> CheckResult:
    r = await s.send(o.method, o.url, **send)
    if r.status_code == 400:
        return _result(name, Outcome.PASS, f"answered {_said(r)}", 1)
    ran = ": it ran" if _ok(r) else ""
    return _result(name, Outcome.FAIL, f"{what} answered {_said(r)}{ran}, expected 400", 1)


async def _key_list(s: _Sender, o: CheckOptions, f: _Facts) -> CheckResult:
    listed = f'"{_fresh_key()}", "{_fresh_key()}"'
    return await _refused(s, o, "key-list", "a list of two keys", key=listed)


async def _two_headers(s: _Sender, o: CheckOptions, f: _Facts) -> CheckResult:
    both = (_fresh_key(), _fresh_key())
    return await _refused(s, o, "two-key-headers", "two Idempotency-Key headers", keys=both)


async def _missing_key(s: _Sender, o: CheckOptions, f: _Facts) -> CheckResult:
    return await _refused(s, o, "missing-key", "no key")


async def _in_flight(s: _Sender, o: CheckOptions, f: _Facts) -> CheckResult:
    name = "in-flight-409"
    url = o.slow_url or o.url
    key = _fresh_key()
    done_at: dict[str, float] = {}

    async def timed(label: str) -> httpx.Response:
        r = await s.send(o.method, url, key=key)
        done_at[label] = time.monotonic()
        return r

    first = asyncio.ensure_future(timed("first"))
    try:
        await asyncio.sleep(o.hold)
        if first.done():
            r = await first
            if not _ok(r):
                return _result(name, Outcome.NOT_RUN, f"the endpoint answered {_said(r)}", 1)
            return _result(
                name,
                Outcome.NOT_RUN,
                f"the first answered within {o.hold:g} s, before the duplicate was sent: "
                "name a slower endpoint (--slow-url) or lower --hold",
                1,
            )
        duplicate = await timed("duplicate")
        original = await first
    finally:
        first.cancel()  # a no-op once it is done; else the duplicate failed and ends the check
    answers = {"first": original, "duplicate": duplicate}
    conflicts = [label for label, r in answers.items() if r.status_code == 409]
    if len(conflicts) == 1:
        r = answers[conflicts[0]]
        winner = answers["first" if conflicts[0] == "duplicate" else "duplicate"]
        if not r.headers.get("retry-after"):
            return _result(name, Outcome.FAIL, "409 without Retry-After", 2)
        if not _ok(winner):
            return _result(
                name, Outcome.FAIL, f"409, but the request it ran answered {_said(winner)}", 2
            )
        return _result(name, Outcome.PASS, f"409, Retry-After: {r.headers['retry-after']}", 2)
    if _ok(original) and _ok(duplicate):
        if original.content != duplicate.content:
            detail = "the duplicate ran while the first still ran (two different 2xx answers)"
        elif done_at["duplicate"] >= done_at["first"]:
            detail = "the duplicate waited for the first and got its answer, not 409 at once"
        else:
            detail = f"the duplicate answered {duplicate.status_code} while the first still ran"
        return _result(name, Outcome.FAIL, detail, 2)
    return _result(
        name, Outcome.FAIL, f"first answered {_said(original)}, duplicate {_said(duplicate)}", 2
    )


async def _releases(s: _Sender, o: CheckOptions, f: _Facts) -> CheckResult:
    name = "5xx-releases-key"
    assert o.fail_header is not None
    key = _fresh_key()
    failed = await s.send(o.method, o.url, key=key, extra=[o.fail_header])
    if failed.status_code < 500:
        return _result(
            name, Outcome.NOT_RUN, f"--fail-header did not make it fail ({_said(failed)})", 1
        )
    retry = await s.send(o.method, o.url, key=key)
    if _ok(retry) and not _marked(retry):
        return _result(name, Outcome.PASS, f"{failed.status_code}, then the retry ran", 2)
    if retry.status_code == failed.status_code and retry.content == failed.content:
        detail = f"the {failed.status_code} was kept and replayed"
    else:
        detail = f"the retry after {failed.status_code} answered {_said(retry)}"
    return _result(name, Outcome.FAIL, detail, 2)


def _needs(o: CheckOptions) -> dict[str, int]:
    return {
        "replay": 1,
        "storm-one-effect": o.storm + (2 if o.count_url else 0),
        "quoted-key": 1,
        "other-caller": 1,
        "key-reuse": 2,
        "key-list": 1,
        "two-key-headers": 1,
        "missing-key": 1,
        "in-flight-409": 2,
        "5xx-releases-key": 2,
    }


def _missing_input(o: CheckOptions) -> Mapping[str, str]:
    why: dict[str, str] = {}
    if not o.other_caller_headers:
        why["other-caller"] = "needs a second caller's credentials (--other-caller-header)"
    if not o.key_required:
        why["missing-key"] = "the route does not require a key (--key-optional)"
    if o.fail_header is None:
        why["5xx-releases-key"] = (
            "needs an endpoint that answers 5xx on demand (--fail-header 'Name: value')"
        )
    return why


_SINGLE: dict[str, _Check] = {
    "storm-one-effect": _storm,
    "quoted-key": _quoted_key,
    "other-caller": _other_caller,
    "key-reuse": _key_reuse,
    "key-list": _key_list,
    "two-key-headers": _two_headers,
    "missing-key": _missing_key,
    "in-flight-409": _in_flight,
    "5xx-releases-key": _releases,
}


async def run_checks(client: httpx.AsyncClient, options: CheckOptions) -> Report:
    """Run every check in :data:`CHECKS` order against ``options.url`` over ``client``.

    Sends at most ``options.max_requests`` requests, all to the URL's origin. Returns
    the :class:`Report`; raises only what ``client`` raises that is not an
    ``httpx.TransportError`` (a transport error fails the check it happened in).
    """
    s = _Sender(client, options)
    f = _Facts()
    results: list[CheckResult] = []
    s.reserve(1)
    results.append(await _first_request(s, options, f))
    needs = _needs(options)
    missing = _missing_input(options)

    def not_run(name: str, why: str) -> None:
        results.append(_result(name, Outcome.NOT_RUN, why, 0))

    for name, _ in CHECKS[1:]:
        if name == "replay-marked":
            continue  # judged with replay
        if f.first is None:
            not_run(name, "the first request failed")
            if name == "replay":
                not_run("replay-marked", "the first request failed")
            continue
        if name in missing:
            not_run(name, missing[name])
            continue
        before = s.sent
        if not s.reserve(needs[name]):
            left = options.max_requests - s.sent
            why = f"needs {needs[name]} requests, {left} left of --max-requests"
            not_run(name, why)
            if name == "replay":
                not_run("replay-marked", why)
            continue
        try:
            if name == "replay":
                results.extend(await _replay(s, options, f))
            else:
                results.append(await _SINGLE[name](s, options, f))
        except httpx.TransportError as exc:
            results.append(
                _result(name, Outcome.FAIL, f"no answer: {type(exc).__name__}", s.sent - before)
            )
            if name == "replay":
                not_run("replay-marked", "the retry got no answer")
    return Report(options.url, tuple(results), s.sent, options.max_requests)
