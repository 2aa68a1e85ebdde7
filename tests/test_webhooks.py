"""Webhook receivers: the key is the sender's delivery id, trusted once its signature is.

Signatures are computed here the way each provider documents them (Stripe's
``t=...,v1=...`` over ``"{t}.{payload}"``, GitHub's ``sha256=`` HMAC of the body,
Standard Webhooks' ``v1,`` base64 HMAC over ``"{id}.{timestamp}.{body}"`` under the
base64 secret), so the presets are checked against the protocol, not against
themselves: a forged delivery is refused and stores nothing, a redelivery replays,
and a 500 lets the next delivery run.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Callable

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asgi_idempotency import IdempotencyMiddleware, MemoryStore, Policy
from asgi_idempotency.principals import ANONYMOUS
from asgi_idempotency.webhooks import DeliveryKey, from_header, github, standard_webhooks, stripe

pytestmark = pytest.mark.anyio

SECRET = "whsec_test_secret_0123456789"
SW_KEY = b"standard-webhooks-test-key-32byt"
SW_SECRET = "whsec_" + base64.b64encode(SW_KEY).decode()


def _stripe(body: bytes, secret: str = SECRET, at: int | None = None) -> dict[str, str]:
    t = int(time.time()) if at is None else at
    mac = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return {"Stripe-Signature": f"t={t},v1={mac}", "Content-Type": "application/json"}


def _github(body: bytes, delivery: str, secret: str = SECRET) -> dict[str, str]:
    mac = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return {"X-Hub-Signature-256": f"sha256={mac}", "X-GitHub-Delivery": delivery}


def _standard(body: bytes, msg_id: str, key: bytes = SW_KEY) -> dict[str, str]:
    ts = str(int(time.time()))
    mac = hmac.new(key, f"{msg_id}.{ts}.".encode() + body, hashlib.sha256).digest()
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": ts,
        "webhook-signature": "v1," + base64.b64encode(mac).decode(),
    }


class Receiver:
    def __init__(self, key_from: DeliveryKey) -> None:
        self.runs: list[bytes] = []
        self.fail_next = False

        async def receive(request: Request) -> Response:
            self.runs.append(await request.body())
            if self.fail_next:
                self.fail_next = False
                return JSONResponse({"error": "db down"}, status_code=500)
            return JSONResponse({"received": len(self.runs)})

        self.app = Starlette(
            routes=[Route("/hooks", receive, methods=["POST"])],
            middleware=[
                Middleware(
                    IdempotencyMiddleware,
                    store=MemoryStore(),
                    principal=ANONYMOUS,
                    policies={"POST /hooks": Policy(key_from=key_from)},
                )
            ],
        )

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://t")


Sign = Callable[[bytes, str, bool], dict[str, str]]


def _sign_stripe(body: bytes, _id: str, forged: bool) -> dict[str, str]:
    return _stripe(body, secret="whsec_forger" if forged else SECRET)


def _sign_github(body: bytes, delivery: str, forged: bool) -> dict[str, str]:
    return _github(body, delivery, secret="forger" if forged else SECRET)


def _sign_standard(body: bytes, msg_id: str, forged: bool) -> dict[str, str]:
    return _standard(body, msg_id, key=b"forger-key-forger-key-forger-key" if forged else SW_KEY)


PRESETS: dict[str, tuple[Callable[[], DeliveryKey], Sign]] = {
    "stripe": (lambda: stripe(SECRET), _sign_stripe),
    "github": (lambda: github(SECRET), _sign_github),
    "standard webhooks": (lambda: standard_webhooks(SW_SECRET), _sign_standard),
}


def _event(event_id: str, amount: int = 4500) -> bytes:
    return orjson.dumps({"id": event_id, "type": "charge.refunded", "amount": amount})


@pytest.mark.parametrize("preset", PRESETS.values(), ids=list(PRESETS))
async def test_a_forged_delivery_is_refused_and_poisons_nothing(
    preset: tuple[Callable[[], DeliveryKey], Sign],
) -> None:
    make, sign = preset
    hook = Receiver(make())
    body = _event("evt_1")
    async with hook.client() as c:
        forged = await c.post("/hooks", content=body, headers=sign(body, "evt_1", True))
        assert forged.status_code == 400
        assert forged.json()["type"] == "urn:asgi-idempotency:problem:invalid-signature"
        real = await c.post("/hooks", content=body, headers=sign(body, "evt_1", False))
        assert real.status_code == 200, real.text  # the id was not taken by the forgery
        assert "idempotent-replayed" not in real.headers
        again = await c.post("/hooks", content=body, headers=sign(body, "evt_1", False))
        assert again.headers["idempotent-replayed"] == "true"  # the sender stops retrying
    assert hook.runs == [body]


@pytest.mark.parametrize("preset", PRESETS.values(), ids=list(PRESETS))
async def test_a_500_lets_the_next_delivery_run(
    preset: tuple[Callable[[], DeliveryKey], Sign],
) -> None:
    make, sign = preset
    hook = Receiver(make())
    hook.fail_next = True
    body = _event("evt_2")
    async with hook.client() as c:
        first = await c.post("/hooks", content=body, headers=sign(body, "evt_2", False))
        second = await c.post("/hooks", content=body, headers=sign(body, "evt_2", False))
    assert first.status_code == 500
    assert second.status_code == 200
    assert "idempotent-replayed" not in second.headers
    assert len(hook.runs) == 2


async def test_stripe_refuses_a_stale_timestamp_and_keys_by_event_id() -> None:
    hook = Receiver(stripe(SECRET, tolerance=300))
    body = _event("evt_3")
    async with hook.client() as c:
        stale = await c.post(
            "/hooks", content=body, headers=_stripe(body, at=int(time.time()) - 900)
        )
        assert stale.status_code == 400
        fresh = await c.post("/hooks", content=body, headers=_stripe(body))
        # Stripe re-signs each retry of one event with a new timestamp: still a replay.
        retry = await c.post("/hooks", content=body, headers=_stripe(body, at=int(time.time()) - 5))
        other = _event("evt_4")
        second_event = await c.post("/hooks", content=other, headers=_stripe(other))
    assert fresh.status_code == 200
    assert retry.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in second_event.headers
    assert len(hook.runs) == 2


async def test_delivery_ids_are_scoped_per_sender() -> None:
    store = MemoryStore()
    runs: list[str] = []

    async def receive(request: Request) -> Response:
        runs.append(request.url.path)
        return JSONResponse({"ok": True})

    app = Starlette(
        routes=[
            Route("/a", receive, methods=["POST"]),
            Route("/b", receive, methods=["POST"]),
        ],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=store,
                principal=ANONYMOUS,
                policies={
                    "POST /a": Policy(key_from=from_header("X-Delivery", sender="a")),
                    "POST /b": Policy(key_from=from_header("X-Delivery", sender="b")),
                },
            )
        ],
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        a = await c.post("/a", json={}, headers={"X-Delivery": "d-1"})
        b = await c.post("/b", json={}, headers={"X-Delivery": "d-1"})
        missing = await c.post("/a", json={})
    assert "idempotent-replayed" not in b.headers
    assert a.status_code == b.status_code == 200
    assert missing.status_code == 400
    assert runs == ["/a", "/b"]
