"""What the broker presets share: the checks made before a consumer starts, the
message's fingerprint, and the dead letter. No broker package is imported here.

**The dead letter** (:class:`DeadLetter`) is where a message goes that a preset cannot
run (its id used before with another body, :class:`KeyReused`; a payload that does not
decode, :class:`Undecodable`) or has given up on (its attempts spent). It goes to exactly
one dead letter, never to none:

- ``on_exhausted`` given: called once per message, then the message is acknowledged.
  The call runs through the guard's :class:`Once`, under ``namespace + ".exhausted"``,
  keyed by the message's key and body digest, so a redelivery of a message already
  handed off (its acknowledgement lost) replays the hand-off rather than calling it
  again. If it raises, the message is requeued and handed off on its next delivery.
- none given: the broker's own. Each preset says which (RabbitMQ: rejected without
  requeue, to the queue's dead-letter exchange; JetStream: terminated; Celery: the task
  fails).

Either way it is logged at ERROR (``idempotency.dead_letter``: the namespace, the digests
of the key and the body, the reason, what was done; never the key or the body) and
counted under ``namespace + ".exhausted"`` (``executed``: handed off; ``replayed``: a
redelivery of one handed off; ``rejected``: given to the broker's dead letter).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from asgi_idempotency.core.canonical import CanonicalJSONError, canonical_json
from asgi_idempotency.core.errors import (
    AttemptsUnknown,
    InProgress,
    KeyReused,
    MissingMessageId,
    Undecodable,
)
from asgi_idempotency.functions.once import Once, record_key
from asgi_idempotency.observability.metrics import Outcome
from asgi_idempotency.observability.observer import Observer, route_to_server_log

__all__ = [
    "AttemptsUnknown",
    "DeadLetter",
    "MissingMessageId",
    "Undecodable",
    "arguments_digest",
    "body_digest",
    "cannot_run",
    "check_attempts",
    "check_lease",
]

logger = logging.getLogger("asgi_idempotency")
_events = Observer(None)  # its log only: the counts are the guard's Once's


def body_digest(body: bytes) -> str:
    """SHA-256 hex of the message body: a reused id with another body is a producer bug."""
    return hashlib.sha256(body).hexdigest()


def arguments_digest(args: list[Any], kwargs: dict[str, Any]) -> str:
    """SHA-256 hex of a task's arguments (canonical JSON), or ``"-"`` if they have none."""
    try:
        return hashlib.sha256(canonical_json([args, kwargs])).hexdigest()
    except CanonicalJSONError:
        return "-"


def cannot_run(exc: BaseException) -> BaseException | None:
    """The error to hand off at once if ``exc`` says the message can never run, else
    ``None`` (an error a retry may not meet again).

    :class:`KeyReused` (the runner: the id was used with another body) and
    :class:`Undecodable` (the handler) as they are; a :class:`CanonicalJSONError` (the
    runner: arguments it cannot fingerprint) as an :class:`Undecodable` caused by it.
    """
    if isinstance(exc, (KeyReused, Undecodable)):
        return exc
    if isinstance(exc, CanonicalJSONError):
        error = Undecodable(f"arguments with no canonical JSON form: {exc}")
        error.__cause__ = exc
        return error
    return None


def _reason(error: BaseException) -> str:
    if isinstance(error, KeyReused):
        return "key_reused"
    if isinstance(error, Undecodable):
        return "undecodable"
    if isinstance(error, AttemptsUnknown):
        return "attempts_unknown"
    return "exhausted"


