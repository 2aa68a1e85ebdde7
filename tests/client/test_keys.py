"""derive_key: golden vectors, the properties that make keys stable, and what is rejected."""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import subprocess
import sys
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asgi_idempotency.client import KEY_VERSION, CanonicalJSONError, canonical_json, derive_key

GOLDEN = Path(__file__).with_name("golden_keys.json")
SRC = Path(__file__).parents[2] / "src"


def _golden() -> list[dict[str, Any]]:
    vectors: list[dict[str, Any]] = json.loads(GOLDEN.read_text())
    return vectors


def _derive(vector: dict[str, Any]) -> str:
    seconds = vector["bucket_seconds"]
    return derive_key(
        vector["run_id"],
        vector["step"],
        vector["tool"],
        vector["args"],
        bucket=None if seconds is None else timedelta(seconds=seconds),
        now=None if vector["now"] is None else datetime.fromisoformat(vector["now"]),
    )


# --- golden vectors ----------------------------------------------------------------


@pytest.mark.parametrize("vector", _golden(), ids=lambda v: v["note"])
def test_golden_vectors(vector: dict[str, Any]) -> None:
    assert _derive(vector) == vector["key"]


def test_payload_layout_is_pinned() -> None:
    """The first golden key is SHA-256 of this exact byte string, written out by hand."""
    payload = (
        b'{"args":{"amount":4500,"currency":"EUR","order_id":"o-1"},'
        b'"bucket":null,"run":"run-1","step":0,"tool":"refund"}'
    )
    assert _golden()[0]["key"] == f"v1:{hashlib.sha256(payload).hexdigest()}"


