"""One unit of test time: the leases, ttls and waits of tests that let time pass.

On a store of its own clock (Postgres, MariaDB, Redis) only real time moves a lease, so
a test waits out what it sets: ``UNIT`` is the shortest lease these tests keep reliably
on a loaded two-core machine, where a store round trip on loopback takes milliseconds
and a pause of the test process a few tens of them. On a store on the caller's clock
(memory, SQLite, the fake) tests move an injected clock instead (``StoreClock``), and
``StoreClock.shared_unit`` is set to ``UNIT`` here for the contract suite's own waits.

A test that waits on time writes its spans as multiples: ``2 * UNIT`` for a lease,
``UNIT / 3`` for a renewal's period, ``seconds(2.5)`` for the sleep past a ttl of two.
"""

from __future__ import annotations

from datetime import timedelta

from asgi_idempotency.testing import StoreClock

__all__ = ["UNIT", "seconds"]

UNIT = timedelta(seconds=0.5)

StoreClock.shared_unit = UNIT


def seconds(units: float) -> float:
    """``units`` of ``UNIT``, in seconds (for ``asyncio.sleep`` and timeouts)."""
    return units * UNIT.total_seconds()
