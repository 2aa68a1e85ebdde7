"""The public path of :mod:`asgi_idempotency.integrations.webhooks`."""

from asgi_idempotency.integrations.webhooks import *  # noqa: F403
from asgi_idempotency.integrations.webhooks import __all__ as __all__
