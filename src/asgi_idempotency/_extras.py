"""The one message for an optional extra that is not installed.

A module that needs an extra imports its packages in ``try`` and, on
``ImportError``, raises :func:`missing_extra` ``from`` it, so every such message
names the module, what it needs, and the ``pip install`` line for the extra.
Imports nothing itself: it has to work on a plain install.
"""

from __future__ import annotations

__all__ = ["missing_extra"]


def missing_extra(module: str, needs: str, extra: str) -> ImportError:
    """``module needs <needs>: pip install 'asgi-idempotency[<extra>]'``, to raise."""
    return ImportError(f"{module} needs {needs}: pip install 'asgi-idempotency[{extra}]'")
