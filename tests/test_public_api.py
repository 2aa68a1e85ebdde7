"""The public surface: ``__all__`` is complete, sorted and importable."""

from __future__ import annotations

import pytest

import asgi_idempotency


def test_all_is_sorted_and_importable() -> None:
    names = asgi_idempotency.__all__
    assert list(names) == sorted(names)
    for name in names:
        assert getattr(asgi_idempotency, name) is not None


def test_required_names_are_public() -> None:
    for name in ("IdempotencyMiddleware", "Policy", "idempotent", "SQLStore", "MemoryStore"):
        assert name in asgi_idempotency.__all__


def test_every_public_class_of_the_modules_is_exported() -> None:
    from asgi_idempotency import errors, lifecycle, metrics, middleware, policy
    from asgi_idempotency.stores import base, memory, sql

    for module in (errors, lifecycle, metrics, middleware, policy, base, memory, sql):
        for name in module.__all__:
            if name[0].isupper() and name not in ("ResolvedRoute", "MetricsSink"):
                assert name in asgi_idempotency.__all__, f"{module.__name__}.{name}"


def test_unknown_attribute_raises() -> None:
    with pytest.raises(AttributeError, match="nope"):
        asgi_idempotency.nope  # type: ignore[attr-defined]  # noqa: B018
