"""The client's public surface: importable without the server's dependencies, __all__ complete."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import asgi_idempotency.client as client
from asgi_idempotency.client import keys, ledger, retry, transport

SRC = Path(__file__).parents[2] / "src"

# A meta path finder that makes the named top-level packages unimportable, as if
# they were not installed.
_BLOCKER = """
import sys
BLOCKED = set(sys.argv[1].split(","))

class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked for this test")
        return None

sys.meta_path.insert(0, Blocker())
"""


def _run(blocked: str, body: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _BLOCKER + body, blocked],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PYTHONPATH": str(SRC), "PATH": ""},
    )


def test_importable_without_starlette_sqlalchemy_httpx_or_stamina() -> None:
    done = _run(
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
    done = _run(
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


def test_the_blocker_really_blocks() -> None:
    """Guard against a test that passes because the finder does nothing."""
    done = _run("starlette", "import starlette\n")
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
