"""The client's public surface: importable without the server's dependencies, __all__ complete."""

from __future__ import annotations

import pytest

import asgi_idempotency.client as client
from asgi_idempotency.client import keys, ledger, retry, transport
from tests.helpers._blocking import run_without


def test_importable_without_starlette_sqlalchemy_httpx_or_stamina() -> None:
    done = run_without(
        "starlette,sqlalchemy,httpx,stamina,fastapi",
        "import asgi_idempotency.client as c\n"
        "key = c.derive_key('run', 0, 'refund', {'amount': 4500})\n"
        "assert key.startswith('v1:'), key\n"
        "assert c.canonical_json({'b': 1, 'a': 2.0}) == b'{\"a\":2,\"b\":1}'\n"
        "leaked = sorted(m for m in ('starlette', 'sqlalchemy', 'httpx', 'stamina')"
        " if m in sys.modules)\n"
        "assert not leaked, leaked\n"
        "print('ok')\n",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_transport_needs_only_httpx_and_stamina() -> None:
    done = run_without(
        "starlette,sqlalchemy",
        "from asgi_idempotency.client import AsyncIdempotentTransport, RetryPolicy, retryable\n"
        "assert 'starlette' not in sys.modules and 'sqlalchemy' not in sys.modules\n"
        "try:\n"
        "    from asgi_idempotency.client import OutboundLedger\n"
        "except ImportError as exc:\n"
        "    assert 'sqlalchemy' in str(exc), exc\n"
        "    print('ok')\n",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


CLIENT_EXTRA = "pip install 'asgi-idempotency[client]'"
# The statements a user writes, and the packages of the client extra each one needs.
NEEDS_THE_EXTRA = [
    ("from asgi_idempotency.client import AsyncIdempotentTransport", "httpx"),
    ("from asgi_idempotency.client import AsyncIdempotentTransport", "stamina"),
    ("from asgi_idempotency.client import IdempotentTransport", "httpx"),
    ("from asgi_idempotency.client import IdempotentTransport", "stamina"),
    ("from asgi_idempotency.client import random_key", "stamina"),
    ("from asgi_idempotency.client import retryable", "httpx"),
    ("from asgi_idempotency.client import RetriesExhausted", "httpx"),
    ("from asgi_idempotency.client import OutboundLedger", "httpx"),
    ("from asgi_idempotency.client import OutboundLedger", "stamina"),
    ("from asgi_idempotency.client import OutboundLedger", "anyio"),
    ("import asgi_idempotency.client.transport", "stamina"),
    ("import asgi_idempotency.client.retry", "httpx"),
    ("import asgi_idempotency.client; asgi_idempotency.client.IdempotentTransport", "httpx"),
]


@pytest.mark.parametrize(("statement", "missing"), NEEDS_THE_EXTRA)
def test_a_missing_client_extra_is_named(statement: str, missing: str) -> None:
    done = run_without(
        missing,
        f"try:\n    {statement}\nexcept ImportError as exc:\n    print(repr(exc))\n",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ImportError("), done.stdout
    assert CLIENT_EXTRA in done.stdout


def test_the_classification_needs_httpx_but_not_stamina() -> None:
    done = run_without(
        "stamina",
        "from asgi_idempotency.client import Decision, RetryPolicy, retryable\n"
        "assert 'stamina' not in sys.modules\n"
        "print('ok')\n",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_the_blocker_really_blocks() -> None:
    """Guard against a test that passes because the finder does nothing."""
    done = run_without("starlette", "import starlette\n")
    assert done.returncode != 0
    assert "blocked for this test" in done.stderr


def test_all_is_sorted_and_complete() -> None:
    assert client.__all__ == sorted(client.__all__)
    expected = {"CanonicalJSONError", "canonical_json"}
    for module in (keys, retry, transport, ledger):
        expected |= set(module.__all__)
    assert set(client.__all__) == expected


def test_every_public_name_resolves_to_its_definition() -> None:
    for name in client.__all__:
        value = getattr(client, name)
        for module in (keys, retry, transport, ledger):
            if name in module.__all__:
                assert value is getattr(module, name), name
    assert set(client.__all__) <= set(dir(client))


def test_unknown_names_raise_attribute_error() -> None:
    with pytest.raises(AttributeError, match="NoSuchThing"):
        _ = client.NoSuchThing
