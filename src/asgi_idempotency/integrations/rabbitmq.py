"""RabbitMQ consumers (aio-pika): each message's effect once, however often it is delivered.

``RabbitMQGuard(once, namespace=..., on_exhausted=...)`` wraps a handler into an
aio-pika consume callback (``await queue.consume(guard(handle))``) that:

- keys the message by its ``message_id`` (the publisher's; the delivery tag changes on
  every redelivery), or by ``key(message)``; a message with neither is refused
  (:class:`MissingMessageId`), rejected without requeue (to the queue's dead-letter
  exchange, if it has one);
- runs the handler through :class:`~asgi_idempotency.Once`, fingerprinted by the body,
  to its end even if the broker closes the channel meanwhile (its consumer timeout),
  and acknowledges once the call returns (its result, or a redelivery's replay);
- counts attempts from ``x-delivery-count`` (quorum queues); a handler that raises is
  requeued until ``max_attempts``. A classic queue counts nothing: there a redelivery
  runs (or replays) as any, and is given up on if it raises (:class:`AttemptsUnknown`);
- gives a message it cannot run (its id used before with another body:
  :class:`KeyReused`; a handler that raises :class:`Undecodable`) or has given up on to
  the dead letter at once: ``on_exhausted(message, error)``, called once (the hand-off
  runs through the same guard), then the message is acknowledged; without
  ``on_exhausted``, rejected without requeue (to the queue's dead-letter exchange). Logged
  at ERROR and counted either way (:mod:`._brokers`);
- refuses at construction a lease not shorter than the broker's ``consumer_timeout``.

Needs the ``rabbitmq`` extra (aio-pika).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from aio_pika.abc import AbstractIncomingMessage

from asgi_idempotency.core.errors import (
    AttemptsUnknown,
    InProgress,
    KeyReused,
    MissingMessageId,
    StoreError,
    Undecodable,
)
from asgi_idempotency.functions.once import Once
from asgi_idempotency.integrations._brokers import (
    DeadLetter,
    body_digest,
    cannot_run,
    check_attempts,
    check_lease,
    guarded_run,
    namespaced,
    pause_in_progress,
)

__all__ = [
    "AttemptsUnknown",
    "KeyReused",
    "MissingMessageId",
    "RabbitMQGuard",
    "Undecodable",
    "delivery_attempt",
]

logger = logging.getLogger("asgi_idempotency.integrations.rabbitmq")

# ``async (message) -> result``, or ``async (message, *, session)`` when transactional.
Handler = Callable[..., Awaitable[Any]]
OnExhausted = Callable[[AbstractIncomingMessage, BaseException], Awaitable[Any]]

# RabbitMQ's own default (rabbitmq.conf ``consumer_timeout``): 30 minutes.
DEFAULT_CONSUMER_TIMEOUT = timedelta(minutes=30)


def delivery_attempt(message: AbstractIncomingMessage) -> int | None:
    """Which delivery of the message this is (1 for the first), or ``None`` if unknown.

    Quorum queues count returns in the ``x-delivery-count`` header (absent on the first
    delivery). A classic queue says only whether a delivery is a redelivery: a first
    delivery is 1, a redelivery there is ``None``.
    """
    count = (message.headers or {}).get("x-delivery-count")
    if isinstance(count, int) and not isinstance(count, bool):
        return count + 1
    return None if message.redelivered else 1


class RabbitMQGuard:
    """Wrap aio-pika handlers so a message's effect happens once across redeliveries.

    Args:
        once: the :class:`~asgi_idempotency.Once` whose store keeps the records (shared
            by every consumer process of the queue). Its lease must be shorter than
            ``consumer_timeout``.
        namespace: scopes the message ids (the queue's purpose, say ``"refunds"``); the
            hand-off's records are kept under ``namespace + ".exhausted"``.
        on_exhausted: ``async (message, error)``, your dead letter, called once per
            message the guard cannot run or gives up on, with why: :class:`KeyReused`
            (its id was used before with another body), :class:`Undecodable` (raised by
            the handler: retrying cannot help), the handler's error on its
            ``max_attempts``-th delivery, or :class:`AttemptsUnknown` (a failed
            redelivery a classic queue does not count). The message is acknowledged
            after it returns; if it raises, the message is requeued and the hand-off
            tried again on the next delivery. ``None`` (the default): such a message is
            rejected without requeue, to the queue's dead-letter exchange if it has one
            (else RabbitMQ drops it). Logged at ERROR and counted either way.
        max_attempts: deliveries a failing handler gets before the hand-off (default 5).
        consumer_timeout: the broker's ``consumer_timeout`` (default RabbitMQ's, 30
            minutes). A redelivery waits up to one lease for a holder before requeueing.
        key: ``message -> str``, the key when it is not the ``message_id``.
        requeue_delay: seconds to hold a message before requeueing it (a failed handler,
            a holder still running, a store outage), so a requeue is not a busy loop.
        transactional: the handler is ``async (message, *, session)`` and writes its
            effect through ``session`` (an ``AsyncSession`` in the transaction that holds
            the claim), so the effect commits with the record: a consumer killed before
            that leaves nothing, and the redelivery runs it once, with no lease to wait
            out. Needs a store with transactions (``SQLStore`` on Postgres or MariaDB).

    Raises:
        ValueError: the lease is not shorter than ``consumer_timeout``; a bad
            ``max_attempts`` or ``namespace``; ``transactional`` on a store without
            transactions.
    """

    def __init__(
        self,
        once: Once,
        *,
        namespace: str,
        on_exhausted: OnExhausted | None = None,
        max_attempts: int = 5,
        consumer_timeout: timedelta = DEFAULT_CONSUMER_TIMEOUT,
        key: Callable[[AbstractIncomingMessage], str] | None = None,
        requeue_delay: float = 1.0,
        transactional: bool = False,
    ) -> None:
        check_lease(once.lease, consumer_timeout, "consumer_timeout")
        if transactional:
            once.require_transactions()
        self.transactional = transactional
        self.once = once
        self.namespace, self._exhausted_namespace = namespaced(namespace)
        self.on_exhausted = on_exhausted
        self._dead = DeadLetter(
            once,
            self.namespace,
            on_exhausted,
            otherwise="rejected without requeue, to the queue's dead-letter exchange if it "
            "has one (else RabbitMQ drops it)",
        )
        self.max_attempts = check_attempts(max_attempts)
        self.consumer_timeout = consumer_timeout
        self.key = key
        self.requeue_delay = requeue_delay
        self._running: set[asyncio.Future[Any]] = set()

    def __call__(self, handler: Handler) -> Callable[[AbstractIncomingMessage], Awaitable[None]]:
        """The consume callback for ``handler`` (``async (message) -> result``)."""

        run = guarded_run(self.once, self.namespace, handler, transactional=self.transactional)

        async def consume(message: AbstractIncomingMessage) -> None:
            key = self.key(message) if self.key is not None else message.message_id
            if not key:
                await message.reject(requeue=False)
                raise MissingMessageId(
                    f"a message on {self.namespace!r} has no message_id: have the publisher "
                    "set one (it is the key that survives redelivery), or give key="
                )
            body = body_digest(message.body)
            attempt = delivery_attempt(message)
            if attempt is not None and attempt > self.max_attempts:
                # Exhausted before, its hand-off's acknowledgement lost: replay the hand-off.
                error: BaseException = AttemptsUnknown(f"delivery {attempt} of {self.max_attempts}")
                await self._hand_off(key, body, message, error)
                return
            try:
                await self._unto_the_end(self._held(run, key, body, message))
            except (InProgress, StoreError):
                # It did not run here: the holder is still at it, or the store failed.
                await asyncio.sleep(self.requeue_delay)
                await message.nack(requeue=True)
                return
            except Exception as exc:
                refused = cannot_run(exc)  # the same on every delivery: no retry
                if refused is not None:
                    await self._hand_off(key, body, message, refused)
                    return
                if attempt is not None and attempt < self.max_attempts:
                    await asyncio.sleep(self.requeue_delay)
                    await message.nack(requeue=True)
                    return
                if attempt is None:
                    # A classic queue's redelivery failed: how often it was delivered is
                    # unknown, so it is handed off rather than retried without a bound.
                    error = AttemptsUnknown(
                        f"a redelivered message on {self.namespace!r} failed and its queue "
                        "does not count deliveries (a classic queue): use a quorum queue"
                    )
                    error.__cause__ = exc
                    exc = error
                await self._hand_off(key, body, message, exc)
                return
            await self._acknowledge(message)

        return consume

    async def _held(
        self,
        run: Callable[..., Awaitable[Any]],
        key: str,
        body: str,
        message: AbstractIncomingMessage,
    ) -> Any:
        """The guarded call; while another consumer holds the key, wait with the message
        held rather than requeue it: quorum queues count each requeue as a delivery,
        and a slow holder would spend the message's attempts on nothing. Held for at
        most half the consumer timeout, then :class:`InProgress` (and a requeue)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + self.consumer_timeout.total_seconds() / 2
        while True:
            try:
                return await run(key, body, message)
            except InProgress as exc:
                if loop.time() + self.once.lease.total_seconds() >= until:
                    raise
                await pause_in_progress(exc, self.transactional)

    async def _unto_the_end(self, call: Awaitable[Any]) -> Any:
        """Await the guarded call, which runs to its end even if this delivery is cancelled.

        aio-pika cancels a consumer's callbacks when its channel closes, and the broker
        closes it when the consumer outlives ``consumer_timeout``: cancelled mid-effect,
        the call's claim would lapse after a lease and the redelivery would run it again.
        Left to finish, it records its result, and the redelivery replays it.
        """
        task = asyncio.ensure_future(call)
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._outlived)
            raise

    def _outlived(self, task: asyncio.Future[Any]) -> None:
        # Nobody awaits a call whose delivery was cancelled: its failure would go unseen.
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.warning(
                "idempotency.ack_lost",
                extra={"namespace": self.namespace, "error": type(exc).__name__},
            )

    async def _hand_off(
        self, key: str, body: str, message: AbstractIncomingMessage, error: BaseException
    ) -> None:
        try:
            handed = await self._dead.hand_off(key, body, message, error)
        except Exception:  # logged by the dead letter: requeued, handed off next time
            await asyncio.sleep(self.requeue_delay)
            await message.nack(requeue=True)
            return
        await self._acknowledge(message, reject=not handed)

    async def _acknowledge(self, message: AbstractIncomingMessage, *, reject: bool = False) -> None:
        """Acknowledge a message whose outcome is recorded (or, with nobody to hand it off
        to, reject it without requeue: to the queue's dead-letter exchange).

        An acknowledgement can be lost (the channel closed meanwhile, as the broker's
        consumer timeout closes it): the broker redelivers, and the redelivery replays.
        """
        try:
            await (message.reject(requeue=False) if reject else message.ack())
        except Exception:  # aiormq's channel and connection errors, whichever closed
            logger.warning("idempotency.ack_lost", extra={"namespace": self.namespace})
