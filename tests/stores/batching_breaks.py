"""Break each batching guarantee once and watch its test fail.

``python -m tests.stores.batching_breaks [name ...]``: each break edits one line of
the source, runs ``tests/stores/test_batching.py``, prints which tests failed, and
restores the file (also when interrupted). A break that no test catches prints
``NOT CAUGHT`` and makes the exit status 1. Not collected by pytest (no ``test_``
prefix): it rewrites source files while it runs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STORES = ROOT / "src" / "asgi_idempotency" / "stores"
B, P, S = STORES / "batching.py", STORES / "postgres_batched.py", STORES / "statements.py"

# name: (file, the line(s) as they are, what they become)
BREAKS: dict[str, tuple[Path, str, str]] = {
    "fenced ops: one key twice in one batch": (
        B,
        "            if key in seen and self._distinct:\n",
        "            if False:\n",
    ),
    "claims: repeats of a key sent in the statement": (
        P,
        "        unique = list(first.values())\n",
        "        unique = batch\n",
    ),
    "a failed statement's waiters are not failed": (
        B,
        "                except StoreError as exc:\n                    _fail(batch, exc)\n",
        "                except StoreError as exc:\n                    pass\n",
    ),
    "a cancelled waiter cancels the batch": (
        B,
        "        return await future\n",
        "        try:\n            return await future\n        except asyncio.CancelledError:\n"
        "            assert self._task is not None\n            self._task.cancel()\n"
        "            raise\n",
    ),
    "an orphan's release sent before its claim landed": (
        P,
        "                await asyncio.wait((landing,))\n",
        "                pass\n",
    ),
    "no batch size bound": (
        B,
        "        while queue and len(batch) < self._max_size:\n",
        "        while queue:\n",
    ),
    "no token fence in batched statements": (
        S,
        "    return (_t.c.key == u.c.key) & (_t.c.token == u.c.token)"
        " & (_t.c.status == _IN_PROGRESS)\n",
        "    return (_t.c.key == u.c.key) & (_t.c.status == _IN_PROGRESS)\n",
    ),
    "rows in the way lost from a batch": (
        P,
        "                        by_key[row[0]] = _own(first[row[0]], tuple(row)[2:])\n",
        "                        by_key[row[0]] = _NOT_VISIBLE\n",
    ),
    "an extra round trip per batch": (
        P,
        "                rows = await self._locked_out(lambda c: c.fetch(stmt.sql, *args))\n"
        "                if rows is _ALONE:\n                    return [_ALONE] * len(batch)\n"
        "                for row in rows:\n",
        "                await self.inner._run(lambda c: c.fetchval('SELECT 1'))\n"
        "                rows = await self._locked_out(lambda c: c.fetch(stmt.sql, *args))\n"
        "                if rows is _ALONE:\n                    return [_ALONE] * len(batch)\n"
        "                for row in rows:\n",
    ),
    "an extra round trip for a request alone": (
        P,
        "                return [await self._claim_alone(values)]\n",
        "                await self.inner._run(lambda c: c.fetchval('SELECT 1'))\n"
        "                return [await self._claim_alone(values)]\n",
    ),
    "an extra round trip for a request alone in its own task": (
        P,
        "                return await self._claim_alone(values, backend)\n",
        "                await self.inner._run(lambda c: c.fetchval('SELECT 1'))\n"
        "                return await self._claim_alone(values, backend)\n",
    ),
}


def run(name: str) -> list[str]:
    path, old, new = BREAKS[name]
    source = path.read_text()
    if source.count(old) != 1:
        raise SystemExit(f"{name}: the line to break is not in {path.name} exactly once")
    path.write_text(source.replace(old, new))
    try:
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        out = subprocess.run(
            [*cmd, "tests/stores/test_batching.py"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        ).stdout
    finally:
        path.write_text(source)
    return [line.split("::", 1)[1] for line in out.splitlines() if line.startswith("FAILED")]


def main() -> int:
    uncaught = 0
    for name in sys.argv[1:] or BREAKS:
        failed = run(name)
        print(f"{'caught' if failed else 'NOT CAUGHT':10}  {name}")
        for test in failed:
            print(f"            failed: {test}")
        uncaught += not failed
    return 1 if uncaught else 0


if __name__ == "__main__":
    raise SystemExit(main())
