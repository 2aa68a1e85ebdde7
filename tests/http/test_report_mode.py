"""Report-only mode: the same traffic gets the app's own answers, and the guard counts
exactly what it would have answered in enforcing mode."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asgi_idempotency import IdempotencyMiddleware, MemoryStore, Outcome, Policy
from asgi_idempotency.http.principals import ANONYMOUS

pytestmark = pytest.mark.anyio


class Shop:
    """An app whose answers show every run: a refund counter, and one slow first run."""

    def __init__(self, guard: dict[str, Any] | None) -> None:
        self.runs = 0
        self.started = asyncio.Event()
        self.release = asyncio.Event()

        async def refund(request: Request) -> Response:
            self.runs += 1
            n = self.runs
            if (await request.json()).get("slow") and not self.started.is_set():
                self.started.set()  # only the first slow run waits: a duplicate may run
                await self.release.wait()
            return JSONResponse({"refund": n}, status_code=201)

        middleware = [] if guard is None else [Middleware(IdempotencyMiddleware, **guard)]
        self.app = Starlette(
            routes=[Route("/refunds", refund, methods=["POST"])], middleware=middleware
        )
        self.guard: IdempotencyMiddleware | None = None

    async def traffic(self) -> list[tuple[int, bytes]]:
        """One of each answer the guard gives: new, replay, 409, 422, 400, 413."""
        transport = httpx.ASGITransport(app=self.app)
        answers: list[httpx.Response] = []
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:

            async def post(key: str | None, body: dict[str, Any] | bytes) -> httpx.Response:
                headers = {} if key is None else {"Idempotency-Key": key}
                if isinstance(body, bytes):
                    headers["content-type"] = "application/json"
                    return await c.post("/refunds", content=body, headers=headers)
                return await c.post("/refunds", json=body, headers=headers)

            answers.append(await post("a", {"amount": 1}))
            answers.append(await post("a", {"amount": 1}))  # replay
            answers.append(await post("a", {"amount": 2}))  # 422
            slow = asyncio.create_task(post("b", {"amount": 3, "slow": True}))
            await self.started.wait()
            answers.append(await post("b", {"amount": 3, "slow": True}))  # 409
            self.release.set()
            answers.append(await slow)
            answers.append(await post(None, {"amount": 4}))  # 400: required
            answers.append(await post("c", b'{"pad": "' + b"x" * 2048 + b'"}'))  # 413
        return [(a.status_code, a.content) for a in answers]


def _guard(mode: str | None) -> dict[str, Any]:
    policy = Policy(required=True, max_body_bytes=1024)
    guard: dict[str, Any] = {
        "store": MemoryStore(), "principal": ANONYMOUS, "policies": {"POST /refunds": policy},
    }  # fmt: skip
    if mode is not None:
        guard["mode"] = mode
    return guard


def _counts(app: Starlette) -> dict[Outcome, int]:
    stack: Any = app.middleware_stack
    while not isinstance(stack, IdempotencyMiddleware):
        stack = stack.app
    snapshot = stack.snapshot()
    return {outcome: snapshot.total(outcome) for outcome in Outcome if snapshot.total(outcome)}


async def test_report_mode_changes_no_answer_and_counts_what_enforcing_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="asgi_idempotency")
    plain, enforcing, reporting = Shop(None), Shop(_guard(None)), Shop(_guard("report"))
    plain_answers = await plain.traffic()
    enforced = await enforcing.traffic()
    reported = await reporting.traffic()

    assert reported == plain_answers  # every request ran, with the app's own answer
    assert [s for s, _ in enforced] == [201, 201, 422, 409, 201, 400, 413]
    assert reporting.runs == plain.runs == 7
    assert enforcing.runs == 2
    assert _counts(reporting.app) == _counts(enforcing.app)
    would = sorted(
        r.__dict__["would_answer"]
        for r in caplog.records
        if r.getMessage().startswith("idempotency.report")
    )
    assert would == [201, 400, 409, 413, 422]  # the replayed 201, and each refusal


async def test_report_mode_per_policy() -> None:
    guard = _guard(None)
    guard["policies"] = {"POST /refunds": Policy(required=True, max_body_bytes=1024, mode="report")}
    shop = Shop(guard)
    answers = await shop.traffic()
    assert [s for s, _ in answers] == [201] * 5 + [201, 201]
    assert shop.runs == 7


def test_mode_is_checked() -> None:
    with pytest.raises(ValueError, match="mode"):
        Policy(mode="audit")  # type: ignore[arg-type]
