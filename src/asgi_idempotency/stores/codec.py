"""The record codec: how a record's values cross a driver boundary, both ways, for every store.

One module, so that what a row holds means the same on each backend: stored headers
as one JSON list of latin-1 pairs, times as each driver binds them (aware UTC for
asyncpg, naive UTC for asyncmy's ``DATETIME(6)``, SQLAlchemy's fixed-width text for
SQLite, integer epoch microseconds for Redis), and a SQL row of
:data:`~.statements.RECORD_COLUMNS` as a :class:`~.base.Record`. The function
guard's results are stored as a response body (orjson) by :mod:`asgi_idempotency.functions.once`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson

from asgi_idempotency.core.errors import StoreError
from asgi_idempotency.stores.base import STATUS_OF, Record, StoredResponse

__all__ = [
    "as_time",
    "decode_headers",
    "encode_headers",
    "epoch_us",
    "from_epoch_us",
    "mysql_time",
    "pg_time",
    "sqlite_time",
    "to_record",
]


def encode_headers(headers: tuple[tuple[bytes, bytes], ...]) -> bytes:
    """Stored-response headers as bytes: a JSON list of latin-1 ``[name, value]`` pairs."""
    return orjson.dumps([[k.decode("latin-1"), v.decode("latin-1")] for k, v in headers])


def decode_headers(raw: bytes) -> tuple[tuple[bytes, bytes], ...]:
    return tuple([(k.encode("latin-1"), v.encode("latin-1")) for k, v in orjson.loads(raw)])


def _aware(value: datetime) -> datetime:
    # A naive time would be read as the server's or driver's local time, silently.
    if value.tzinfo is None:
        raise StoreError("ValueError: naive datetime: pass an aware UTC datetime")
    return value


def pg_time(value: datetime) -> datetime:
    """A time as asyncpg binds it to ``timestamptz``: aware, any zone."""
    return _aware(value)


# datetime.combine(date, time[, tzinfo]) rather than .replace(tzinfo=...): the same
# datetime (fold included), for a fraction of replace's keyword parsing, on every
# time a row binds or reads.
_combine = datetime.combine


def mysql_time(value: datetime) -> datetime:
    """A time as asyncmy binds it to ``DATETIME(6)``: naive UTC (it would drop an offset)."""
    if value.tzinfo is not UTC:
        value = _aware(value).astimezone(UTC)
    return _combine(value.date(), value.time())  # time(): without its tzinfo


def sqlite_time(value: datetime) -> str:
    """SQLAlchemy's SQLite DATETIME storage format (naive UTC, fixed width).

    Rows written by Core and by the hot path then compare correctly as text.
    """
    v = _aware(value)
    v = v if v.tzinfo is UTC else v.astimezone(UTC)
    return "%04d-%02d-%02d %02d:%02d:%02d.%06d" % (  # noqa: UP031  # the fastest spelling
        v.year, v.month, v.day, v.hour, v.minute, v.second, v.microsecond
    )  # fmt: skip


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)


def epoch_us(value: datetime) -> int:
    """Integer microseconds since the epoch (exact both ways): Redis's times."""
    return (_aware(value) - _EPOCH) // _US


def from_epoch_us(raw: bytes | int) -> datetime:
    return _EPOCH + timedelta(0, 0, int(raw))  # positional: half the cost of microseconds=…


def as_time(value: Any) -> datetime:
    """An aware UTC datetime from what a driver returns (asyncpg: aware; SQLite: naive text)."""
    if type(value) is datetime and value.tzinfo is not None:
        return value
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    assert isinstance(value, datetime)
    return value if value.tzinfo is not None else _combine(value.date(), value.time(), UTC)


def to_record(key: str, row: Sequence[Any]) -> Record:
    """A :class:`Record` from ``row``, which holds :data:`~.statements.RECORD_COLUMNS` in order,
    then, from a statement that reads the database's clock, the time it read the row."""
    response = None
    if row[6] is not None:
        response = StoredResponse(status=row[6], headers=decode_headers(row[7]), body=bytes(row[8]))
    return Record(
        key=key,
        request_hash=row[0],
        status=STATUS_OF[row[1]],
        token=row[2],
        created_at=as_time(row[3]),
        locked_until=as_time(row[4]),
        expires_at=as_time(row[5]),
        response=response,
        read_at=as_time(row[9]) if len(row) > 9 and row[9] is not None else None,
    )
