"""The public path of :mod:`asgi_idempotency.observability.prometheus`."""

from asgi_idempotency.observability.prometheus import *  # noqa: F403
from asgi_idempotency.observability.prometheus import __all__ as __all__
