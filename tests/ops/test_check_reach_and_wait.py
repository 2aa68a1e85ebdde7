"""``asgi-idempotency check``: an origin it cannot reach is exit 2 with one line (not a
failed check); ``--expect-wait`` judges a route with ``Policy(wait=...)`` by the wait it
promises; counts read "1 request". Against real uvicorn processes."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from asgi_idempotency.ops.cli import Exit, main
from tests.helpers.serving import UvicornProcess, run_uvicorn

from .wait_apps import WAITING

BODY = ("--json", '{"amount": 4500}')


@pytest.fixture(scope="module")
def waiting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UvicornProcess]:
    with run_uvicorn(WAITING, env={}, log_dir=tmp_path_factory.mktemp("wait")) as server:
        yield server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _unreachable(capsys: pytest.CaptureFixture[str], url: str, *args: str) -> str:
    assert main(["check", url, *BODY, *args]) == Exit.USAGE
    captured = capsys.readouterr()
    assert captured.out == ""  # no table: nothing was checked
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


def test_a_refused_connection_is_exit_2_naming_the_origin_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    port = _free_port()
    line = _unreachable(capsys, f"http://alice:s3cret@127.0.0.1:{port}/refunds?token=t0k")
    assert line == (
        f"asgi-idempotency check: cannot reach http://127.0.0.1:{port}: connection refused"
    )
    for secret in ("alice", "s3cret", "t0k", "/refunds"):
        assert secret not in line


def test_a_name_that_does_not_resolve_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    line = _unreachable(capsys, "https://no-such-host.invalid/refunds", "--format", "json")
    assert line.startswith("asgi-idempotency check: cannot reach https://no-such-host.invalid:443")
    assert "did not resolve" in line


@pytest.mark.slow
def test_a_tls_failure_is_exit_2(
    capsys: pytest.CaptureFixture[str], waiting: UvicornProcess
) -> None:
    # https:// to a server that speaks plain HTTP: the handshake fails.
    url = waiting.base_url.replace("http://", "https://") + "/waits"
    line = _unreachable(capsys, url)
    assert line.startswith(f"asgi-idempotency check: cannot reach {url.rsplit('/', 1)[0]}")
    assert "TLS failed" in line


def _check(capsys: pytest.CaptureFixture[str], url: str, *args: str) -> tuple[int, Any]:
    code = main(["check", url, *BODY, "--format", "json", *args])
    return code, json.loads(capsys.readouterr().out)


def _outcome(report: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any] = next(c for c in report["checks"] if c["name"] == name)
    return found


@pytest.mark.slow
def test_expect_wait_passes_a_route_that_waits_and_fails_one_that_answers_409(
    capsys: pytest.CaptureFixture[str], waiting: UvicornProcess
) -> None:
    waits = waiting.base_url + "/waits"
    code, report = _check(capsys, waits, "--expect-wait", "--storm", "3")
    wait = _outcome(report, "in-flight-wait")
    assert wait["outcome"] == "pass", wait
    assert "Idempotent-Replayed: true" in wait["detail"]
    assert "in-flight-409" not in {c["name"] for c in report["checks"]}
    assert code == Exit.OK, report
    # Without the flag, as before: the wait is not the draft's 409, and the detail says
    # which flag asks for it.
    code, report = _check(capsys, waits, "--storm", "3")
    in_flight = _outcome(report, "in-flight-409")
    assert (code, in_flight["outcome"]) == (Exit.NOT_FOUND, "fail"), report
    assert "--expect-wait" in in_flight["detail"]
    # A route that answers 409 at once fails the wait it was said to make.
    code, report = _check(capsys, waiting.base_url + "/answers-409", "--expect-wait")
    wait = _outcome(report, "in-flight-wait")
    assert (code, wait["outcome"]) == (Exit.NOT_FOUND, "fail"), report
    assert "409" in wait["detail"]
    assert "instead of waiting" in wait["detail"]


@pytest.mark.slow
def test_one_request_is_one_request(
    capsys: pytest.CaptureFixture[str], waiting: UvicornProcess
) -> None:
    url = waiting.base_url + "/waits"
    assert main(["check", url, *BODY, "--max-requests", "2", "--key-optional"]) == Exit.OK
    out = capsys.readouterr().out
    assert "needs 1 request, 0 left of --max-requests" in out, out
    assert "2 requests sent (at most 2)" in out
    assert main(["check", url, *BODY, "--max-requests", "1"]) == Exit.OK
    out = capsys.readouterr().out
    assert "; 1 request sent (at most 1)" in out, out
    assert "1 requests" not in out


@pytest.mark.anyio
async def test_check_app_takes_expect_wait_in_process() -> None:
    from asgi_idempotency.testing import Outcome, check_app

    from .wait_apps import app

    options: dict[str, Any] = {"json": {"amount": 1}, "storm": 2, "expect_wait": True}
    report = await check_app(app, "/waits", **options)
    assert report.result("in-flight-wait").outcome is Outcome.PASS, report.table()
    report = await check_app(app, "/answers-409", **options)
    assert report.result("in-flight-wait").outcome is Outcome.FAIL, report.table()


@pytest.mark.slow
def test_the_report_never_prints_the_urls_credentials(
    capsys: pytest.CaptureFixture[str], waiting: UvicornProcess
) -> None:
    url = waiting.base_url.replace("http://", "http://alice:s3cret@") + "/waits"
    assert main(["check", url, *BODY, "--max-requests", "1"]) == Exit.OK
    out = capsys.readouterr().out
    assert f"to {waiting.base_url}/waits" in out
    assert "alice" not in out
    assert "s3cret" not in out
