"""Webhook receivers: the key names the delivery, and only what its signature covers.

``Policy(key_from=...)`` with one of these (``stripe``, ``github``,
``standard_webhooks``, ``from_header``) takes a route's key from the sender's own
delivery id, after checking the sender's signature: a forged delivery is a 400 before
any claim. Records are scoped by the sender and the endpoint, never by the
middleware's ``principal=``. Each sender's header, key and checks: docs/guide/usage.md.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Mapping
from typing import Any, Final
from urllib.parse import quote

import orjson

from asgi_idempotency._extras import missing_extra
from asgi_idempotency.core.errors import InvalidKey, InvalidSignature, MissingKey
from asgi_idempotency.http.asgi import Headers

__all__ = [
    "DeliveryKey",
    "from_body",
    "from_header",
    "github",
    "standard_webhooks",
    "stripe",
]


class DeliveryKey:
    """Where a route's key comes from instead of ``Idempotency-Key``, and its check.

    ``verify(headers, body)`` raises :class:`~.errors.InvalidSignature` for a delivery
    the sender did not sign; ``key(headers, body)`` names the delivery, from what the
    signature covers. ``max_body_bytes`` is the largest delivery the sender documents,
    the route's body limit unless its policy sets one (``None``: the policy's 1 MiB).
    """

    __slots__ = ("_key", "_verify", "max_body_bytes", "sender")

    def __init__(
        self,
        sender: str,
        key: Callable[[dict[str, str], bytes], str | None],
        verify: Callable[[dict[str, str], bytes], None] | None = None,
        *,
        max_body_bytes: int | None = None,
    ) -> None:
        if not sender:
            raise ValueError("a delivery key needs a sender name: ids are scoped per sender")
        if max_body_bytes is not None and max_body_bytes < 0:
            raise ValueError("max_body_bytes must be >= 0")
        self.sender = sender
        self.max_body_bytes = max_body_bytes
        self._key = key
        self._verify = verify

    def principal(self, scope: Mapping[str, Any]) -> str:
        """Whom the records of a delivery to this endpoint belong to: the sender and the
        endpoint, its method, path and query as the request names them.

        Stripe and Standard Webhooks senders deliver one event, under one id, to every
        endpoint subscribed to it, each endpoint with its own secret: each must run it
        once. The endpoint is the URL, not the route's template (one template can serve
        several URLs, e.g. ``/hooks/{tenant}``, and GitHub lets one secret be reused
        across hooks) and not the secret (rolling a secret would run again every
        delivery retried across the roll). Splitting is safe: a sender redelivers to
        the URL it delivered to. Path and sender are percent-encoded so no two
        endpoints spell the same principal.
        """
        path = quote(scope["path"], safe="/")
        query = scope.get("query_string", b"")
        where = f"{path}?{query.decode('latin-1')}" if query else path
        return f"webhook:{quote(self.sender, safe='')} {scope['method']} {where}"

    def __call__(self, headers: Headers, body: bytes) -> str:
        """The delivery's key, once its signature holds.

        Raises:
            InvalidSignature: the sender's signature is missing or does not match.
            MissingKey: the delivery names no id where the sender puts it.
        """
        named = {n.decode("latin-1").lower(): v.decode("latin-1") for n, v in headers}
        if self._verify is not None:
            self._verify(named, body)
        key = self._key(named, body)
        if not key:
            raise MissingKey(f"This {self.sender} delivery carries no delivery id.")
        if len(key) > 255 or not key.isprintable():
            raise InvalidKey(f"This {self.sender} delivery id is not a valid key.")
        return key

    def __repr__(self) -> str:
        return f"DeliveryKey(sender={self.sender!r})"

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


def from_header(name: str, *, sender: str) -> DeliveryKey:
    """The key is header ``name``, unverified: for a sender checked before the app, and
    a header that check covers (GitHub's ``X-GitHub-Delivery`` is not: use :func:`github`).
    """
    lowered = name.lower()
    return DeliveryKey(sender, lambda headers, _body: headers.get(lowered))


def from_body(key: Callable[[Any], str | None], *, sender: str) -> DeliveryKey:
    """The key is ``key(parsed JSON body)``, unverified: for a sender checked before the app."""

    def read(_headers: dict[str, str], body: bytes) -> str | None:
        try:
            return key(orjson.loads(body))
        except (orjson.JSONDecodeError, KeyError, TypeError, IndexError):
            return None

    return DeliveryKey(sender, read)


_BAD_SIGNATURE: Final = (
    "The {sender} signature on this delivery is missing or does not match: it was not "
    "processed. Check the endpoint's signing secret."
)


# "Payloads are capped at 25 MB" (GitHub's webhook docs); counted in MiB, the larger
# reading, so no delivery GitHub sends is refused.
_GITHUB_MAX_BODY: Final = 25 * 1024 * 1024


def github(secret: str, *, sender: str = "github") -> DeliveryKey:
    """GitHub: ``X-Hub-Signature-256`` is ``sha256=`` and the HMAC-SHA256 of the body
    under the webhook's secret (GitHub publishes no verification library).

    The key is ``sha256:`` and the hex SHA-256 of the body, what the signature covers:
    ``X-GitHub-Delivery`` is not signed, so a delivery's body and signature re-sent
    under another delivery id would otherwise run again, and take the genuine
    delivery's id from it. GitHub's redeliveries resend the same body, so they replay;
    two deliveries with byte-identical bodies are one delivery. The route's body limit
    defaults to GitHub's 25 MB.
    """
    key = secret.encode()

    def verify(headers: dict[str, str], body: bytes) -> None:
        sent = headers.get("x-hub-signature-256", "")
        expected = "sha256=" + hmac.new(key, body, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(sent.encode(), expected.encode()):
            raise InvalidSignature(_BAD_SIGNATURE.format(sender="GitHub"))

    def body_digest(_headers: dict[str, str], body: bytes) -> str:
        return "sha256:" + hashlib.sha256(body).hexdigest()

    return DeliveryKey(sender, body_digest, verify, max_body_bytes=_GITHUB_MAX_BODY)


def standard_webhooks(secret: str, *, sender: str = "webhooks") -> DeliveryKey:
    """A Standard Webhooks sender (Svix, OpenAI, Twilio Segment, ...): ``webhook-id``,
    ``webhook-timestamp`` and ``webhook-signature`` checked by the ``standardwebhooks``
    package (its timestamp tolerance included); the key is ``webhook-id``, which the
    signature covers (it signs ``{webhook-id}.{webhook-timestamp}.{body}``).

    Raises:
        ImportError: the ``webhooks`` extra is not installed.
    """
    try:
        from standardwebhooks.webhooks import Webhook, WebhookVerificationError
    except ImportError as exc:
        raise missing_extra(__name__, "standardwebhooks", "webhooks") from exc
    checker = Webhook(secret)

    def verify(headers: dict[str, str], body: bytes) -> None:
        try:
            checker.verify(body, headers, json_parse=False)
        except WebhookVerificationError:
            raise InvalidSignature(_BAD_SIGNATURE.format(sender="Standard Webhooks")) from None

    return DeliveryKey(sender, lambda headers, _body: headers.get("webhook-id"), verify)


def stripe(secret: str, *, tolerance: int = 300, sender: str = "stripe") -> DeliveryKey:
    """Stripe: ``Stripe-Signature`` checked by the ``stripe`` package, within ``tolerance``
    seconds of its timestamp; the key is the event's ``id`` (``evt_...``), inside the
    signed body, which Stripe keeps across its retries of one event.

    Raises:
        ImportError: the ``stripe`` extra is not installed.
    """
    try:
        import stripe as stripe_sdk
    except ImportError as exc:
        raise missing_extra(__name__, "stripe", "stripe") from exc

    def verify(headers: dict[str, str], body: bytes) -> None:
        header = headers.get("stripe-signature")
        # Stripe signs the body as UTF-8 text and its signatures are hex: a body that is
        # not UTF-8 or a header that is not ASCII was not signed by Stripe, and the
        # package would raise UnicodeDecodeError or TypeError on them, not its own error.
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidSignature(_BAD_SIGNATURE.format(sender="Stripe")) from None
        if header is not None and not header.isascii():
            raise InvalidSignature(_BAD_SIGNATURE.format(sender="Stripe"))
        try:
            stripe_sdk.WebhookSignature.verify_header(text, header, secret, tolerance)
        except stripe_sdk.SignatureVerificationError:
            raise InvalidSignature(_BAD_SIGNATURE.format(sender="Stripe")) from None

    def event_id(_headers: dict[str, str], body: bytes) -> str | None:
        try:
            found = orjson.loads(body).get("id")
        except (orjson.JSONDecodeError, AttributeError):
            return None
        return found if isinstance(found, str) else None

    return DeliveryKey(sender, event_id, verify)
