"""An outbound ledger for calling services that have no idempotency support.

:class:`OutboundLedger` keeps one row per logical call, keyed by the same derived key,
in a table of its own: claim, call, then record the result; an ambiguous failure is
settled by the caller's ``read_back()``, which narrows the window of a duplicate but
cannot close it. SQLAlchemy Core on an async engine the caller owns
(``postgresql+asyncpg`` or ``sqlite+aiosqlite``). Importing this module needs
sqlalchemy; importing :mod:`asgi_idempotency.client` does not. Details: docs/client.md.
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Final, Protocol

from asgi_idempotency._extras import missing_extra

try:
    import anyio
    import httpx
    import stamina
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise missing_extra(__name__, "httpx, stamina and anyio", "client") from exc
# sqlalchemy is a dependency of the package itself, not of an extra.
from sqlalchemy import (
    CheckConstraint,
    Column,
    DateTime,
    LargeBinary,
    MetaData,
    String,
    Table,
    insert,
    select,
    update,
)
from sqlalchemy import delete as sql_delete
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from asgi_idempotency.client.retry import (
    AttemptRecord,
    Decision,
    RetryPolicy,
    _AttemptLog,
    retryable,
)

__all__ = [
    "LedgerConflict",
    "LedgerEntry",
    "LedgerError",
    "LedgerStatus",
    "OutboundCall",
    "OutboundLedger",
    "OutcomeUnknown",
    "ReadBack",
    "ledger_metadata",
    "ledger_table",
]


class LedgerStatus(StrEnum):
    """State of one outbound call in the ledger."""

    PENDING = "pending"  # claimed; the call is running (or its worker died mid-call)
    SUCCEEDED = "succeeded"  # the effect happened; ``result`` holds what came back
    FAILED = "failed"  # the service refused or never got it; safe to call again
    UNKNOWN = "unknown"  # may or may not have happened; read-back could not tell


#: The ledger's own MetaData, separate from the server's tables.
ledger_metadata: Final = MetaData()

#: One row per outbound call. ``key`` is the derived key (at most 255 characters).
ledger_table: Final = Table(
    "idempotency_outbound_ledger",
    ledger_metadata,
    Column("key", String(255), primary_key=True),
    Column("status", String(16), nullable=False),
    Column("result", LargeBinary, nullable=True),
    # timezone=True keeps UTC offsets on PostgreSQL; SQLite stores naive UTC and
    # _entry() puts the zone back.
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
    CheckConstraint(
        "status IN ('pending', 'succeeded', 'failed', 'unknown')",
        name="ck_idempotency_outbound_ledger_status",
    ),
)

_t: Final = ledger_table.c


class OutboundCall(Protocol):
    """The call to protect; returns the bytes to record (e.g. the response body)."""

    def __call__(self) -> Awaitable[bytes]: ...


class ReadBack(Protocol):
    """Looks for the call's effect at the service; the recorded result, or ``None``.

    Example: list the refunds of this order created in the last five minutes and
    return the matching one's JSON. It must not have side effects.
    """

    def __call__(self) -> Awaitable[bytes | None]: ...


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One ledger row. Times are timezone-aware UTC."""

    key: str
    status: LedgerStatus
    result: bytes | None
    created_at: datetime
    updated_at: datetime


class LedgerError(Exception):
    """Base of the ledger's errors; also raised, chained, when the database fails."""


class LedgerConflict(LedgerError):
    """Another run owns this key, or its outcome is unknown.

    Attributes:
        entry: The row as it was read: ``pending`` (a worker is calling now, or
            died while calling) or ``unknown`` (read-back found nothing). Resolve an
            old one by checking the service, then :meth:`OutboundLedger.forget`.
    """

    def __init__(self, entry: LedgerEntry) -> None:
        self.entry = entry
        super().__init__(
            f"outbound call {entry.key!r} is {entry.status.value} "
            f"(since {entry.updated_at.isoformat()}); not calling again"
        )


class OutcomeUnknown(LedgerError):
    """The call failed ambiguously and read-back did not find its effect.

    The row is left ``unknown`` so no later run repeats the call blindly.

    Attributes:
        key: The ledger key.
        attempts: How each attempt ended.
    """

    def __init__(self, key: str, attempts: tuple[AttemptRecord, ...]) -> None:
        self.key = key
        self.attempts = attempts
        lines = "; ".join(f"#{a.number} {a.reason}" for a in attempts)
        super().__init__(f"outcome of outbound call {key!r} is unknown: {lines}")


def _now() -> datetime:
    return datetime.now(UTC)


def _entry(row: Any) -> LedgerEntry:
    def aware(value: datetime) -> datetime:
        return value if value.tzinfo is not None else value.replace(tzinfo=UTC)

    return LedgerEntry(
        key=row.key,
        status=LedgerStatus(row.status),
        result=row.result,
        created_at=aware(row.created_at),
        updated_at=aware(row.updated_at),
    )