def test_golden_vectors_in_fresh_processes_with_other_hash_seeds() -> None:
    """Nothing in a key may depend on the process: hash randomisation, dict history."""
    script = (
        "import json, sys\n"
        "from datetime import datetime, timedelta\n"
        "from asgi_idempotency.client import derive_key\n"
        "out = []\n"
        "for v in json.load(open(sys.argv[1])):\n"
        "    b = v['bucket_seconds']\n"
        "    out.append(derive_key(v['run_id'], v['step'], v['tool'], v['args'],\n"
        "        bucket=None if b is None else timedelta(seconds=b),\n"
        "        now=None if v['now'] is None else datetime.fromisoformat(v['now'])))\n"
        "print(json.dumps(out))\n"
    )
    expected = [v["key"] for v in _golden()]
    for seed in ("0", "1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(SRC)}
        done = subprocess.run(
            [sys.executable, "-c", script, str(GOLDEN)],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        assert json.loads(done.stdout) == expected


def test_key_shape() -> None:
    key = derive_key("run", 0, "tool", {"a": 1})
    assert key.startswith(f"{KEY_VERSION}:")
    assert len(key) == 67 <= 255
    assert all(0x21 <= ord(c) <= 0x7E for c in key)


# --- properties --------------------------------------------------------------------

_leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
json_values = st.recursive(
    _leaves,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=6,
)
json_objects = st.dictionaries(st.text(max_size=6), json_values, min_size=1, max_size=4)
# Generating nested objects is the slow part; 50 examples per property keeps the file fast.
quick = settings(max_examples=50)
# Integers a float holds exactly: there 4500, 4500.0 and Decimal("4500.00") are one number.
exact_ints = st.integers(min_value=-(2**53) + 1, max_value=2**53 - 1)
idents = st.text(min_size=1, max_size=10)


def _reorder(value: Any, rnd: random.Random) -> Any:
    """Same value, every mapping's insertion order shuffled, recursively."""
    if isinstance(value, dict):
        items = list(value.items())
        rnd.shuffle(items)
        return {k: _reorder(v, rnd) for k, v in items}
    if isinstance(value, list):
        return [_reorder(v, rnd) for v in value]
    return value


def _tuples(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


@quick
@given(args=json_objects, rnd=st.randoms(use_true_random=False), run=idents, step=st.integers(0))
def test_key_order_never_changes_the_key(
    args: dict[str, Any], rnd: random.Random, run: str, step: int
) -> None:
    assert derive_key(run, step, "t", _reorder(args, rnd)) == derive_key(run, step, "t", args)


@given(n=exact_ints, places=st.integers(0, 6))
def test_int_float_and_decimal_spellings_give_one_key(n: int, places: int) -> None:
    as_decimal = Decimal(n).quantize(Decimal(1).scaleb(-places))  # e.g. Decimal("4500.00")
    keys = {derive_key("run", 1, "refund", {"amount": v}) for v in (n, float(n), as_decimal)}
    assert len(keys) == 1


def test_the_4500_example() -> None:
    forms = (4500, 4500.0, Decimal("4500.00"), Decimal("4.5E+3"))
    assert len({derive_key("run", 1, "refund", {"amount": v}) for v in forms}) == 1


@given(
    f=st.floats(
        allow_nan=False, allow_infinity=False, min_value=-(2.0**53) + 1, max_value=2.0**53 - 1
    )
)
def test_a_float_and_its_shortest_decimal_give_one_key(f: float) -> None:
    assert derive_key("r", 0, "t", [f]) == derive_key("r", 0, "t", [Decimal(repr(f))])


@quick
@given(args=json_values)
def test_tuples_and_lists_give_one_key(args: Any) -> None:
    assert derive_key("r", 0, "t", _tuples(args)) == derive_key("r", 0, "t", args)


def _same_value(a: Any, b: Any) -> bool:
    """Equal as JSON data: numbers by numeric value (exact range only), else type and value."""
    numbers = (int, float)
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, numbers) and isinstance(b, numbers):
        # Past 2**53 only an identical number of the same type is surely the same one.
        return a == b and (abs(a) < 2**53 or type(a) is type(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


@quick
@given(args=json_objects, data=st.data())
def test_any_real_change_of_a_value_changes_the_key(
    args: dict[str, Any], data: st.DataObject
) -> None:
    name = data.draw(st.sampled_from(sorted(args)))
    new = data.draw(json_values)
    changed = {**args, name: new}
    if _same_value(args[name], new):
        return  # not a real change; the other properties cover it
    assert derive_key("r", 0, "t", changed) != derive_key("r", 0, "t", args)


@quick
@given(args=json_objects, data=st.data())
def test_adding_or_removing_an_argument_changes_the_key(
    args: dict[str, Any], data: st.DataObject
) -> None:
    name = data.draw(st.sampled_from(sorted(args)))
    smaller = {k: v for k, v in args.items() if k != name}
    assert derive_key("r", 0, "t", smaller) != derive_key("r", 0, "t", args)


@given(
    a=st.tuples(idents, st.integers(0, 10**6), idents),
    b=st.tuples(idents, st.integers(0, 10**6), idents),
)
def test_run_step_and_tool_each_change_the_key(
    a: tuple[str, int, str], b: tuple[str, int, str]
) -> None:
    assert (derive_key(*a, {"x": 1}) == derive_key(*b, {"x": 1})) == (a == b)


@settings(max_examples=200)
@given(s=st.text(alphabet=st.characters(codec=None, categories=None), max_size=6))
def test_every_str_serialises_or_is_rejected_as_canonical_json_error(s: str) -> None:
    """Lone surrogates have no UTF-8 form; they must fail with the library's error."""
    try:
        encoded = canonical_json({s: s})
    except CanonicalJSONError:
        assert any(0xD800 <= ord(c) <= 0xDFFF for c in s)
    else:
        assert json.loads(encoded) == {s: s}


# --- rejection ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        math.nan,
        math.inf,
        -math.inf,
        Decimal("NaN"),
        Decimal("Infinity"),
        Decimal("-Infinity"),
        {1, 2},
        b"bytes",
        datetime(2024, 1, 1, tzinfo=UTC),
        object(),
        {1: "int key"},
        {"nested": [1, {"deep": math.nan}]},
        "\ud800",
    ],
    # Not repr alone: an object's repr holds its address, and every pytest-xdist worker
    # must collect the same ids.
    ids=lambda v: "object()" if type(v) is object else repr(v),
)
def test_values_without_a_canonical_form_are_rejected(value: Any) -> None:
    with pytest.raises(CanonicalJSONError):
        canonical_json(value)
    with pytest.raises(CanonicalJSONError):
        derive_key("run", 0, "tool", {"v": value})


def test_nesting_deeper_than_the_encoder_allows_is_rejected() -> None:
    deep: list[Any] = []
    for _ in range(300):
        deep = [deep]
    with pytest.raises(CanonicalJSONError):
        canonical_json(deep)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"run_id": ""}, ValueError),
        ({"tool": ""}, ValueError),
        ({"step": -1}, ValueError),
        ({"step": True}, TypeError),
        ({"step": 1.0}, TypeError),
        ({"run_id": 7}, TypeError),
        ({"bucket": timedelta(0)}, ValueError),
        ({"bucket": timedelta(hours=1), "now": datetime(2024, 1, 1)}, ValueError),  # naive now
    ],
)
def test_invalid_identity_is_rejected(kwargs: dict[str, Any], error: type[Exception]) -> None:
    call: dict[str, Any] = {"run_id": "run", "step": 0, "tool": "tool", "args": {}, **kwargs}
    with pytest.raises(error):
        derive_key(**call)


# --- buckets ------------------------------------------------------------------------


def test_bucket_boundaries() -> None:
    hour = timedelta(hours=1)
    at = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)

    def key(now: datetime) -> str:
        return derive_key("r", 0, "digest", {}, bucket=hour, now=now)

    assert key(at) == key(at + hour - timedelta(microseconds=1))
    assert key(at) != key(at + hour)
    assert key(at) != key(at - timedelta(microseconds=1))
    # The same instant written in another zone is the same bucket.
    assert key(at) == key(at.astimezone(timezone(timedelta(hours=-7))))
    # A bucket never collides with the unbucketed key.
    assert key(at) != derive_key("r", 0, "digest", {})


def test_bucket_defaults_to_the_current_time() -> None:
    day = timedelta(days=1)
    before = derive_key("r", 0, "t", {}, bucket=day, now=datetime.now(UTC))
    current = derive_key("r", 0, "t", {}, bucket=day)
    after = derive_key("r", 0, "t", {}, bucket=day, now=datetime.now(UTC))
    assert current in (before, after)


def test_now_without_bucket_is_ignored() -> None:
    then = datetime(2000, 1, 1, tzinfo=UTC)
    assert derive_key("r", 0, "t", {}, now=then) == derive_key("r", 0, "t", {})
