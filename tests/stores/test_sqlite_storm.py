"""Several processes claim the same keys on one SQLite file at once: each key has one owner.

Every process runs its own store (its own connection thread, batching what queues)
and they contend for SQLite's one write lock; ``busy_timeout`` makes them wait for it
rather than fail. Complements the HTTP storm in ``tests/http/test_concurrency.py``, which
sends one key to four uvicorn workers: here many keys, shared and not, interleave.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path

from sqlalchemy.engine import make_url

ROOT = Path(__file__).resolve().parents[2]
PROCESSES, SHARED, OWN = 4, 60, 60


def test_a_multi_process_storm_on_one_file(sqlite_url: str) -> None:
    names = [f"p{i}" for i in range(PROCESSES)]
    worker = [sys.executable, "-m", "tests.stores._sqlite_storm_worker", sqlite_url]
    procs = [
        subprocess.Popen(
            [*worker, name, str(SHARED), str(OWN)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for name in names
    ]
    results: dict[str, dict[str, object]] = {}
    try:
        for proc in procs:  # all connected, then all at once
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        for name, proc in zip(names, procs, strict=True):
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0
            results[name] = json.loads(out.strip().splitlines()[-1])
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()

    assert {name: r["errors"] for name, r in results.items()} == {name: [] for name in names}
    owners: dict[str, list[str]] = {}
    for name, r in results.items():
        outcomes = r["outcomes"]
        assert isinstance(outcomes, dict)
        for key, outcome in outcomes.items():
            if outcome == "claimed":
                owners.setdefault(key, []).append(name)
            else:
                assert key.startswith("shared-"), (key, outcome)
                assert outcome in ("in_progress", "completed"), (key, outcome)
    shared = {f"shared-{i}" for i in range(SHARED)}
    assert {k: len(v) for k, v in owners.items() if k in shared} == dict.fromkeys(shared, 1)
    assert Counter(k.split("-")[1] for k in owners if k.startswith("own-")) == dict.fromkeys(
        names, OWN
    )

    database = make_url(sqlite_url).database
    assert database is not None
    with sqlite3.connect(database) as conn:
        rows = conn.execute("SELECT key, status, response_body FROM idempotency_records").fetchall()
    conn.close()
    assert len(rows) == SHARED + PROCESSES * (OWN + 1)
    assert {status for _, status, _ in rows} == {"completed"}
    # Each shared key's stored response is its one owner's.
    for key, _, body in rows:
        if key in shared:
            assert [bytes(body).decode()] == owners[key]