class _Call:
    """State of one ``run``: the attempt log and what the service may have seen."""

    __slots__ = ("in_flight", "log", "maybe_acted")

    def __init__(self, policy: RetryPolicy) -> None:
        self.log = _AttemptLog(policy)
        self.maybe_acted = False  # an attempt ended in a way that may have had an effect
        self.in_flight = False  # call() is being awaited right now


class OutboundLedger:
    """Run outbound calls at most once per key, recording outcomes in SQL.

    Args:
        engine: An async SQLAlchemy engine the caller owns and disposes of.
        policy: Attempts, time budget and backoff for retries. Default:
            ``RetryPolicy()``.
        settle: Seconds to wait after an ambiguous failure before reading back, so
            a request still in flight at the service can land first. Default 0.0.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        policy: RetryPolicy | None = None,
        settle: float = 0.0,
    ) -> None:
        if settle < 0:
            raise ValueError(f"settle must be >= 0, got {settle}")
        self._engine = engine
        self._policy = RetryPolicy() if policy is None else policy
        self._settle = settle

    async def create_all(self) -> None:
        """Create the ledger table if it does not exist.

        Raises:
            LedgerError: the database failed.
        """
        try:
            async with self._engine.begin() as conn:
                await conn.run_sync(ledger_metadata.create_all)
        except SQLAlchemyError as exc:
            raise LedgerError(f"cannot create the ledger table: {exc}") from exc

    async def get(self, key: str) -> LedgerEntry | None:
        """The row for ``key``, or ``None``.

        Raises:
            LedgerError: the database failed.
        """
        try:
            async with self._engine.connect() as conn:
                row = (await conn.execute(select(ledger_table).where(_t.key == key))).first()
        except SQLAlchemyError as exc:
            raise LedgerError(f"cannot read ledger row {key!r}: {exc}") from exc
        return None if row is None else _entry(row)

    async def forget(self, key: str) -> bool:
        """Delete the row for ``key``, so the next ``run`` calls again. ``True`` if deleted.

        For an operator who has checked the service by hand; never call it to retry
        an ``unknown`` call blindly.

        Raises:
            LedgerError: the database failed.
        """
        try:
            async with self._engine.begin() as conn:
                result = await conn.execute(sql_delete(ledger_table).where(_t.key == key))
        except SQLAlchemyError as exc:
            raise LedgerError(f"cannot delete ledger row {key!r}: {exc}") from exc
        return bool(result.rowcount)

    async def run(
        self, key: str, call: OutboundCall, *, read_back: ReadBack | None = None
    ) -> bytes:
        """Call at most once per ``key``; return the recorded result.

        Args:
            key: Identity of the logical call, e.g. from :func:`derive_key`.
            call: Performs the call; returns the bytes to record. Raise
                :class:`httpx.HTTPStatusError` (``response.raise_for_status()``) for
                an error answer, so a 4xx is told apart from an ambiguous failure.
            read_back: Checks the service for the effect after an ambiguous failure.
                Without it an ambiguous failure is never retried.

        Returns:
            The result of this call, of the earlier call recorded under ``key``, or
            what ``read_back`` found.

        Raises:
            LedgerConflict: the row is ``pending`` (another worker is calling) or
                ``unknown`` and ``read_back`` does not find the effect.
            OutcomeUnknown: this run failed ambiguously; the row is now ``unknown``.
            LedgerError: the database failed; nothing was called if it failed at
                the claim.
            Exception: the call's own exception when the service refused it (row
                ``failed``) or nothing was sent and the budget ran out.
        """
        existing = await self._claim(key)
        if existing is not None:
            return await self._resolve_existing(existing, read_back)

        state = _Call(self._policy)
        try:
            async for attempt in stamina.retry_context(
                state.log.hook, **self._policy.stamina_kwargs()
            ):
                with attempt:
                    result = await self._attempt(state, call, read_back)
        except BaseException as exc:
            await self._finish_failed(key, state, exc)
            raise
        # Shielded: the effect happened; a cancellation now must not leave it unrecorded.
        with anyio.CancelScope(shield=True):
            await self._record(key, LedgerStatus.SUCCEEDED, result)
        return result

    async def _attempt(self, state: _Call, call: OutboundCall, read_back: ReadBack | None) -> bytes:
        state.in_flight = True
        try:
            result = await call()
        except Exception as exc:
            state.in_flight = False
            return await self._after_failure(state, exc, read_back)
        state.in_flight = False
        state.log.note(Decision(False, "succeeded"))
        return result

    async def _after_failure(
        self, state: _Call, exc: Exception, read_back: ReadBack | None
    ) -> bytes:
        """Return what read-back found, or re-raise ``exc`` with its decision noted."""
        status = exc.response.status_code if isinstance(exc, httpx.HTTPStatusError) else None
        # "Retryable without a key" means the service never got it, or said it did not
        # process it (connect error, 408, 429, ...): resending cannot duplicate.
        unsent = retryable(exc, has_key=False)
        if unsent.retry:
            state.log.note(unsent, status=status, failure=exc)
            raise exc
        if status is not None and status < 500:
            state.log.note(
                Decision(False, f"{status}: refused by the service"), status=status, failure=exc
            )
            raise exc

        state.maybe_acted = True
        what = f"{status}" if status is not None else type(exc).__name__
        if read_back is None:
            decision = Decision(False, f"{what}: may have taken effect; no read-back, not retried")
            state.log.note(decision, status=status, failure=exc)
            raise exc
        if self._settle:
            await anyio.sleep(self._settle)
        found = await read_back()
        if found is not None:
            state.log.note(Decision(False, f"{what}; read-back found the effect"), status=status)
            return found
        # Only outcomes a keyed retry would repeat (timeouts, dropped connections,
        # 502-504) are retried; a 500 or a foreign exception ends as unknown.
        again = retryable(exc, has_key=True)
        verdict = "retrying" if again.retry else "not retried"
        decision = Decision(again.retry, f"{what}; read-back found nothing; {verdict}", again.delay)
        state.log.note(decision, status=status, failure=exc)
        raise exc

    async def _finish_failed(self, key: str, state: _Call, exc: BaseException) -> None:
        # in_flight: cancelled (or interrupted) while call() was awaited, so the request
        # may have reached the service. Cancelled during a backoff after failures that
        # sent nothing, the row is truthfully 'failed'.
        maybe = state.maybe_acted or state.in_flight
        status = LedgerStatus.UNKNOWN if maybe else LedgerStatus.FAILED
        # Shielded: a cancelled caller must still leave the row in a truthful state,
        # not 'pending' forever.
        with anyio.CancelScope(shield=True):
            await self._record(key, status, None)
        if status is LedgerStatus.UNKNOWN and isinstance(exc, Exception):
            raise OutcomeUnknown(key, tuple(state.log.records)) from exc

    async def _claim(self, key: str) -> LedgerEntry | None:
        """Insert a ``pending`` row; ``None`` if this run now owns the key, else the row."""
        try:
            # Bounded: each turn only repeats if the row vanished (forget) in between.
            for _ in range(3):
                now = _now()
                try:
                    async with self._engine.begin() as conn:
                        await conn.execute(
                            insert(ledger_table).values(
                                key=key,
                                status=LedgerStatus.PENDING.value,
                                result=None,
                                created_at=now,
                                updated_at=now,
                            )
                        )
                    return None
                except IntegrityError:
                    pass  # the key exists: a finished run, or a racing worker won
                async with self._engine.begin() as conn:
                    # 'failed' means nothing happened: take the row over atomically, so
                    # of two workers retrying a failed call only one wins.
                    taken = await conn.execute(
                        update(ledger_table)
                        .where(_t.key == key, _t.status == LedgerStatus.FAILED.value)
                        .values(status=LedgerStatus.PENDING.value, updated_at=now)
                    )
                    if taken.rowcount == 1:
                        return None
                    row = (await conn.execute(select(ledger_table).where(_t.key == key))).first()
                if row is not None:
                    return _entry(row)
        except SQLAlchemyError as exc:
            raise LedgerError(f"cannot claim ledger row {key!r}: {exc}") from exc
        raise LedgerError(f"ledger row {key!r} keeps disappearing while being claimed")

    async def _resolve_existing(self, entry: LedgerEntry, read_back: ReadBack | None) -> bytes:
        if entry.status is LedgerStatus.SUCCEEDED:
            return b"" if entry.result is None else entry.result
        if entry.status is LedgerStatus.UNKNOWN and read_back is not None:
            # Nobody is calling for an unknown row; the effect may have landed since.
            found = await read_back()
            if found is not None:
                await self._record(entry.key, LedgerStatus.SUCCEEDED, found, only=entry.status)
                return found
        raise LedgerConflict(entry)

    async def _record(
        self,
        key: str,
        status: LedgerStatus,
        result: bytes | None,
        *,
        only: LedgerStatus = LedgerStatus.PENDING,
    ) -> None:
        """Move the row from ``only`` to ``status``.

        Raises:
            LedgerError: the database failed, or the row was not in state ``only``
                (someone called :meth:`forget` meanwhile).
        """
        try:
            async with self._engine.begin() as conn:
                done = await conn.execute(
                    update(ledger_table)
                    .where(_t.key == key, _t.status == only.value)
                    .values(status=status.value, result=result, updated_at=_now())
                )
        except SQLAlchemyError as exc:
            raise LedgerError(f"cannot record {status.value} for {key!r}: {exc}") from exc
        if done.rowcount != 1:
            raise LedgerError(f"ledger row {key!r} was no longer {only.value}")
