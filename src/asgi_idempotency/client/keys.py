"""Deterministic Idempotency-Key derivation for agent runs and other replayable callers.

A key must name the *originating* request, not the attempt: a retry, a restarted
worker and a resumed run all have to arrive at the same string. So the key is a
digest of what identifies the call (run id, step index, tool name and its
canonicalised arguments), never of a clock or a random source, unless the caller
asks for a time bucket explicitly.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from asgi_idempotency.core.canonical import canonical_json

__all__ = ["KEY_VERSION", "derive_key"]

#: Prefix of every derived key. Bump it, never the hashing silently, if the payload
#: layout ever changes: old and new keys must not collide, and a reader of a log
#: line should see which scheme produced a key.
KEY_VERSION: Final = "v1"

_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)


def derive_key(
    run_id: str,
    step: int,
    tool: str,
    args: Any,
    *,
    bucket: timedelta | None = None,
    now: datetime | None = None,
) -> str:
    """Derive the Idempotency-Key of one tool call: ``"v1:"`` + 64 lowercase hex digits.

    The digest is SHA-256 over the canonical JSON (see :func:`canonical_json`) of
    ``run_id``, ``step``, ``tool`` and ``args``, so ``{"a": 1, "b": 2}`` and
    ``{"b": 2, "a": 1.0}`` give the same key, on any machine and Python version.
    The result is 67 printable ASCII characters, a valid bare header token.

    Args:
        run_id: Stable identity of the run; persist it so a resumed run reuses it.
        step: Index of the call within the run (``>= 0``). Persist it too: a
            resumed run that renumbers its steps derives different keys.
        tool: Name of the tool or operation, e.g. ``"refund"``.
        args: The call's arguments; anything :func:`canonical_json` accepts.
        bucket: Optional time window. When given, the key also covers
            ``floor((now - 1970-01-01T00:00Z) / bucket)`` and the bucket length, so the
            same call in a later window gets a new key. Default ``None``: no clock.
        now: Timezone-aware instant used with ``bucket``. Default: the current UTC
            time. Ignored without ``bucket``.

    Raises:
        CanonicalJSONError: ``args`` has no canonical JSON form (NaN, infinity, a
            set, a ``datetime``, non-``str`` mapping keys, ...).
        TypeError: ``run_id`` or ``tool`` is not a ``str``, ``step`` not an ``int``.
        ValueError: ``run_id`` or ``tool`` is empty, ``step`` is negative,
            ``bucket`` is not positive, or ``now`` is naive.
    """
    if not isinstance(run_id, str) or not isinstance(tool, str):
        raise TypeError("run_id and tool must be str")
    # bool is an int subclass; step=True is almost certainly a bug at the call site.
    if not isinstance(step, int) or isinstance(step, bool):
        raise TypeError(f"step must be an int, not {type(step).__name__}")
    if not run_id or not tool:
        raise ValueError("run_id and tool must be non-empty")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")

    window: list[int] | None = None
    if bucket is not None:
        if bucket <= timedelta(0):
            raise ValueError(f"bucket must be positive, got {bucket}")
        instant = datetime.now(UTC) if now is None else now
        # A naive datetime means different instants on machines in different zones,
        # which would split one logical call across two keys.
        if instant.tzinfo is None or instant.utcoffset() is None:
            raise ValueError("now must be timezone-aware")
        # timedelta // timedelta is exact integer arithmetic in microseconds; a float
        # division could land a boundary instant in different buckets on different hosts.
        window = [bucket // timedelta(microseconds=1), (instant - _EPOCH) // bucket]

    payload = canonical_json(
        {"args": args, "bucket": window, "run": run_id, "step": step, "tool": tool}
    )
    return f"{KEY_VERSION}:{hashlib.sha256(payload).hexdigest()}"
