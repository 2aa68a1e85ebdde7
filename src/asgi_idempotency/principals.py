"""The public path of :mod:`asgi_idempotency.http.principals`."""

from asgi_idempotency.http.principals import *  # noqa: F403
from asgi_idempotency.http.principals import __all__ as __all__
