"""NATS JetStream consumers (nats-py): each message's effect once, however often delivered.

``JetStreamGuard(once, namespace=..., ack_wait=..., on_exhausted=...)`` wraps a handler
into an ``async (msg)`` callback (a push subscription's ``cb=``, or called on each
message a pull subscription fetches) that:

- keys the message by its ``Nats-Msg-Id`` header (the publisher's id, which JetStream
  also deduplicates publishes by), or by ``key(msg)``, e.g. :func:`stream_sequence`; a
  message with neither is refused (:class:`MissingMessageId`) and terminated;
- runs the handler through :class:`~asgi_idempotency.Once`, fingerprinted by the data,
  telling the server the message is in progress every third of ``ack_wait`` meanwhile
  (a slow handler is not redelivered to another consumer), and acknowledges once the
  call returns (its result, or a redelivery's replay);
- counts attempts by the delivery's ``num_delivered``; a handler that raises is
  ``nak``-ed until ``max_attempts``;
- gives a message it cannot run (its id used before with another body:
  :class:`KeyReused`; a handler that raises :class:`Undecodable`) or has given up on to
  the dead letter at once: ``on_exhausted(msg, error)``, called once (the hand-off runs
  through the same guard), then the message is acknowledged; without ``on_exhausted``,
  terminated (JetStream's ``MSG_TERMINATED`` advisory names it). Logged at ERROR and
  counted either way (:mod:`._brokers`);
- refuses at construction a lease not shorter than ``ack_wait``, and at startup
  (:meth:`JetStreamGuard.check`) a consumer whose server-side settings disagree.

Needs the ``nats`` extra (nats-py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import Any

from nats.aio.msg import Msg
from nats.js import JetStreamContext

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

__all__ = ["JetStreamGuard", "KeyReused", "MissingMessageId", "Undecodable", "stream_sequence"]

logger = logging.getLogger("asgi_idempotency.integrations.nats")

# ``async (msg) -> result``, or ``async (msg, *, session)`` when transactional.
Handler = Callable[..., Awaitable[Any]]
OnExhausted = Callable[[Msg, BaseException], Awaitable[Any]]


def stream_sequence(msg: Msg) -> str:
    """A key from the message's place in its stream (``stream:sequence``).

    The same on every redelivery of that stream message; a message published again
    (the publisher's own retry) has a new sequence, unless the stream deduplicated it
    by its ``Nats-Msg-Id``.
    """
    meta = msg.metadata
    return f"{meta.stream}:{meta.sequence.stream}"


class JetStreamGuard:
    """Wrap nats-py JetStream handlers so a message's effect happens once across redeliveries.

    Args:
        once: the :class:`~asgi_idempotency.Once` whose store keeps the records (shared
            by every consumer process). Its lease must be shorter than ``ack_wait``: a
            consumer that dies is redelivered after ``ack_wait``, and its claim must have
            lapsed by then.
        namespace: scopes the keys (the consumer's purpose, say ``"refunds"``); the
            hand-off's records are kept under ``namespace + ".exhausted"``.
        ack_wait: the JetStream consumer's ``ack_wait`` (:meth:`check` compares it with
            the server's).
        on_exhausted: ``async (msg, error)``, your dead letter, called once per message
            the guard cannot run or gives up on, with why: :class:`KeyReused` (its id
            was used before with another body), :class:`Undecodable` (raised by the
            handler: retrying cannot help), or the handler's error on its
            ``max_attempts``-th delivery. The message is acknowledged after it returns;
            if it raises, the message is ``nak``-ed and the hand-off tried again on the
            next delivery. ``None`` (the default): such a message is terminated
            (``AckTerm``: never redelivered; the server publishes a ``MSG_TERMINATED``
            advisory naming its stream sequence). Logged at ERROR and counted either way.
        max_attempts: deliveries a failing handler gets before the hand-off (default 5).
        key: ``msg -> str``, the key when it is not the ``Nats-Msg-Id`` header.
        nak_delay: seconds before a ``nak``-ed message is redelivered (default 1.0).
        transactional: the handler is ``async (msg, *, session)`` and writes its effect
            through ``session`` (an ``AsyncSession`` in the transaction that holds the
            claim), so the effect commits with the record: a consumer killed before that
            leaves nothing, and the redelivery runs it once, with no lease to wait out.
            Needs a store with transactions (``SQLStore`` on Postgres or MariaDB).

    Raises:
        ValueError: the lease is not shorter than ``ack_wait``; a bad ``max_attempts``
            or ``namespace``; ``transactional`` on a store without transactions.
    """

    def __init__(
        self,
        once: Once,
        *,
        namespace: str,
        ack_wait: timedelta,
        on_exhausted: OnExhausted | None = None,
        max_attempts: int = 5,
        key: Callable[[Msg], str] | None = None,
        nak_delay: float = 1.0,
        transactional: bool = False,
    ) -> None:
        check_lease(once.lease, ack_wait, "ack_wait")
        if transactional:
            once.require_transactions()
        self.transactional = transactional
        self.once = once
        self.namespace, self._exhausted_namespace = namespaced(namespace)
        self.ack_wait = ack_wait
        self.on_exhausted = on_exhausted
        self._dead = DeadLetter(
            once,
            self.namespace,
            on_exhausted,
            otherwise="terminated (JetStream's MSG_TERMINATED advisory names its stream sequence)",
        )
        self.max_attempts = check_attempts(max_attempts)
        self.key = key
        self.nak_delay = nak_delay
        self._fields = {"namespace": self.namespace}  # logged with every event

    async def check(self, js: JetStreamContext, stream: str, consumer: str) -> None:
        """At startup: refuse a consumer whose server-side settings the guard cannot serve.

        Raises:
            ValueError: the server's ``ack_wait`` (or its shortest ``backoff`` step) is
                not longer than the lease; ``max_deliver`` would stop redelivering
                before a message is exhausted and handed off.
        """
        config = (await js.consumer_info(stream, consumer)).config
        if config.ack_wait is not None:
            check_lease(self.once.lease, timedelta(seconds=config.ack_wait), "ack_wait")
        if config.backoff:
            check_lease(self.once.lease, timedelta(seconds=min(config.backoff)), "backoff")
        max_deliver = config.max_deliver
        if max_deliver is not None and 0 < max_deliver <= self.max_attempts:
            raise ValueError(
                f"consumer {consumer!r} has max_deliver={max_deliver}: the server stops "
                f"redelivering before the guard's max_attempts={self.max_attempts} are "
                "spent and the message handed off; set max_deliver=-1 or above max_attempts"
            )

    def __call__(self, handler: Handler) -> Callable[[Msg], Awaitable[None]]:
        """The message callback for ``handler`` (``async (msg) -> result``)."""

        # A redelivery that finds a holder waits for it (the delivery kept in progress
        # meanwhile): a dead holder's claim lapses within a lease and is taken over.
        run = guarded_run(self.once, self.namespace, handler, transactional=self.transactional)

        async def consume(msg: Msg) -> None:
            key = self.key(msg) if self.key is not None else (msg.headers or {}).get("Nats-Msg-Id")
            if not key:
                await msg.term()
                raise MissingMessageId(
                    f"a message on {self.namespace!r} has no Nats-Msg-Id header: have the "
                    "publisher set one (headers={'Nats-Msg-Id': ...}), or give key= "
                    "(stream_sequence, say)"
                )
            data = body_digest(msg.data)
            attempt = msg.metadata.num_delivered
            async with self._in_progress(msg):
                if attempt > self.max_attempts:
                    # Exhausted before, its termination lost: replay the hand-off.
                    error = AttemptsUnknown(f"delivery {attempt} of {self.max_attempts}")
                    await self._hand_off(key, data, msg, error)
                    return
                try:
                    await self._held(run, key, data, msg)
                except (InProgress, StoreError):
                    await msg.nak(delay=self.nak_delay)
                    return
                except Exception as exc:
                    refused = cannot_run(exc)  # the same on every delivery: no retry
                    if refused is not None:
                        await self._hand_off(key, data, msg, refused)
                    elif attempt < self.max_attempts:
                        await msg.nak(delay=self.nak_delay)
                    else:
                        await self._hand_off(key, data, msg, exc)
                    return
                await self._acknowledge(msg)

        return consume

    async def _held(self, run: Callable[..., Awaitable[Any]], key: str, data: str, msg: Msg) -> Any:
        """The guarded call; while another consumer holds the key, keep waiting (the
        delivery kept in progress), for a live holder renews its claim and a dead
        one's lapses within a lease."""
        while True:
            try:
                return await run(key, data, msg)
            except InProgress as exc:
                await pause_in_progress(exc, self.transactional)

    @contextlib.asynccontextmanager
    async def _in_progress(self, msg: Msg) -> AsyncIterator[None]:
        """Tell the server every third of ``ack_wait`` that ``msg`` is still being worked on."""

        async def ping() -> None:
            every = self.ack_wait.total_seconds() / 3
            while True:
                await asyncio.sleep(every)
                try:
                    await msg.in_progress()
                except Exception:  # the connection's errors: the server redelivers, we replay
                    logger.warning("idempotency.in_progress_lost", extra=self._fields)

        task = asyncio.ensure_future(ping())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _hand_off(self, key: str, data: str, msg: Msg, error: BaseException) -> None:
        try:
            handed = await self._dead.hand_off(key, data, msg, error)
        except Exception:  # logged by the dead letter: nak-ed, handed off next time
            await msg.nak(delay=self.nak_delay)
            return
        await self._acknowledge(msg, terminate=not handed)

    async def _acknowledge(self, msg: Msg, *, terminate: bool = False) -> None:
        """Acknowledge a message whose outcome is recorded (or, with nobody to hand it off
        to, terminate it).

        Either can be lost with the connection: the server redelivers after
        ``ack_wait``, and the redelivery replays.
        """
        try:
            await (msg.term() if terminate else msg.ack())
        except Exception:  # the connection's errors: the server redelivers, we replay
            logger.warning("idempotency.ack_lost", extra=self._fields)
