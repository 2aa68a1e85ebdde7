"""Keys sent while the store's primary is killed and another promoted: the one scenario
the Postgres and the Redis failover tests share.

``KEYS`` keys start a few milliseconds apart, each retried until it gets a 2xx (every
answer kept); once ``KILL_AFTER`` of them have their 2xx, the primary is SIGKILLed, and
the promotion follows (the test's callables say how). Meanwhile a probe sends a fresh
key every few milliseconds from the moment of the promotion, to time the service's
return. Afterwards every key is sent once more and must replay its first 2xx byte for
byte. The app counts each key's handler runs (its effects) apart from the store.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta

import httpx
import orjson
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asgi_idempotency import IdempotencyMiddleware, Policy
from asgi_idempotency.http.principals import ANONYMOUS
from asgi_idempotency.stores.base import Store

KEYS = 40
KILL_AFTER = 12  # keys answered before the kill
SPACING = 0.02  # seconds between the keys' first sends: the later ones meet the gap
HANDLER_TIME = 0.1  # seconds each handler takes: some are running at the kill
RETRY_PAUSE = 0.05  # seconds before a key is sent again after a non-2xx
BACK_WITHIN = 15.0  # seconds after the promotion by which a fresh key must be served


@dataclass
class Answer:
    status: int
    body: bytes
    replayed: bool
    at: float  # time.monotonic() when it arrived


@dataclass
class Outcome:
    """What the run saw: every answer per key, the handlers' runs, the timeline."""

    answers: dict[str, list[Answer]] = field(default_factory=dict)
    runs: Counter[str] = field(default_factory=Counter)
    killed_at: float = 0.0
    promoted_at: float = 0.0
    back_at: float = 0.0  # the first fresh key served after the promotion
    probe_statuses: Counter[int] = field(default_factory=Counter)
    replays: dict[str, Answer] = field(default_factory=dict)
    replay_statuses: Counter[int] = field(default_factory=Counter)

    def first_success(self, key: str) -> Answer:
        return next(a for a in self.answers[key] if 200 <= a.status < 300)

    def statuses(self) -> Counter[int]:
        seen = Counter(a.status for answers in self.answers.values() for a in answers)
        return seen + self.probe_statuses + self.replay_statuses

    def summary(self) -> str:
        """One line for the log (``pytest -s``): what was seen and when."""
        before = sum(1 for k in self.answers if self.first_success(k).at < self.killed_at)
        return (
            f"statuses {dict(sorted(self.statuses().items()))}; {before} keys answered "
            f"before the kill; promoted {self.promoted_at - self.killed_at:.2f} s after it; "
            f"a fresh key served {self.back_at - self.promoted_at:.2f} s after the promotion"
        )

    def check(self) -> None:
        """The guarantees, each failure naming what broke."""
        assert len(self.answers) == KEYS
        seen = self.statuses()
        assert 500 not in seen, f"statuses seen: {seen}"
        assert set(seen) <= {200, 201, 409, 503}, f"statuses seen: {seen}"
        assert seen[503] > 0, f"the kill was never seen: {seen}"  # the gap happened
        ran = {key: self.runs[key] for key in self.answers}
        assert all(n == 1 for n in ran.values()), f"handler runs per key: {ran}"
        before = [k for k in self.answers if self.first_success(k).at < self.killed_at]
        assert len(before) >= KILL_AFTER
        for key in self.answers:
            first, replay = self.first_success(key), self.replays[key]
            what = (key, self.answers[key])
            assert (replay.status, replay.body) == (first.status, first.body), what
            assert replay.replayed, key
        back = self.back_at - self.promoted_at
        assert 0 < back < BACK_WITHIN, f"served again {back:.2f} s after the promotion"


def effect_app(store: Store, *, lease: float) -> tuple[Starlette, Counter[str]]:
    """``POST /effects`` guarded (key required); each run of the handler is counted per
    key, apart from the store (the effect a second run would repeat)."""
    runs: Counter[str] = Counter()

    async def effect(request: Request) -> Response:
        key = orjson.loads(await request.body())["key"]
        runs[key] += 1
        await asyncio.sleep(HANDLER_TIME)
        return JSONResponse({"key": key, "effect": uuid.uuid4().hex}, status_code=201)

    app = Starlette(
        routes=[Route("/effects", effect, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=store,
                principal=ANONYMOUS,
                policies={"POST /effects": Policy(required=True, lease=timedelta(seconds=lease))},
            )
        ],
    )
    return app, runs


async def _send(client: httpx.AsyncClient, key: str) -> Answer:
    r = await client.post("/effects", json={"key": key}, headers={"Idempotency-Key": key})
    replayed = r.headers.get("idempotent-replayed") == "true"
    return Answer(r.status_code, r.content, replayed, time.monotonic())


async def run_failover(
    app: Starlette,
    runs: Counter[str],
    *,
    kill: Callable[[], None],
    promote: Callable[[], Awaitable[float]],
    within: float = 60.0,
) -> Outcome:
    """The scenario above; ``kill`` SIGKILLs the primary, ``promote`` returns once another
    is promoted, with the ``time.monotonic()`` of the promotion. Bounded by ``within``
    seconds (a hang fails)."""
    out = Outcome(runs=runs)
    answered = asyncio.Event()
    done_before = 0
    promoted = asyncio.Event()

    async def one_key(client: httpx.AsyncClient, key: str) -> None:
        nonlocal done_before
        answers = out.answers.setdefault(key, [])
        while True:
            answer = await _send(client, key)
            answers.append(answer)
            if 200 <= answer.status < 300:
                done_before += 1
                if done_before >= KILL_AFTER:
                    answered.set()
                return
            await asyncio.sleep(RETRY_PAUSE)

    async def failover() -> None:
        await answered.wait()
        kill()
        out.killed_at = time.monotonic()
        out.promoted_at = await promote()
        promoted.set()

    async def probe(client: httpx.AsyncClient) -> None:
        await promoted.wait()
        while True:
            answer = await _send(client, f"probe-{uuid.uuid4().hex}")
            out.probe_statuses[answer.status] += 1
            if 200 <= answer.status < 300:
                out.back_at = answer.at
                return
            await asyncio.sleep(RETRY_PAUSE / 5)

    transport = httpx.ASGITransport(app=app)
    async with (
        asyncio.timeout(within),
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
    ):
        tasks = [asyncio.create_task(failover()), asyncio.create_task(probe(client))]
        for i in range(KEYS):
            tasks.append(asyncio.create_task(one_key(client, f"key-{i:02d}")))
            await asyncio.sleep(SPACING)
        await asyncio.gather(*tasks)
        # A completion that failed at the kill lands through its background retry (up to
        # 2 s apart): until then the key answers 409, as to any retry in flight.
        for key in out.answers:
            while True:
                answer = out.replays[key] = await _send(client, key)
                out.replay_statuses[answer.status] += 1
                if answer.status not in (409, 503):
                    break
                await asyncio.sleep(RETRY_PAUSE)
    return out
