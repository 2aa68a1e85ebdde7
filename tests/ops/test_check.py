"""``asgi-idempotency check`` over real uvicorn: each check fails on an app built to break it.

The ``flawed`` app (tests/ops/check_apps.py) conforms until a request names a flaw in
``X-Flaws``; the ``guarded`` app is our middleware, per caller, on one scope for every
caller (``ANONYMOUS``), or absent.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from asgi_idempotency.ops.check import CHECKS
from asgi_idempotency.ops.cli import Exit, main
from tests.helpers.serving import UvicornProcess, run_uvicorn

from .check_apps import FLAWED, FLAWS, GUARDED

BODY = ("--json", '{"amount": 4500}', "--header", "X-API-Key: key-a")
# Everything the optional checks need: a second caller, a slow endpoint, a fault switch.
FULL = (
    "--other-caller-header", "X-API-Key: key-b",
    "--slow-url", "/slow-refunds",
    "--fail-header", "X-Fail: 1",
)  # fmt: skip
ROOT = Path(__file__).resolve().parents[2]


def _serve(app: str, tmp: pytest.TempPathFactory, **env: str) -> Iterator[UvicornProcess]:
    with run_uvicorn(app, env=env, log_dir=tmp.mktemp("check")) as server:
        yield server


@pytest.fixture(scope="module")
def flawed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UvicornProcess]:
    yield from _serve(FLAWED, tmp_path_factory)


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UvicornProcess]:
    yield from _serve(GUARDED, tmp_path_factory, CHECK_APP_GUARD="caller")


def check(capsys: pytest.CaptureFixture[str], url: str, *args: str) -> tuple[int, dict[str, Any]]:
    code = main(["check", url, *BODY, *args, "--format", "json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def outcomes(report: dict[str, Any]) -> dict[str, str]:
    return {c["name"]: c["outcome"] for c in report["checks"]}


@pytest.mark.slow
def test_our_guard_passes_every_check_through_the_command(guarded: UvicornProcess) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "asgi_idempotency.ops.cli", "check", guarded.base_url + "/refunds",
         *BODY, *FULL],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == Exit.OK, done.stdout + done.stderr
    assert "12 passed, 0 failed, 0 not run" in done.stdout
    for name, _ in CHECKS:
        assert f"\n{name} " in done.stdout


@pytest.mark.slow
def test_the_flawed_app_without_a_flaw_passes_every_check(
    capsys: pytest.CaptureFixture[str], flawed: UvicornProcess
) -> None:
    code, report = check(capsys, flawed.base_url + "/refunds", *FULL)
    assert code == Exit.OK, report
    assert set(outcomes(report).values()) == {"pass"}, report


def test_every_check_has_a_flaw_that_breaks_it() -> None:
    assert sorted(FLAWS.values()) == sorted(name for name, _ in CHECKS)


@pytest.mark.slow
@pytest.mark.parametrize(("flaw", "name"), FLAWS.items())
def test_each_check_fails_on_the_app_built_to_violate_it(
    capsys: pytest.CaptureFixture[str], flawed: UvicornProcess, flaw: str, name: str
) -> None:
    code, report = check(
        capsys, flawed.base_url + "/refunds", *FULL, "--header", f"X-Flaws: {flaw}"
    )
    assert code == Exit.NOT_FOUND, report
    assert name in report["failed"], report


@pytest.mark.slow
def test_replay_marked_fails_on_unmarked_replays(
    capsys: pytest.CaptureFixture[str], flawed: UvicornProcess
) -> None:
    code, report = check(capsys, flawed.base_url + "/refunds", "--header", "X-Flaws: no-mark")
    assert code == Exit.NOT_FOUND
    assert report["failed"] == ["replay-marked"], report


@pytest.mark.slow
def test_a_count_url_catches_a_claim_after_the_effect(
    capsys: pytest.CaptureFixture[str], flawed: UvicornProcess
) -> None:
    url = flawed.base_url + "/refunds"
    code, report = check(capsys, url, "--count-url", "/refunds/count", "--storm", "6")
    assert code == Exit.OK
    storm = next(c for c in report["checks"] if c["name"] == "storm-one-effect")
    assert storm["detail"].endswith("1 effect counted"), storm
    code, report = check(
        capsys, url, "--count-url", "/refunds/count", "--storm", "6", "--header",
        "X-Flaws: claim-after",
    )  # fmt: skip
    assert code == Exit.NOT_FOUND
    storm = next(c for c in report["checks"] if c["name"] == "storm-one-effect")
    assert storm["outcome"] == "fail"
    # Each of the 6 ran unless it arrived after the first had finished (a loaded machine).
    effects = re.search(r"(\d+) effects counted", storm["detail"])
    assert effects is not None, storm
    assert int(effects.group(1)) >= 2, storm


@pytest.mark.slow
def test_an_unguarded_app_fails_the_checks_that_need_a_guard(
    capsys: pytest.CaptureFixture[str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    for server in _serve(GUARDED, tmp_path_factory, CHECK_APP_GUARD="none"):
        code, report = check(capsys, server.base_url + "/refunds", *FULL)
    assert code == Exit.NOT_FOUND
    assert set(report["failed"]) == {
        "replay", "storm-one-effect", "quoted-key", "key-reuse", "key-list",
        "two-key-headers", "missing-key", "in-flight-409",
    }, report  # fmt: skip
    assert outcomes(report)["replay-marked"] == "not run"


@pytest.mark.slow
def test_a_guard_that_replays_across_callers_fails_the_cross_caller_check(
    capsys: pytest.CaptureFixture[str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    for server in _serve(GUARDED, tmp_path_factory, CHECK_APP_GUARD="anonymous"):
        code, report = check(capsys, server.base_url + "/refunds", *FULL)
    assert code == Exit.NOT_FOUND
    assert report["failed"] == ["other-caller"], report


def _received(server: UvicornProcess) -> int:
    count = httpx.get(server.base_url + "/requests", timeout=10).json()["count"]
    assert isinstance(count, int)
    return count


@pytest.mark.slow
@pytest.mark.parametrize("limit", [1, 5, 13, 16, 24])
def test_it_never_sends_more_than_max_requests(
    capsys: pytest.CaptureFixture[str], flawed: UvicornProcess, limit: int
) -> None:
    before = _received(flawed)
    code, report = check(
        capsys, flawed.base_url + "/refunds", *FULL, "--count-url", "/refunds/count",
        "--max-requests", str(limit),
    )  # fmt: skip
    received = _received(flawed) - before
    # The count URL's GETs are requests too, counted here by the report (the server's
    # counter leaves its own paths out).
    counts = 2 if outcomes(report)["storm-one-effect"] != "not run" else 0
    assert received + counts == report["requests_sent"] <= limit
    assert code == Exit.OK  # checks that would exceed the budget are not run, not failed
    skipped = [c for c in report["checks"] if c["outcome"] == "not run"]
    assert skipped
    assert all("--max-requests" in c["detail"] for c in skipped), skipped


@pytest.mark.slow
def test_it_follows_no_redirect_to_another_origin(
    capsys: pytest.CaptureFixture[str], flawed: UvicornProcess, guarded: UvicornProcess
) -> None:
    before = _received(guarded)
    elsewhere = f"{flawed.base_url}/elsewhere?to={guarded.base_url}/refunds"
    code, report = check(capsys, elsewhere, *FULL)
    assert code == Exit.NOT_FOUND
    assert report["failed"] == ["first-request"]
    assert "307" in report["checks"][0]["detail"]
    assert _received(guarded) == before  # the redirect's target never heard from it


@pytest.mark.slow
def test_checks_without_their_input_are_not_run_and_say_why(
    capsys: pytest.CaptureFixture[str], flawed: UvicornProcess
) -> None:
    code, report = check(capsys, flawed.base_url + "/fast-and-plain")
    assert code == Exit.NOT_FOUND  # 404: the first request fails, nothing else runs
    assert report["failed"] == ["first-request"]
    # The first answers in 0.2 s, well within --hold: too fast to overlap a duplicate.
    code, report = check(capsys, flawed.base_url + "/refunds", "--key-optional", "--hold", "3")
    assert code == Exit.OK
    why = {c["name"]: c["detail"] for c in report["checks"] if c["outcome"] == "not run"}
    assert set(why) == {"other-caller", "missing-key", "5xx-releases-key", "in-flight-409"}
    assert "--other-caller-header" in why["other-caller"]
    assert "--key-optional" in why["missing-key"]
    assert "--fail-header" in why["5xx-releases-key"]
    assert "--slow-url" in why["in-flight-409"]


@pytest.mark.slow
def test_the_table_names_each_failing_check(
    capsys: pytest.CaptureFixture[str], flawed: UvicornProcess
) -> None:
    flaw = "X-Flaws: no-mark,lists-ok"
    code = main(["check", flawed.base_url + "/refunds", *BODY, "--header", flaw])
    out = capsys.readouterr().out
    assert code == Exit.NOT_FOUND
    assert out.splitlines()[-1] == "failed: replay-marked, key-list"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["http://127.0.0.1:9/x", "--count-url", "http://other.example/count"], "not on"),
        (["http://127.0.0.1:9/x", "--slow-url", "https://127.0.0.1:9/slow"], "not on"),
        (["http://127.0.0.1:9/x", "--storm", "1"], "--storm"),
        (["http://127.0.0.1:9/x", "--max-requests", "0"], "--max-requests"),
        (["http://127.0.0.1:9/x", "--json", "{not json"], "--json"),
        (["http://127.0.0.1:9/x", "--json", "{}", "--data", "a=1"], "not allowed"),
        (["http://127.0.0.1:9/x", "--header", "no colon"], "--header"),
        (["http://127.0.0.1:9/x", "--header", "Idempotency-Key: k"], "own keys"),
        (["http://127.0.0.1:9/x", "--other-caller-header", "idempotency-key: k"], "own keys"),
        (["ftp://127.0.0.1/x"], "http"),
        ([], "URL"),
    ],
)
def test_usage_errors_exit_2(
    capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    assert main(["check", *args]) == Exit.USAGE
    assert says in capsys.readouterr().err


def test_without_httpx_it_names_the_extra_to_install() -> None:
    blocked = (
        "import sys; sys.modules['httpx'] = None; "
        "from asgi_idempotency.ops.cli import main; sys.exit(main(['check', 'http://127.0.0.1:9/']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", blocked], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == Exit.USAGE, done.stderr
    assert "pip install 'asgi-idempotency[client]'" in done.stderr
