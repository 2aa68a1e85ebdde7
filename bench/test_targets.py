"""Issue #43's targets and the store server's CPU, as ``bench.run`` reads them; the lab's own
check, run by hand (``python -m pytest bench/test_targets.py``)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from bench import run
from bench.harness import postgres_processes, processes_cpu, redis_processes


def _cell(rps: float, p99: float, cpu: float, srv: float | None) -> dict[str, Any]:
    return {"rounds": [rps, rps], "p99_rounds_ms": [p99, p99], "cpu_rounds_us": [cpu, cpu],
            "store_cpu_rounds_us": [srv, srv]}  # fmt: skip


def test_each_target_is_a_ratio_of_two_variants_of_one_workload_against_its_bound() -> None:
    table = {
        "fresh": {
            "none": _cell(20000, 3, 100, None),
            "memory": _cell(10000, 6, 124, None),  # 1.24x no guard: PASS
            run.postgres_default(): _cell(4000, 10, 150, 60),
            "floor_pg": _cell(3000, 10, 170, 100),  # server 0.6x: PASS; req/s 1.33x: PASS
            "peer_idemkit_pg": _cell(2100, 20, 380, 300),  # req/s 1.90x: FAIL
        },
        "replay": {
            run.postgres_default(): _cell(10000, 2, 50, 10),
            "floor_pg": _cell(10000, 2, 70, 20),  # server 0.5x: FAIL (<= 0.4)
        },
    }
    found = {name: (ok, value) for name, ok, value in run.check_issue_43(table)}
    assert found["#43 guard's tax: app CPU/fresh, memory ÷ no guard <= 1.25"] == (True, "1.24x")
    assert found["#43 PG server CPU/fresh ÷ the fair floor's <= 0.6"] == (True, "0.60x")
    assert found["#43 PG server CPU/replay ÷ the fair floor's <= 0.4"] == (False, "0.50x")
    assert found["#43 PG default fresh: req/s ÷ fair floor >= 1.3"] == (True, "1.33x")
    assert found["#43 PG default fresh: req/s ÷ idemkit on PG >= 2.0"] == (False, "1.90x")
    # Targets whose variants did not run (Redis, idemkit replay) are not printed.
    assert not [name for name in found if "Redis" in name or "redis" in name]


def test_the_postgres_server_processes_are_found_and_read() -> None:
    pids = postgres_processes()
    if not pids:
        pytest.skip("no Postgres server on this machine")
    cpu = processes_cpu(pids)
    assert set(cpu) <= set(pids)
    assert all(t >= 0 for t in cpu.values())


def test_a_redis_server_is_found_by_its_port(tmp_path: Path) -> None:
    from bench.redis_server import redis_server

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH")
    with redis_server(tmp_path) as url:
        port = int(url.rsplit(":", 1)[1].split("/", 1)[0])
        pids = redis_processes(port)
        assert len(pids) == 1
