"""The conformance checks themselves: what each sends, what it judges a pass, what it costs.

Each check is a coroutine over the budgeted sender (:mod:`.check_client`), the options
and the facts earlier checks learnt; :func:`.check.run_checks` runs them in
:data:`.check_report.CHECKS` order.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from asgi_idempotency.ops.check_client import (
    REPLAYED,
    CheckOptions,
    Sender,
    count_of,
    derive_other_body,
    fresh_key,
    is_marked,
    is_ok,
    said,
    shown,
    unreachable_reason,
)
from asgi_idempotency.ops.check_report import WAIT_CHECK, CheckResult, Outcome

__all__ = ["SINGLE", "Facts", "first_request", "missing_input", "needs", "replay"]


@dataclass
class Facts:
    """What earlier checks learnt about the API, for the later ones to judge by."""

    first: httpx.Response | None = None
    first_key: str = ""
    marks_replays: bool | None = None
    ids_in_bodies: bool | None = None
    unreachable: str | None = None  # the origin and why, when the first got no connection
    results: list[CheckResult] = field(default_factory=list)


_Check = Callable[[Sender, CheckOptions, Facts], Awaitable[CheckResult]]


def _result(name: str, outcome: Outcome, detail: str, requests: int) -> CheckResult:
    return CheckResult(name, outcome, detail, requests)


async def first_request(s: Sender, o: CheckOptions, f: Facts) -> CheckResult:
    f.first_key = fresh_key()
    before = s.sent
    try:
        r = await s.send(o.method, o.url, key=f.first_key)
    except httpx.TransportError as exc:
        detail = f"could not reach {shown(o.url)}: {type(exc).__name__}: {exc}"
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
            f.unreachable = f"{s.origin}: {unreachable_reason(exc)}"
        return _result("first-request", Outcome.FAIL, detail, s.sent - before)
    if not is_ok(r):
        return _result(
            "first-request",
            Outcome.FAIL,
            f"answered {said(r)}: the checks need a request the API accepts with a new key "
            "(check the credentials in --header, the method and the body)",
            1,
        )
    f.first = r
    return _result("first-request", Outcome.PASS, f"answered {r.status_code}", 1)


async def replay(s: Sender, o: CheckOptions, f: Facts) -> list[CheckResult]:
    assert f.first is not None
    r = await s.send(o.method, o.url, key=f.first_key)
    marked = is_marked(r)
    if r.status_code == f.first.status_code and r.content == f.first.content:
        f.marks_replays = marked
        replay = _result("replay", Outcome.PASS, f"{r.status_code}, the same body byte for byte", 1)
        if marked:
            mark = _result("replay-marked", Outcome.PASS, f"{REPLAYED}: true", 0)
        else:
            mark = _result("replay-marked", Outcome.FAIL, f"no {REPLAYED}: true on the replay", 0)
        return [replay, mark]
    if r.status_code != f.first.status_code:
        detail = f"the retry answered {said(r)}, the first {f.first.status_code}"
    else:
        detail = f"the retry got another body ({len(r.content)} bytes): it ran again"
    return [
        _result("replay", Outcome.FAIL, detail, 1),
        _result("replay-marked", Outcome.NOT_RUN, "the retry was not a replay", 0),
    ]


async def _count(s: Sender, o: CheckOptions) -> int | None:
    assert o.count_url is not None
    return count_of(await s.send("GET", o.count_url, body=b""))


async def _storm(s: Sender, o: CheckOptions, f: Facts) -> CheckResult:
    name = "storm-one-effect"
    key = fresh_key()
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
    bodies = {r.content for r in responses if is_ok(r)}
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


def _same_answer(f: Facts, r: httpx.Response) -> bool:
    assert f.first is not None
    return r.status_code == f.first.status_code and r.content == f.first.content


async def _quoted_key(s: Sender, o: CheckOptions, f: Facts) -> CheckResult:
    name = "quoted-key"
    r = await s.send(o.method, o.url, key=f'"{f.first_key}"')
    if not _same_answer(f, r):
        what = "another body: it ran again" if is_ok(r) else said(r)
        return _result(name, Outcome.FAIL, f"the quoted key got {what}, not the replay", 1)
    if is_marked(r) or (f.marks_replays is not True and f.ids_in_bodies):
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


async def _other_caller(s: Sender, o: CheckOptions, f: Facts) -> CheckResult:
    name = "other-caller"
    r = await s.send(o.method, o.url, key=f.first_key, headers=_other_headers(o))
    if r.status_code in (401, 403, 407):
        return _result(
            name, Outcome.NOT_RUN, f"the other caller's headers were refused ({said(r)})", 1
        )
    if not is_ok(r):
        return _result(
            name, Outcome.FAIL, f"answered {said(r)}: the first caller's record was in the way", 1
        )
    if is_marked(r):
        return _result(name, Outcome.FAIL, "got the first caller's stored answer (marked)", 1)
    if not _same_answer(f, r) or f.marks_replays:
        return _result(name, Outcome.PASS, f"its own answer ({r.status_code})", 1)
    if f.ids_in_bodies:
        return _result(name, Outcome.FAIL, "got the first caller's answer byte for byte", 1)
    return _result(
        name, Outcome.NOT_RUN, "cannot tell a replay: bodies carry no id, replays no mark", 1
    )


async def _key_reuse(s: Sender, o: CheckOptions, f: Facts) -> CheckResult:
    name = "key-reuse"
    other = o.other_body if o.other_body is not None else derive_other_body(o.body, o.content_type)
    if other is None or other == o.body:
        return _result(
            name, Outcome.NOT_RUN, "no other body to send (pass --other-json or --other-data)", 0
        )
    r = await s.send(o.method, o.url, key=f.first_key, body=other)
    # The other body under a new key must be accepted: else a refusal could be the
    # body's own validation error, not the key's.
    control = await s.send(o.method, o.url, key=fresh_key(), body=other)
    if r.status_code == o.mismatch_status and is_ok(control):
        return _result(name, Outcome.PASS, f"answered {said(r)}", 2)
    if not is_ok(control) and not is_ok(r):
        return _result(
            name,
            Outcome.NOT_RUN,
            f"the other body is refused under a new key too ({said(control)}): "
            "pass a valid one with --other-json or --other-data",
            2,
        )
    if is_ok(r):
        what = "the first answer" if _same_answer(f, r) else "a new answer: it ran"
        detail = f"answered {r.status_code} with {what}, expected {o.mismatch_status}"
    else:
        detail = f"answered {said(r)}, expected {o.mismatch_status}"
    return _result(name, Outcome.FAIL, detail, 2)


async def _refused(s: Sender, o: CheckOptions, name: str, what: str, **send: Any) -> CheckResult:
    r = await s.send(o.method, o.url, **send)
    if r.status_code == 400:
        return _result(name, Outcome.PASS, f"answered {said(r)}", 1)
    ran = ": it ran" if is_ok(r) else ""
    return _result(name, Outcome.FAIL, f"{what} answered {said(r)}{ran}, expected 400", 1)


async def _key_list(s: Sender, o: CheckOptions, f: Facts) -> CheckResult:
    listed = f'"{fresh_key()}", "{fresh_key()}"'
    return await _refused(s, o, "key-list", "a list of two keys", key=listed)


async def _two_headers(s: Sender, o: CheckOptions, f: Facts) -> CheckResult:
    both = (fresh_key(), fresh_key())
    return await _refused(s, o, "two-key-headers", "two Idempotency-Key headers", keys=both)


async def _missing_key(s: Sender, o: CheckOptions, f: Facts) -> CheckResult:
    return await _refused(s, o, "missing-key", "no key")


_Overlap = tuple[httpx.Response, httpx.Response, dict[str, float]]


async def _overlap(s: Sender, o: CheckOptions, name: str) -> CheckResult | _Overlap:
    """A request to the slow URL and its duplicate ``hold`` seconds later: both answers
    and when each came, or why the two did not overlap (not run)."""
    url = o.slow_url or o.url
    key = fresh_key()
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
            if not is_ok(r):
                return _result(name, Outcome.NOT_RUN, f"the endpoint answered {said(r)}", 1)
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
    return original, duplicate, done_at


async def _in_flight(s: Sender, o: CheckOptions, f: Facts) -> CheckResult:
    name = "in-flight-409"
    seen = await _overlap(s, o, name)
    if isinstance(seen, CheckResult):
        return seen
    original, duplicate, done_at = seen
    answers = {"first": original, "duplicate": duplicate}
    conflicts = [label for label, r in answers.items() if r.status_code == 409]
    if len(conflicts) == 1:
        r = answers[conflicts[0]]
        winner = answers["first" if conflicts[0] == "duplicate" else "duplicate"]
        if not r.headers.get("retry-after"):
            return _result(name, Outcome.FAIL, "409 without Retry-After", 2)
        if not is_ok(winner):
            return _result(
                name, Outcome.FAIL, f"409, but the request it ran answered {said(winner)}", 2
            )
        return _result(name, Outcome.PASS, f"409, Retry-After: {r.headers['retry-after']}", 2)
    if is_ok(original) and is_ok(duplicate):
        if original.content != duplicate.content:
            detail = "the duplicate ran while the first still ran (two different 2xx answers)"
        elif done_at["duplicate"] >= done_at["first"]:
            detail = (
                "the duplicate waited for the first and got its answer, not 409 at once "
                "(a route with Policy(wait=...): pass --expect-wait)"
            )
        else:
            detail = f"the duplicate answered {duplicate.status_code} while the first still ran"
        return _result(name, Outcome.FAIL, detail, 2)
    return _result(
        name, Outcome.FAIL, f"first answered {said(original)}, duplicate {said(duplicate)}", 2
    )


async def _in_flight_wait(s: Sender, o: CheckOptions, f: Facts) -> CheckResult:
    """With ``expect_wait``: the duplicate waits for the first and gets its answer, replayed
    (marked, when the API marks replays), never a 409 and never a run of its own."""
    name = WAIT_CHECK[0]
    seen = await _overlap(s, o, name)
    if isinstance(seen, CheckResult):
        return seen
    original, duplicate, done_at = seen
    if not is_ok(original):
        return _result(name, Outcome.FAIL, f"the first answered {said(original)}", 2)
    if duplicate.status_code == 409:
        return _result(
            name,
            Outcome.FAIL,
            f"the duplicate got {said(duplicate)} at once instead of waiting for the first's "
            "answer (a route without Policy(wait=...), or a wait shorter than the first)",
            2,
        )
    if duplicate.status_code != original.status_code or duplicate.content != original.content:
        what = "another 2xx answer: it ran" if is_ok(duplicate) else said(duplicate)
        return _result(name, Outcome.FAIL, f"the duplicate got {what}, not the first's answer", 2)
    if done_at["duplicate"] < done_at["first"]:
        return _result(
            name, Outcome.FAIL, "the duplicate got the first's answer before the first did", 2
        )
    if f.marks_replays and not is_marked(duplicate):
        return _result(
            name, Outcome.FAIL, f"the duplicate got the first's answer without {REPLAYED}: true", 2
        )
    waited = done_at["duplicate"] - done_at["first"]
    mark = f", {REPLAYED}: true" if is_marked(duplicate) else ""
    return _result(
        name,
        Outcome.PASS,
        f"the duplicate waited and got the first's answer ({duplicate.status_code}{mark}), "
        f"{waited:.2f} s after it",
        2,
    )


async def _releases(s: Sender, o: CheckOptions, f: Facts) -> CheckResult:
    name = "5xx-releases-key"
    assert o.fail_header is not None
    key = fresh_key()
    failed = await s.send(o.method, o.url, key=key, extra=[o.fail_header])
    if failed.status_code < 500:
        return _result(
            name, Outcome.NOT_RUN, f"--fail-header did not make it fail ({said(failed)})", 1
        )
    retry = await s.send(o.method, o.url, key=key)
    if is_ok(retry) and not is_marked(retry):
        return _result(name, Outcome.PASS, f"{failed.status_code}, then the retry ran", 2)
    if retry.status_code == failed.status_code and retry.content == failed.content:
        detail = f"the {failed.status_code} was kept and replayed"
    else:
        detail = f"the retry after {failed.status_code} answered {said(retry)}"
    return _result(name, Outcome.FAIL, detail, 2)


def needs(o: CheckOptions) -> dict[str, int]:
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
        WAIT_CHECK[0]: 2,
        "5xx-releases-key": 2,
    }


def missing_input(o: CheckOptions) -> Mapping[str, str]:
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


SINGLE: dict[str, _Check] = {
    "storm-one-effect": _storm,
    "quoted-key": _quoted_key,
    "other-caller": _other_caller,
    "key-reuse": _key_reuse,
    "key-list": _key_list,
    "two-key-headers": _two_headers,
    "missing-key": _missing_key,
    "in-flight-409": _in_flight,
    WAIT_CHECK[0]: _in_flight_wait,
    "5xx-releases-key": _releases,
}
