"""Celery tasks: each task's effect once, however often its message is delivered.

``CeleryGuard(once, app, on_exhausted=...)``, then ``@guard.task(name=...)`` in place of
``@app.task``: the task is made with ``acks_late=True`` and ``reject_on_worker_lost=True``
(a worker that dies mid-task has its message redelivered, not lost), and its body

- runs through :class:`~asgi_idempotency.Once`, keyed by the task id (the same on every
  redelivery and every ``retry``), fingerprinted by its arguments;
- is retried (``task.retry``, counted by ``request.retries``) when it raises, until
  ``max_retries``;
- is given up on at once when it cannot run (the task id used before with other
  arguments: :class:`KeyReused`; arguments with no canonical JSON form, or a body that
  raises :class:`Undecodable`) or after its last retry: handed to ``on_exhausted`` (once:
  the hand-off runs through the same guard), then the task fails with that error
  (FAILURE in the result backend; the message acknowledged, as Celery acknowledges a
  failed ``acks_late`` task), except that a reused id's task is ignored (acknowledged,
  the first call's result left in place). Without ``on_exhausted``, the same, with no
  hand-off. Logged at ERROR and counted either way (:mod:`._brokers`);
- is refused at construction a lease not shorter than the broker's acknowledgement
  timeout (RabbitMQ's ``consumer_timeout``, or Redis and SQS's ``visibility_timeout``).

Needs the ``celery`` extra.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from celery import Celery, Task
from celery.exceptions import Ignore, Reject

from asgi_idempotency.core.errors import (
    InProgress,
    KeyReused,
    MissingMessageId,
    StoreError,
    Undecodable,
)
from asgi_idempotency.functions.once import Once
from asgi_idempotency.integrations._brokers import (
    DeadLetter,
    arguments_digest,
    cannot_run,
    check_lease,
    namespaced,
)

__all__ = ["CeleryGuard", "KeyReused", "Undecodable", "ack_timeout"]

OnExhausted = Callable[[Task[Any, Any], BaseException], object]

# The brokers' own defaults: RabbitMQ's consumer_timeout, Celery's visibility_timeout.
RABBITMQ_CONSUMER_TIMEOUT = timedelta(minutes=30)
VISIBILITY_TIMEOUT = timedelta(hours=1)
_AMQP = frozenset({"amqp", "amqps", "pyamqp", "librabbitmq"})
_VISIBILITY = frozenset({"redis", "rediss", "sentinel", "sqs"})


def ack_timeout(app: Celery, consumer_timeout: timedelta | None = None) -> timedelta:
    """How long the app's broker waits for a task's acknowledgement before redelivering.

    RabbitMQ (``amqp://``): ``consumer_timeout`` as given, else RabbitMQ's default (30
    minutes). Redis and SQS: ``broker_transport_options["visibility_timeout"]`` (seconds),
    else Celery's default (1 hour).

    Raises:
        ValueError: another broker, whose timeout the guard cannot know.
    """
    scheme = urlsplit(str(app.conf.broker_url or "amqp://")).scheme.split("+")[0]
    if scheme in _AMQP:
        return consumer_timeout or RABBITMQ_CONSUMER_TIMEOUT
    if scheme in _VISIBILITY:
        options = app.conf.broker_transport_options or {}
        seconds = options.get("visibility_timeout")
        return VISIBILITY_TIMEOUT if seconds is None else timedelta(seconds=float(seconds))
    raise ValueError(
        f"cannot tell the acknowledgement timeout of a {scheme!r} broker: "
        "supported are amqp (RabbitMQ), redis and sqs"
    )


class CeleryGuard:
    """Make Celery tasks whose bodies run once per task id across redeliveries and retries.

    Args:
        once: the :class:`~asgi_idempotency.Once` whose store keeps the records (shared
            by every worker). Its lease must be shorter than the broker's
            acknowledgement timeout (:func:`ack_timeout`). A worker calls it from its
            task threads (sync calls): give it a store instance of its own.
        app: the Celery app the tasks belong to.
        on_exhausted: ``(task, error)``, your dead letter (``task.request`` holds its id
            and arguments), called once per task the guard cannot run or gives up on,
            with why: :class:`KeyReused` (its id was used before with other arguments),
            :class:`Undecodable` (arguments with no canonical JSON form, or raised by
            the body: retrying cannot help), or the body's error on its last retry.
            Then the task fails with that error (FAILURE; the message acknowledged) or,
            for a reused id, is ignored (acknowledged; the first call's result kept);
            if it raises, the message is requeued and the hand-off tried again.
            ``None`` (the default): the same, with no hand-off. Logged at ERROR and
            counted either way.
        consumer_timeout: RabbitMQ's ``consumer_timeout``, if not its default.
        retry_delay: seconds before a retry, and before a message whose key another
            worker holds (or whose store failed) is requeued (default 1.0).

    Raises:
        ValueError: the lease is not shorter than the broker's acknowledgement timeout;
            a broker whose timeout cannot be told.
    """

    def __init__(
        self,
        once: Once,
        app: Celery,
        *,
        on_exhausted: OnExhausted | None = None,
        consumer_timeout: timedelta | None = None,
        retry_delay: float = 1.0,
    ) -> None:
        self.timeout = ack_timeout(app, consumer_timeout)
        check_lease(once.lease, self.timeout, "acknowledgement timeout")
        self.once = once
        self.app = app
        self.on_exhausted = on_exhausted
        self.retry_delay = retry_delay

    def task(
        self, *, name: str, max_retries: int | None = 3
    ) -> Callable[[Callable[..., Any]], Task[Any, Any]]:
        """``@app.task`` for a body run once per task id.

        ``name`` is required: it scopes the keys, and must not change while messages of
        the task are queued. ``max_retries`` as Celery's (``None``: no limit, and no
        hand-off). Route the task with the app's ``task_routes``.
        """
        namespace, _ = namespaced(name)

        def decorate(fn: Callable[..., Any]) -> Task[Any, Any]:
            def body(task_id: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
                return fn(*args, **kwargs)

            run = self.once(key=_first, namespace=namespace, wait=self.once.lease)(body)
            dead = DeadLetter(
                self.once,
                namespace,
                self.on_exhausted,
                otherwise="the task fails (FAILURE; a reused id's is ignored, the first "
                "call's result kept), its message acknowledged",
            )

            def guarded(task: Task[Any, Any], *args: Any, **kwargs: Any) -> Any:
                task_id = task.request.id
                if not task_id:
                    raise MissingMessageId(f"task {name!r} was called without a task id")
                try:
                    return self._held(run, task_id, list(args), dict(kwargs))
                except (InProgress, StoreError) as exc:
                    time.sleep(self.retry_delay)
                    raise Reject(exc, requeue=True) from exc
                except Exception as exc:
                    error = cannot_run(exc)  # the same on every delivery: no retry
                    if error is None:
                        limit = task.max_retries  # None: no limit, as Celery's own
                        if limit is None or task.request.retries < limit:
                            raise task.retry(exc=exc, countdown=self.retry_delay) from exc
                        error = exc
                    digest = arguments_digest(list(args), dict(kwargs))
                    try:
                        dead.hand_off_sync(task_id, digest, task, error)
                    except Exception as failed:  # logged: requeued, handed off next time
                        time.sleep(self.retry_delay)
                        raise Reject(failed, requeue=True) from failed
                    if isinstance(error, KeyReused):
                        # Acknowledged, its state left alone: the id's result is the
                        # first call's, and a FAILURE would overwrite it.
                        raise Ignore() from exc
                    # The task fails with the error: Celery records the FAILURE (a
                    # caller's result.get() raises it) and acknowledges the message.
                    if error is exc:
                        raise
                    raise error from exc

            guarded.__name__ = getattr(fn, "__name__", name)
            guarded.__qualname__ = getattr(fn, "__qualname__", name)
            guarded.__module__ = fn.__module__
            guarded.__doc__ = fn.__doc__
            return self.app.task(
                name=name,
                bind=True,
                acks_late=True,
                reject_on_worker_lost=True,
                max_retries=max_retries,
            )(guarded)

        return decorate

    def _held(
        self,
        run: Callable[[str, list[Any], dict[str, Any]], Any],
        task_id: str,
        args: list[Any],
        kwargs: dict[str, Any],
    ) -> Any:
        """The guarded body; while another worker holds the key (a redelivery while the
        first still runs), wait with the message held, up to half the acknowledgement
        timeout, then :class:`InProgress` (and a requeue)."""
        until = time.monotonic() + self.timeout.total_seconds() / 2
        while True:
            try:
                return run(task_id, args, kwargs)
            except InProgress:
                if time.monotonic() + self.once.lease.total_seconds() >= until:
                    raise


def _first(key: str, *_: object, **__: object) -> str:
    return key
