"""A toy agent run for test_resumed_run.py, executed as its own process.

Seven tool calls, each a POST through IdempotentTransport under a key derived from
(run id, step index, tool, args). The run id and the number of finished steps live
in a JSON file; nothing else survives the process. A resumed run replays its plan
from the start, as an agent whose transcript died with the process must, and relies
on the keys to turn the repeated calls into replays.

    python _agent.py STATE BASE_URL EFFECTS [--crash-after N] [--renumber]

``--renumber`` is the bug the second test shows: numbering steps on resume by
continuing the persisted counter instead of by position in the plan.
Prints one JSON line per step: step, key, replayed, effects so far.
"""

from __future__ import annotations

import argparse
import json
import os
import uuid
from pathlib import Path

import httpx

from asgi_idempotency.client import (
    IDEMPOTENCY_KEY_HEADER,
    IdempotentTransport,
    RetryPolicy,
    derive_key,
)

PLAN = [
    ("lookup_order", {"order_id": "ord_7"}),
    ("refund", {"order_id": "ord_7", "amount": 4500, "currency": "EUR"}),
    ("notify", {"to": "customer", "template": "refund"}),
    ("refund", {"order_id": "ord_8", "amount": 1200, "currency": "EUR"}),
    ("notify", {"to": "customer", "template": "refund", "order_id": "ord_8"}),
    ("ticket", {"queue": "finance", "summary": "two refunds"}),
    ("close_run", {}),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("state", type=Path)
    parser.add_argument("base_url")
    parser.add_argument("effects", type=Path)
    parser.add_argument("--crash-after", type=int, default=None)
    parser.add_argument("--renumber", action="store_true")
    args = parser.parse_args()

    if args.state.exists():
        state = json.loads(args.state.read_text())
    else:
        state = {"run_id": f"run_{uuid.uuid4().hex}", "steps_done": 0}
        _save(args.state, state)
    # The bug under --renumber: a resumed run keeps counting from where it stopped.
    offset = state["steps_done"] if args.renumber else 0

    policy = RetryPolicy(attempts=5, timeout=10.0, wait_initial=0.05, wait_max=0.2)
    transport = IdempotentTransport(policy=policy)
    with httpx.Client(transport=transport, base_url=args.base_url, timeout=5.0) as http:
        for position, (tool, tool_args) in enumerate(PLAN, start=1):
            step = offset + position
            key = derive_key(state["run_id"], step, tool, tool_args)
            body = {"tool": tool, "args": tool_args}
            response = http.post("/refunds", json=body, headers={IDEMPOTENCY_KEY_HEADER: key})
            response.raise_for_status()
            state["steps_done"] = max(state["steps_done"], step)
            _save(args.state, state)
            effects = len(args.effects.read_text().splitlines())
            replayed = response.headers.get("idempotent-replayed") == "true"
            line = {"step": position, "key": key, "replayed": replayed, "effects": effects}
            print(json.dumps(line), flush=True)
            if args.crash_after == position:
                os._exit(70)  # a crash: no cleanup, every Python object gone


def _save(path: Path, state: dict[str, object]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(path)  # atomic: a crash never leaves half a state file


if __name__ == "__main__":
    main()
