"""The public path of :mod:`asgi_idempotency.integrations.transactional`."""

from asgi_idempotency.integrations.transactional import *  # noqa: F403
from asgi_idempotency.integrations.transactional import __all__ as __all__
