"""The public surface: ``__all__`` is complete, sorted and importable."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import asgi_idempotency
from tests.helpers._blocking import run_without

# What a plain ``pip install asgi-idempotency`` lacks: the packages of the extras.
NOT_ON_A_PLAIN_INSTALL = "prometheus_client,httpx,stamina,uvicorn,redis"


def test_all_is_sorted_and_importable() -> None:
    names = asgi_idempotency.__all__
    assert list(names) == sorted(names)
    for name in names:
        assert getattr(asgi_idempotency, name) is not None


def test_the_typing_test_uses_every_public_name() -> None:
    # tests/typing/api.py is checked by mypy, never run: a name it does not import is
    # a name whose signature can change without a type error anywhere.
    import asgi_idempotency.client

    tree = ast.parse((Path(__file__).parents[1] / "typing" / "api.py").read_text())
    imported: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.setdefault(node.module, set()).update(a.name for a in node.names)
    for module in (asgi_idempotency, asgi_idempotency.client):
        missing = set(module.__all__) - imported.get(module.__name__, set())
        assert not missing, f"{module.__name__}: {sorted(missing)}"


def test_required_names_are_public() -> None:
    for name in ("IdempotencyMiddleware", "Policy", "idempotent", "SQLStore", "MemoryStore"):
        assert name in asgi_idempotency.__all__


def test_every_public_class_of_the_modules_is_exported() -> None:
    from asgi_idempotency.core import errors, lifecycle
    from asgi_idempotency.http import middleware, policy
    from asgi_idempotency.observability import metrics
    from asgi_idempotency.stores import base, memory
    from asgi_idempotency.stores.sql import store as sql

    for module in (errors, lifecycle, metrics, middleware, policy, base, memory, sql):
        for name in module.__all__:
            if name[0].isupper() and name not in ("ResolvedRoute", "MetricsSink"):
                assert name in asgi_idempotency.__all__, f"{module.__name__}.{name}"


def test_the_names_of_an_extra_are_reachable_but_not_star_exported() -> None:
    # In __all__ they would make ``from asgi_idempotency import *`` fail without the extra.
    from asgi_idempotency.observability import prometheus

    for name in prometheus.__all__:
        assert name not in asgi_idempotency.__all__, name
        assert getattr(asgi_idempotency, name) is getattr(prometheus, name), name
        assert name in dir(asgi_idempotency), name


def test_star_import_works_on_a_plain_install() -> None:
    done = run_without(
        NOT_ON_A_PLAIN_INSTALL,
        "from asgi_idempotency import *\n"
        "import asgi_idempotency\n"
        "missing = [n for n in asgi_idempotency.__all__ if n not in globals()]\n"
        "assert not missing, missing\n"
        "print('ok')\n",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_an_extra_missing_on_first_use_is_named() -> None:
    done = run_without(
        NOT_ON_A_PLAIN_INSTALL,
        "import asgi_idempotency\n"
        "try:\n"
        "    asgi_idempotency.PrometheusMetrics\n"
        "except ImportError as exc:\n"
        "    print(repr(exc))\n",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ImportError("), done.stdout
    assert "pip install 'asgi-idempotency[prometheus]'" in done.stdout


def test_redis_store_is_reachable_and_names_its_extra_when_missing() -> None:
    from asgi_idempotency.stores.redis import RedisStore

    assert asgi_idempotency.RedisStore is RedisStore
    assert "RedisStore" not in asgi_idempotency.__all__
    done = run_without(
        NOT_ON_A_PLAIN_INSTALL,
        "import asgi_idempotency\n"
        "try:\n"
        "    asgi_idempotency.RedisStore\n"
        "except ImportError as exc:\n"
        "    print(repr(exc))\n",
    )
    assert done.returncode == 0, done.stderr
    assert "pip install 'asgi-idempotency[redis]'" in done.stdout, done.stdout


LOG_FROM_THE_PACKAGE = (
    "import logging\n"
    "import asgi_idempotency\n"
    "logging.getLogger('asgi_idempotency').error('idempotency.store_error')\n"
    "logging.getLogger('asgi_idempotency.stores').warning('idempotency.child')\n"
)


def test_the_package_prints_nothing_when_the_application_configures_no_logging() -> None:
    # Without a handler of its own, Python's last-resort handler prints WARNING and up.
    done = run_without(NOT_ON_A_PLAIN_INSTALL, LOG_FROM_THE_PACKAGE)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


def test_the_package_logs_reach_the_handlers_the_application_configures() -> None:
    done = run_without(
        NOT_ON_A_PLAIN_INSTALL, "import logging\nlogging.basicConfig()\n" + LOG_FROM_THE_PACKAGE
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        "ERROR:asgi_idempotency:idempotency.store_error",
        "WARNING:asgi_idempotency.stores:idempotency.child",
    ]


def test_unknown_attribute_raises() -> None:
    with pytest.raises(AttributeError, match="nope"):
        asgi_idempotency.nope  # noqa: B018  # mypy allows it: the package has a module __getattr__
