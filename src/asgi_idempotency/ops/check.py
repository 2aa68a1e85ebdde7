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

The parts: what is sent (:mod:`.check_client`), the checks (:mod:`.checks`), what was
found (:mod:`.check_report`); this module runs them in order.
"""

from __future__ import annotations

try:
    import httpx
except ImportError as exc:  # pragma: no cover - exercised by a subprocess test
    from asgi_idempotency._extras import missing_extra

    raise missing_extra("asgi_idempotency.ops.check", "httpx", "client") from exc

from asgi_idempotency.ops.check_client import CheckOptions, Sender, derive_other_body, shown
from asgi_idempotency.ops.check_report import CHECKS, WAIT_CHECK, CheckResult, Outcome, Report
from asgi_idempotency.ops.checks import SINGLE, Facts, first_request, missing_input, needs, replay

__all__ = [
    "CHECKS",
    "WAIT_CHECK",
    "CheckOptions",
    "CheckResult",
    "Outcome",
    "Report",
    "derive_other_body",
    "run_checks",
]


async def run_checks(client: httpx.AsyncClient, options: CheckOptions) -> Report:
    """Run every check in :data:`CHECKS` order against ``options.url`` over ``client``.

    Sends at most ``options.max_requests`` requests, all to the URL's origin. Returns
    the :class:`Report`; raises only what ``client`` raises that is not an
    ``httpx.TransportError`` (a transport error fails the check it happened in; when
    the first request gets no connection at all, ``Report.unreachable`` says what could
    not be reached). With ``options.expect_wait`` the in-flight check is
    :data:`WAIT_CHECK`, in ``in-flight-409``'s place.
    """
    s = Sender(client, options)
    f = Facts()
    results: list[CheckResult] = []
    s.reserve(1)
    results.append(await first_request(s, options, f))
    cost = needs(options)
    missing = missing_input(options)

    def not_run(name: str, why: str) -> None:
        results.append(CheckResult(name, Outcome.NOT_RUN, why, 0))

    for name, _ in CHECKS[1:]:
        if name == "replay-marked":
            continue  # judged with replay
        if name == "in-flight-409" and options.expect_wait:
            name = WAIT_CHECK[0]
        if f.first is None:
            not_run(name, "the first request failed")
            if name == "replay":
                not_run("replay-marked", "the first request failed")
            continue
        if name in missing:
            not_run(name, missing[name])
            continue
        before = s.sent
        if not s.reserve(cost[name]):
            left = options.max_requests - s.sent
            why = (
                f"needs {cost[name]} request{'' if cost[name] == 1 else 's'}, "
                f"{left} left of --max-requests"
            )
            not_run(name, why)
            if name == "replay":
                not_run("replay-marked", why)
            continue
        try:
            if name == "replay":
                results.extend(await replay(s, options, f))
            else:
                results.append(await SINGLE[name](s, options, f))
        except httpx.TransportError as exc:
            results.append(
                CheckResult(name, Outcome.FAIL, f"no answer: {type(exc).__name__}", s.sent - before)
            )
            if name == "replay":
                not_run("replay-marked", "the retry got no answer")
    url = shown(options.url)  # the report never prints a user name or password
    return Report(url, tuple(results), s.sent, options.max_requests, f.unreachable)
