"""A process that claims a key with :class:`Once` and hangs in the function (to be killed).

``python -m tests.functions.once_holder URL EFFECTS`` runs :func:`charge` under a guard with a
one-second lease on the SQL store at ``URL``: the function appends its effect to the
file ``EFFECTS`` and then hangs, renewing its lease, until the test SIGKILLs the process.
The test guards the same function (same namespace, same qualified name) in its own
process to take the abandoned key over.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from asgi_idempotency import Once, SQLStore
from asgi_idempotency.stores.base import Store

NAMESPACE = "kill-test"
LEASE = timedelta(seconds=1)
HANG = False  # the holder process hangs after its effect; the test's own calls return


def charge(order: str, effects: str) -> dict[str, str]:
    """The effect: one line per run, appended to ``effects`` (shared by both processes)."""
    with Path(effects).open("a") as log:
        log.write(f"{order}\n")
    while HANG:
        time.sleep(3600)  # killed here: the claim is left in progress
    return {"order": order, "status": "charged"}


def guarded(once: Once, *, wait: timedelta | None = None) -> Callable[[str, str], dict[str, str]]:
    return once(key=lambda order, effects: f"charge:{order}", wait=wait)(charge)


def make_once(store: Store, *, retry_after: float = 1.0) -> Once:
    return Once(store, lease=LEASE, namespace=NAMESPACE, retry_after=retry_after)


def main(url: str, effects: str) -> None:
    global HANG
    HANG = True
    guarded(make_once(SQLStore(url)))("A-1", effects)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
