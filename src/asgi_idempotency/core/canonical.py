"""Canonical JSON: one byte string per logical value.

Shared by the server's request fingerprint and the client's key derivation, so a
client that re-serialises the same arguments never gets a false 422 and never
derives a different key. Deliberately free of server imports.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

import orjson

__all__ = ["CanonicalJSONError", "canonical_json", "canonicalize_json_bytes"]

# Integral floats become ints only inside the range where a float is exact; past it,
# 4.5e300 stays a float rather than inventing digits the sender never wrote.
_EXACT_INT = 2**53
# orjson parses a number as float only when it has a fraction or an exponent, or when
# it lies outside 64-bit range (and so above 2**53). A body with no digit followed by
# ".", "e" or "E" therefore holds no float that _normalize would turn into an int.
_MAYBE_INTEGRAL_FLOAT = re.compile(rb"[0-9][.eE]")


class CanonicalJSONError(ValueError):
    """A value has no canonical JSON form (NaN, infinity, an unsupported type)."""


def _number(value: float | Decimal) -> Any:
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CanonicalJSONError(f"{value!r} has no JSON form")
        if value.is_integer() and abs(value) < _EXACT_INT:
            return int(value)
        return value
    if not value.is_finite():
        raise CanonicalJSONError(f"Decimal {value} has no JSON form")
    if value == value.to_integral_value():
        return _int(int(value))
    as_float = float(value)
    # Decimal("0.1") and 0.1 must give the same bytes; a Decimal a float cannot hold
    # exactly keeps its own normalised digits.
    if Decimal(repr(as_float)) == value:
        return as_float
    return orjson.Fragment(format(value.normalize(), "f"))


def _int(value: int) -> Any:
    if -(2**63) <= value < 2**64:
        return value
    return orjson.Fragment(str(value))


def _normalize(value: Any) -> Any:
    # bool is an int subclass: test it first so True stays true, not 1.
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return _int(value)
    if isinstance(value, (float, Decimal)):
        return _number(value)
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise CanonicalJSONError(f"object keys must be str, not {type(key).__name__}")
            out[key] = _normalize(item)
        return out
    if isinstance(value, (list, tuple)):
        return [_normalize(item) for item in value]
    raise CanonicalJSONError(
        f"{type(value).__name__} has no canonical JSON form; convert it to str, int, "
        "float, Decimal, bool, None, list, tuple or dict first"
    )


def canonical_json(value: Any) -> bytes:
    """Serialise ``value`` to canonical JSON bytes.

    Sorted keys, compact separators, UTF-8. ``4500.0``, ``4500`` and
    ``Decimal("4500.00")`` give the same bytes; tuples serialise as lists.

    Raises:
        CanonicalJSONError: for NaN or infinities, non-``str`` object keys, any type
            outside JSON's data model (it is never ``str()``-ed silently), strings
            with lone surrogates (no UTF-8 form), and nesting deeper than orjson's
            limit of 254 levels.
    """
    try:
        return orjson.dumps(_normalize(value), option=orjson.OPT_SORT_KEYS)
    except RecursionError as exc:
        raise CanonicalJSONError("value is nested too deeply") from exc
    except orjson.JSONEncodeError as exc:
        # orjson's own refusals (lone surrogates, its recursion limit) are the same
        # kind of failure as ours; callers should need to catch one error only.
        raise CanonicalJSONError(str(exc)) from exc


def _integral_floats_to_int(value: Any) -> Any:
    # _normalize for what orjson.loads returns (dict, list, str, int, float, bool, None),
    # where only floats can change.
    kind = type(value)
    if kind is float:
        return int(value) if value.is_integer() and abs(value) < _EXACT_INT else value
    if kind is dict:
        return {k: _integral_floats_to_int(v) for k, v in value.items()}
    if kind is list:
        return [_integral_floats_to_int(v) for v in value]
    return value


def canonicalize_json_bytes(body: bytes) -> bytes | None:
    """Canonical form of a JSON document, or ``None`` when ``body`` is not valid JSON.

    Invalid, non-UTF-8 or too deeply nested documents return ``None`` so the caller
    fingerprints the raw bytes and lets the handler answer with its own 4xx. Gives
    the same bytes as :func:`canonical_json` of the parsed document; a path of its
    own because every guarded JSON request takes it.
    """
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    try:
        if _MAYBE_INTEGRAL_FLOAT.search(body) is not None:
            parsed = _integral_floats_to_int(parsed)
        return orjson.dumps(parsed, option=orjson.OPT_SORT_KEYS)
    except (orjson.JSONEncodeError, RecursionError):
        return None