class DeadLetter:
    """The hand-off of one preset's messages (see the module's docstring).

    Args:
        once: the preset's :class:`Once`.
        namespace: the preset's namespace (the hand-off's records: ``+ ".exhausted"``).
        on_exhausted: the user's hand-off, ``(message, error)``, async or not; ``None``:
            the broker's dead letter.
        otherwise: what the preset does with a message when ``on_exhausted`` is
            ``None`` (logged, for the operator who reads why it is gone).
        exclude: the hand-off's parameters left out of its fingerprint (the message and
            the error; the key and the body digest stay in).
    """

    def __init__(
        self,
        once: Once,
        namespace: str,
        on_exhausted: Callable[[Any, BaseException], Any] | None,
        *,
        otherwise: str,
        exclude: tuple[str, str] = ("message", "error"),
    ) -> None:
        self.once = once
        self.namespace = namespace
        self.exhausted_namespace = f"{namespace}.exhausted"
        self.on_exhausted = on_exhausted
        self.otherwise = otherwise
        # A consumer run as `python consumer.py` configures no logging: its dead letters
        # would be logged nowhere (the package's NullHandler), as the middleware's
        # errors would. Shown on stderr while nothing else would show them.
        route_to_server_log()
        guard = once(
            key=_first, namespace=self.exhausted_namespace, wait=once.lease, exclude=exclude
        )
        self._async = guard(self._call_async)
        self._sync = guard(self._call_sync)

    # The message and the error are excluded from the fingerprint by name.
    async def _call_async(self, key: str, body: str, message: Any, error: BaseException) -> Any:
        assert self.on_exhausted is not None
        return await self.on_exhausted(message, error)

    def _call_sync(self, key: str, body: str, message: Any, error: BaseException) -> Any:
        assert self.on_exhausted is not None
        return self.on_exhausted(message, error)

    async def hand_off(self, key: str, body: str, message: Any, error: BaseException) -> bool:
        """Hand ``message`` off once: ``True`` once ``on_exhausted`` has taken it (then
        acknowledge it), ``False`` if there is none (give it to the broker's dead letter).

        Raises:
            Exception: whatever ``on_exhausted`` raised (logged): requeue the message.
        """
        if self.on_exhausted is None:
            self._dropped(key, body, error)
            return False
        try:
            await self._async(_hand_off_key(key, body), body, message, error)
        except Exception:
            self._failed(key, body, error)
            raise
        self._log(key, body, error, "handed to on_exhausted, then acknowledged")
        return True

    def hand_off_sync(self, key: str, body: str, message: Any, error: BaseException) -> bool:
        """:meth:`hand_off` for a synchronous ``on_exhausted``, from a worker's thread."""
        if self.on_exhausted is None:
            self._dropped(key, body, error)
            return False
        try:
            self._sync(_hand_off_key(key, body), body, message, error)
        except Exception:
            self._failed(key, body, error)
            raise
        self._log(key, body, error, "handed to on_exhausted, then acknowledged")
        return True

    def _dropped(self, key: str, body: str, error: BaseException) -> None:
        self.once.count(self.exhausted_namespace, Outcome.REJECTED)
        self._log(key, body, error, f"no on_exhausted: {self.otherwise}")

    def _failed(self, key: str, body: str, error: BaseException) -> None:
        # With its traceback: the error is the user's on_exhausted's, theirs to read.
        event = "idempotency.hand_off_failed"
        fields = {
            "route": self.namespace,
            "key_digest": record_key(self.namespace, key)[:16],
            "body_digest": body[:16],
            "reason": _reason(error),
        }
        shown = " ".join(f"{name}={value}" for name, value in fields.items())
        logger.exception(
            "%s %s -- on_exhausted raised: the message is requeued and handed off on its "
            "next delivery",
            event, shown, extra={"event": event, **fields},
        )  # fmt: skip

    def _log(self, key: str, body: str, error: BaseException, done: str) -> None:
        _events.log(
            logging.ERROR,
            "idempotency.dead_letter",
            self.namespace,
            record_key(self.namespace, key),  # the digest Once's own errors name
            body_digest=body[:16],
            reason=_reason(error),
            error=type(error).__name__,
            hint=done,
        )


def _hand_off_key(key: str, body: str) -> str:
    # The body digest keeps apart the hand-offs of two bodies sent under one id (a reused
    # id): each is handed off once, and neither replays the other's.
    return f"{key}\x00{body}"


def guarded_run(
    once: Once, namespace: str, handler: Callable[..., Awaitable[Any]], *, transactional: bool
) -> Callable[..., Awaitable[Any]]:
    """A preset's guarded call, ``run(key, body_digest, message)``: ``handler(message)``
    once per key, fingerprinted by the body's digest (the message object is not).

    A redelivery that finds a holder waits for it up to one lease: a dead holder's claim
    lapses within it and is taken over. With ``transactional``, ``handler(message,
    session=...)`` writes through the transaction that holds the claim: its effect
    commits with the record, and a consumer killed before that leaves nothing, so the
    redelivery runs at once. A holder's claim is then an open transaction nobody can
    wait on: the call raises :class:`InProgress` at once, and the preset pauses before
    asking again (:func:`pause_in_progress`).
    """
    if transactional:

        async def deliver_in_transaction(key: str, body: str, message: Any, *, session: Any) -> Any:
            return await handler(message, session=session)

        return once(key=_first, namespace=namespace, exclude=("message",), transactional=True)(
            deliver_in_transaction
        )

    async def deliver(key: str, body: str, message: Any) -> Any:
        return await handler(message)

    return once(key=_first, namespace=namespace, wait=once.lease, exclude=("message",))(deliver)


async def pause_in_progress(exc: InProgress, transactional: bool) -> None:
    """Before asking again for a key another consumer holds: nothing in the default mode
    (the call itself waited for the holder), its ``retry_after`` in a transaction."""
    if transactional:
        await asyncio.sleep(min(exc.retry_after, 1.0))


def _first(key: str, *_: object, **__: object) -> str:
    return key


def check_lease(lease: timedelta, timeout: timedelta, what: str) -> None:
    """Refuse a lease the broker's own redelivery timer would outrun.

    A consumer that dies holding a claim leaves it in progress for up to one lease.
    The broker redelivers after ``timeout``: with a lease as long, the redelivery finds
    the dead holder's claim still live and cannot run it, and each redelivery spends
    an attempt of the message's budget on nothing.
    """
    if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
        raise ValueError(f"{what} must be a positive timedelta, got {timeout!r}")
    if lease >= timeout:
        raise ValueError(
            f"the guard's lease ({lease.total_seconds():g} s) must be shorter than the "
            f"broker's {what} ({timeout.total_seconds():g} s): a redelivery after a "
            "consumer died would find the dead consumer's claim still held. Give Once a "
            "shorter lease= (it is renewed while the handler runs)."
        )


def check_attempts(max_attempts: int) -> int:
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
        raise ValueError(f"max_attempts must be an int >= 1, got {max_attempts!r}")
    return max_attempts


def namespaced(namespace: str) -> tuple[str, str]:
    """The handler's namespace and its hand-off's (a record of their own each)."""
    if not isinstance(namespace, str) or not namespace or namespace.startswith("/"):
        raise ValueError(f"namespace must be a non-empty str not starting with '/': {namespace!r}")
    return namespace, f"{namespace}.exhausted"
