"""Webhook receivers: the key is the sender's delivery id, trusted only once its signature is.

A webhook sender (Stripe, GitHub, any Standard Webhooks sender) delivers at least once
and names each delivery in its own header or body, not in ``Idempotency-Key``. Give a
route ``Policy(key_from=...)`` with one of these and the guard takes the key from the
delivery, after checking the sender's signature: a forged delivery carrying a real
delivery id is answered 400 before any claim, so it can neither run the handler nor
take the id from the real delivery. A replay answers the stored 2xx, so the sender
stops retrying; a 5xx releases, so its next attempt runs.

Delivery ids are scoped per sender (``sender`` is the records' principal), never by
the middleware's ``principal=``.

================================  ===========================================
``stripe(secret)``                ``Stripe-Signature`` checked by the ``stripe``
                                  package (timestamp tolerance); key: the event id
``github(secret)``                ``X-Hub-Signature-256`` (HMAC-SHA256, as GitHub
                                  documents; no official library); key:
                                  ``X-GitHub-Delivery``
``standard_webhooks(secret)``     ``webhook-signature`` checked by the
                                  ``standardwebhooks`` package; key: ``webhook-id``
``from_header(name, sender=...)`` a header, for a sender verified before the app
================================  ===========================================
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from typing import Any, Final

import orjson

from ._extras import missing_extra
from .asgi import Headers
from .errors import InvalidKey, InvalidSignature, MissingKey

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
    the sender did not sign; ``key(headers, body)`` names the delivery.
    """

    __slots__ = ("_key", "_verify", "sender")

    def __init__(
        self,
        sender: str,
        key: Callable[[dict[str, str], bytes], str | None],
        verify: Callable[[dict[str, str], bytes], None] | None = None,
    ) -> None:
        if not sender:
            raise ValueError("a delivery key needs a sender name: ids are scoped per sender")
        self.sender = sender
        self._key = key
        self._verify = verify

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
    """The key is header ``name``, unverified: for a sender checked before the app."""
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


def github(secret: str, *, sender: str = "github") -> DeliveryKey:
    """GitHub: ``X-Hub-Signature-256`` is ``sha256=`` and the HMAC-SHA256 of the body
    under the webhook's secret (GitHub publishes no verification library); the key is
    ``X-GitHub-Delivery``."""
    key = secret.encode()

    def verify(headers: dict[str, str], body: bytes) -> None:
        sent = headers.get("x-hub-signature-256", "")
        expected = "sha256=" + hmac.new(key, body, hashlib.sha256).hexdigest()
        if not hmac.compare_digest(sent.encode(), expected.encode()):
            raise InvalidSignature(_BAD_SIGNATURE.format(sender="GitHub"))

    return DeliveryKey(sender, lambda headers, _body: headers.get("x-github-delivery"), verify)


def standard_webhooks(secret: str, *, sender: str = "webhooks") -> DeliveryKey:
    """A Standard Webhooks sender (Svix, OpenAI, Twilio Segment, ...): ``webhook-id``,
    ``webhook-timestamp`` and ``webhook-signature`` checked by the ``standardwebhooks``
    package (its timestamp tolerance included); the key is ``webhook-id``.

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
    seconds of its timestamp; the key is the event's ``id`` (``evt_...``), which Stripe
    keeps across its retries of one event.

    Raises:
        ImportError: the ``stripe`` extra is not installed.
    """
    try:
        import stripe as stripe_sdk
    except ImportError as exc:
        raise missing_extra(__name__, "stripe", "stripe") from exc

    def verify(headers: dict[str, str], body: bytes) -> None:
        try:
            stripe_sdk.WebhookSignature.verify_header(
                body, headers.get("stripe-signature"), secret, tolerance
            )
        except stripe_sdk.SignatureVerificationError:
            raise InvalidSignature(_BAD_SIGNATURE.format(sender="Stripe")) from None

    def event_id(_headers: dict[str, str], body: bytes) -> str | None:
        try:
            found = orjson.loads(body).get("id")
        except (orjson.JSONDecodeError, AttributeError):
            return None
        return found if isinstance(found, str) else None

    return DeliveryKey(sender, event_id, verify)
