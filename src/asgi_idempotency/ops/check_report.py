"""What a run of the conformance checks found: each check's outcome and the report.

:data:`CHECKS` names every check in the order it runs; :class:`Report` holds their
results and renders them as a table or a dict (``asgi-idempotency check``'s two formats).
Nothing here sends a request (:mod:`.checks` does).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

__all__ = ["CHECKS", "WAIT_CHECK", "CheckResult", "Outcome", "Report"]


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

#: The in-flight check as a route that waits (``Policy(wait=...)``) is judged, in
#: ``in-flight-409``'s place, when the options say ``expect_wait``.
WAIT_CHECK = (
    "in-flight-wait",
    "a duplicate while the first runs waits for it and gets its answer, replayed",
)
_TITLES = dict((*CHECKS, WAIT_CHECK))


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
class Report:
    """Every check's result, in :data:`CHECKS` order, and how many requests went out."""

    url: str
    results: tuple[CheckResult, ...]
    requests_sent: int
    max_requests: int
    # What could not be reached ("http://host:port: connection refused"), origin only:
    # the first request never got an answer, so nothing was checked.
    unreachable: str | None = None

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
            f"{self.requests_sent} request{'' if self.requests_sent == 1 else 's'} sent "
            f"(at most {self.max_requests}) to {self.url}"
        )
        lines.append(summary)
        if self.failed:
            lines.append("failed: " + ", ".join(self.failed))
        return "\n".join(lines)
