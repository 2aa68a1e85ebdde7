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
import dataclasses
import hashlib
import hmac
import time
from collections.abc import Callable
from datetime import UTC, datetime

import httpx
import orjson
import pytest
import standardwebhooks
import stripe as stripe_sdk
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asgi_idempotency import MemoryStore, Policy
from asgi_idempotency.integrations.webhooks import (
    DeliveryKey,
    from_header,
    github,
    standard_webhooks,
    stripe,
)
from asgi_idempotency.stores.base import Store
from tests.apps import guarded

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

        self.app = guarded(
            MemoryStore(),
            [Route("/hooks", receive, methods=["POST"])],
            policies={"POST /hooks": Policy(key_from=key_from)},
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

    app = guarded(
        store,
        [
            Route("/a", receive, methods=["POST"]),
            Route("/b", receive, methods=["POST"]),
        ],
        policies={
            "POST /a": Policy(key_from=from_header("X-Delivery", sender="a")),
            "POST /b": Policy(key_from=from_header("X-Delivery", sender="b")),
        },
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


# The tests below sign with the senders' own libraries where there is one (the ``stripe``
# package's signature header, the ``standardwebhooks`` package's ``sign``) and with
# GitHub's documented HMAC where there is none.


def _stripe_signed(body: bytes, secret: str, at: int | None = None) -> dict[str, str]:
    header = stripe_sdk.WebhookSignature.generate_signature_header(
        body.decode(), secret, timestamp=at
    )
    return {"Stripe-Signature": header, "Content-Type": "application/json"}


def _standard_signed(body: bytes, msg_id: str, secret: str) -> dict[str, str]:
    now = datetime.now(UTC)
    signature = standardwebhooks.Webhook(secret).sign(msg_id, now, body)
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": signature,
        "Content-Type": "application/json",
    }


def _github_signed(body: bytes, delivery: str, secret: str) -> dict[str, str]:
    return {**_github(body, delivery, secret), "Content-Type": "application/json"}


class Endpoints:
    """One app, one store, a webhook route per ``{path: policy}``; records each run."""

    def __init__(self, policies: dict[str, Policy], store: Store | None = None) -> None:
        self.runs: list[tuple[str, bytes]] = []

        async def receive(request: Request) -> Response:
            self.runs.append((str(request.url.path), await request.body()))
            return JSONResponse({"received": len(self.runs)})

        self.app = guarded(
            store or MemoryStore(),
            [Route(path, receive, methods=["POST"]) for path in policies],
            policies={f"POST {path}": policy for path, policy in policies.items()},
        )

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://t")


async def test_github_keys_by_the_signed_body_not_the_unsigned_delivery_id() -> None:
    hooks = Endpoints({"/gh": Policy(key_from=github(SECRET))})
    d1, d2 = _event("push-1"), _event("push-2")
    async with hooks.client() as c:
        first = await c.post("/gh", content=d1, headers=_github_signed(d1, "D1", SECRET))
        # D1's genuine body and signature, re-sent under D2's delivery id (which no
        # signature covers): the same delivery, so it replays and runs nothing.
        repaired = await c.post("/gh", content=d1, headers=_github_signed(d1, "D2", SECRET))
        genuine = await c.post("/gh", content=d2, headers=_github_signed(d2, "D2", SECRET))
        redelivered = await c.post("/gh", content=d1, headers=_github_signed(d1, "D1", SECRET))
    assert first.status_code == 200
    assert repaired.status_code == 200
    assert repaired.headers["idempotent-replayed"] == "true"
    assert genuine.status_code == 200, genuine.text  # D2 was not taken by the forgery
    assert "idempotent-replayed" not in genuine.headers
    assert redelivered.headers["idempotent-replayed"] == "true"  # GitHub resends the body
    assert hooks.runs == [("/gh", d1), ("/gh", d2)]


async def test_a_standard_webhooks_id_is_signed_so_it_cannot_be_re_paired() -> None:
    secret = "whsec_" + base64.b64encode(b"endpoint-secret-for-repairing-32").decode()
    hooks = Endpoints({"/sw": Policy(key_from=standard_webhooks(secret))})
    m1, m2 = _event("msg_1"), _event("msg_2")
    async with hooks.client() as c:
        first = await c.post("/sw", content=m1, headers=_standard_signed(m1, "msg_1", secret))
        moved = {**_standard_signed(m1, "msg_1", secret), "webhook-id": "msg_2"}
        repaired = await c.post("/sw", content=m1, headers=moved)
        genuine = await c.post("/sw", content=m2, headers=_standard_signed(m2, "msg_2", secret))
    assert first.status_code == genuine.status_code == 200
    assert repaired.status_code == 400
    assert repaired.json()["type"] == "urn:asgi-idempotency:problem:invalid-signature"
    assert "idempotent-replayed" not in genuine.headers
    assert hooks.runs == [("/sw", m1), ("/sw", m2)]


SENDERS: dict[str, tuple[Callable[[str], DeliveryKey], Callable[[bytes, str, str], dict[str, str]]]]
SENDERS = {
    "stripe": (stripe, lambda body, _id, secret: _stripe_signed(body, secret)),
    "github": (github, _github_signed),
    "standard webhooks": (standard_webhooks, _standard_signed),
}


def _secret(name: str) -> str:
    return "whsec_" + base64.b64encode(f"endpoint {name} secret".ljust(32, ".").encode()).decode()


@pytest.mark.parametrize("sender", SENDERS.values(), ids=list(SENDERS))
async def test_one_event_delivered_to_two_endpoints_runs_once_at_each(
    sender: tuple[Callable[[str], DeliveryKey], Callable[[bytes, str, str], dict[str, str]]],
) -> None:
    make, sign = sender
    a, b = _secret("a"), _secret("b")
    hooks = Endpoints({"/hooks/a": Policy(key_from=make(a)), "/hooks/b": Policy(key_from=make(b))})
    body = _event("evt_shared")  # one event, one id: the sender sends it to each endpoint
    async with hooks.client() as c:
        to_a = await c.post("/hooks/a", content=body, headers=sign(body, "evt_shared", a))
        to_b = await c.post("/hooks/b", content=body, headers=sign(body, "evt_shared", b))
        again_a = await c.post("/hooks/a", content=body, headers=sign(body, "evt_shared", a))
        again_b = await c.post("/hooks/b", content=body, headers=sign(body, "evt_shared", b))
    assert to_a.status_code == to_b.status_code == 200, to_b.text
    assert "idempotent-replayed" not in to_b.headers
    assert again_a.headers["idempotent-replayed"] == "true"
    assert again_b.headers["idempotent-replayed"] == "true"
    assert hooks.runs == [("/hooks/a", body), ("/hooks/b", body)]


async def test_two_github_hooks_sharing_a_secret_at_one_path_are_two_endpoints() -> None:
    """GitHub lets one secret serve several hooks (a repository's and its organisation's,
    with the same payload); the URLs they were given differ only in the query."""
    hooks = Endpoints({"/gh": Policy(key_from=github(SECRET))})
    body = _event("push-shared")
    async with hooks.client() as c:
        repo = await c.post(
            "/gh?hook=repo", content=body, headers=_github_signed(body, "R", SECRET)
        )
        org = await c.post("/gh?hook=org", content=body, headers=_github_signed(body, "O", SECRET))
        again = await c.post(
            "/gh?hook=org", content=body, headers=_github_signed(body, "O", SECRET)
        )
    assert repo.status_code == org.status_code == 200, org.text
    assert "idempotent-replayed" not in org.headers
    assert again.headers["idempotent-replayed"] == "true"
    assert len(hooks.runs) == 2


async def test_rolling_an_endpoint_secret_keeps_its_deliveries() -> None:
    """Stripe's roll signs with the old and the new secret for a while, and the app moves
    to the new one: an event processed before the move, retried after it, replays."""
    store = MemoryStore()
    body = _event("evt_rolled")
    before = Endpoints({"/hooks": Policy(key_from=stripe(_secret("old")))}, store)
    after = Endpoints({"/hooks": Policy(key_from=stripe(_secret("new")))}, store)
    async with before.client() as c:
        first = await c.post("/hooks", content=body, headers=_stripe_signed(body, _secret("old")))
    async with after.client() as c:
        retry = await c.post("/hooks", content=body, headers=_stripe_signed(body, _secret("new")))
    assert first.status_code == 200
    assert retry.headers["idempotent-replayed"] == "true"
    assert len(before.runs) + len(after.runs) == 1


def _stripe_header(body: bytes) -> bytes:
    return _stripe_signed(body, SECRET)["Stripe-Signature"].encode()


@pytest.mark.parametrize(
    ("body", "header"),
    [
        # A real signature of one event, on a body that is that event with a byte that
        # is not UTF-8: forged, whatever the bytes.
        (b'{"id": "evt_5", "note": "\xff"}', _stripe_header(b'{"id": "evt_5", "note": ""}')),
        (b"\xff\xfe" * 32, None),
        (_event("evt_6"), _stripe_header(_event("evt_6"))[:-2] + b"\xe9\xe9"),
    ],
    ids=["body not utf-8", "body not utf-8, no header", "header not ascii"],
)
async def test_an_undecodable_stripe_delivery_is_the_documented_400(
    body: bytes, header: bytes | None
) -> None:
    hooks = Endpoints({"/hooks": Policy(key_from=stripe(SECRET))})
    headers = {b"content-type": b"application/json"}
    if header is not None:
        headers[b"stripe-signature"] = header
    async with hooks.client() as c:
        answer = await c.post("/hooks", content=body, headers=headers)
    assert answer.status_code == 400, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json()["type"] == "urn:asgi-idempotency:problem:invalid-signature"
    assert hooks.runs == []


def _sized(event_id: str, size: int) -> bytes:
    head = orjson.dumps({"id": event_id, "pad": ""})[:-2]
    return head + b"a" * (size - len(head) - 2) + b'"}'


async def test_a_github_delivery_up_to_its_documented_25_mb_is_received() -> None:
    hooks = Endpoints(
        {
            "/gh": Policy(key_from=github(SECRET)),
            "/gh-capped": Policy(key_from=github(SECRET), max_body_bytes=1024),
            "/stripe": Policy(key_from=stripe(SECRET)),
        }
    )
    large = _sized("push-large", 25_000_000)
    over = _sized("push-over", 25 * 1024 * 1024 + 1)
    two_mib = _sized("evt_2mib", 2 * 1024 * 1024)
    async with hooks.client() as c:
        received = await c.post("/gh", content=large, headers=_github_signed(large, "L", SECRET))
        refused = await c.post("/gh", content=over, headers=_github_signed(over, "O", SECRET))
        capped = await c.post(
            "/gh-capped", content=two_mib, headers=_github_signed(two_mib, "C", SECRET)
        )
        stripe_large = await c.post(
            "/stripe", content=two_mib, headers=_stripe_signed(two_mib, SECRET)
        )
    assert received.status_code == 200, received.text
    assert refused.status_code == capped.status_code == stripe_large.status_code == 413
    assert [path for path, _ in hooks.runs] == ["/gh"]


def test_a_webhook_route_s_body_limit_follows_its_sender_unless_set() -> None:
    mib = 1024 * 1024
    assert Policy().max_body_bytes == mib
    assert Policy(key_from=github(SECRET)).max_body_bytes == 25 * mib
    assert Policy(key_from=stripe(SECRET)).max_body_bytes == mib
    assert Policy(key_from=standard_webhooks(SW_SECRET)).max_body_bytes == mib
    assert Policy(key_from=github(SECRET), max_body_bytes=mib).max_body_bytes == mib
    # Derived again, not carried over, when the sender changes.
    unhooked = dataclasses.replace(Policy(key_from=github(SECRET)), key_from=None)
    assert unhooked.max_body_bytes == mib
    hooked = dataclasses.replace(Policy(), key_from=github(SECRET))
    assert hooked.max_body_bytes == 25 * mib


def test_no_two_endpoints_spell_the_same_principal() -> None:
    hook = github(SECRET)
    spellings = [
        {"method": "POST", "path": "/a?b", "query_string": b""},
        {"method": "POST", "path": "/a", "query_string": b"b"},
        {"method": "POST", "path": "/a b", "query_string": b""},
        {"method": "PUT", "path": "/a", "query_string": b""},
    ]
    principals = {hook.principal(scope) for scope in spellings}
    principals.add(github(SECRET, sender="github POST").principal({"method": "/a", "path": ""}))
    assert len(principals) == len(spellings) + 1
    assert hook.principal({"method": "POST", "path": "/hooks/github"}) == (
        "webhook:github POST /hooks/github"
    )
