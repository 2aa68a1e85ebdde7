"""The README's configuration and operations tables say what the code does.

Each table is parsed and compared with the code it documents: ``Policy``'s fields and
defaults, the middleware's and ``SQLStore``'s signatures, the log events the package
emits, the CLI's exit codes and the environment variables.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from asgi_idempotency import IdempotencyMiddleware, Policy, SQLStore, idempotent
from asgi_idempotency.core.errors import IdempotencyError
from asgi_idempotency.integrations.webhooks import github
from asgi_idempotency.observability.metrics import Outcome
from asgi_idempotency.ops.cli import Exit
from asgi_idempotency.stores.urls import ENV_URL
from tests.project.docs_text import docs_text

ROOT = Path(__file__).resolve().parents[2]
README = docs_text()  # the README and the docs pages
SOURCES = sorted((ROOT / "src").rglob("*.py"))


def table_after(header: str) -> list[list[str]]:
    """The rows (cells stripped) of the markdown table whose header line is ``header``."""
    lines = README.splitlines()
    start = lines.index(header) + 2  # the header, then the |---| line
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows


def _default(text: str) -> Any:
    if m := re.fullmatch(r"`(.+)`", text):
        return ast.literal_eval(m.group(1))
    if m := re.fullmatch(r"(\d+) h", text):
        return timedelta(hours=int(m.group(1)))
    if m := re.fullmatch(r"(\d+) MiB", text):
        return int(m.group(1)) * 1024 * 1024
    raise AssertionError(f"a default the test cannot read: {text!r}")


def policy_table() -> dict[str, str]:
    rows = table_after("| field | default | meaning |")
    return {row[0].strip("`"): row[1] for row in rows}


def test_the_policy_table_lists_every_field_of_policy() -> None:
    fields = [f.name for f in dataclasses.fields(Policy) if f.init]
    assert sorted(policy_table()) == sorted(fields)


def test_the_policy_table_gives_the_defaults_policy_has() -> None:
    plain = Policy()
    for name, text in policy_table().items():
        if name == "lease":
            assert text == "the smaller of 30 s and `ttl`"
            assert plain.lease == timedelta(seconds=30)
            assert Policy(ttl=timedelta(seconds=1)).lease == timedelta(seconds=1)
            continue
        if name == "max_body_bytes":
            assert text == "1 MiB; 25 MB with `key_from=github(...)`"
            assert plain.max_body_bytes == 1024 * 1024
            assert Policy(key_from=github("s")).max_body_bytes == 25 * 1024 * 1024
            continue
        assert getattr(plain, name) == _default(text), name


def test_idempotent_takes_policys_fields_with_its_defaults() -> None:
    fields = {f.name: f.default for f in dataclasses.fields(Policy) if f.init}
    params = inspect.signature(idempotent).parameters
    assert list(params) == list(fields)
    for name, param in params.items():
        assert param.default == fields[name], name


def _documented_signature(name: str) -> ast.arguments:
    """``Name(a, *, b=1, ...)`` as the README prints it, parsed as a function's arguments."""
    match = re.search(rf"`{name}\((\w+, \*, .+?)\)`", README)  # the full signature
    assert match is not None, f"the README shows no signature of {name}"
    module = ast.parse(f"def f({match.group(1)}): pass")
    function = module.body[0]
    assert isinstance(function, ast.FunctionDef)
    return function.args


@pytest.mark.parametrize(
    ("name", "target"),
    [("IdempotencyMiddleware", IdempotencyMiddleware.__init__), ("SQLStore", SQLStore.__init__)],
)
def test_the_documented_signatures_are_the_real_ones(name: str, target: Any) -> None:
    documented = _documented_signature(name)
    real = [p for p in inspect.signature(target).parameters.values() if p.name != "self"]
    positional = [a.arg for a in documented.args]
    keyword = [a.arg for a in documented.kwonlyargs]
    assert positional + keyword == [p.name for p in real]
    assert keyword == [p.name for p in real if p.kind is p.KEYWORD_ONLY]
    for arg, default in zip(documented.kwonlyargs, documented.kw_defaults, strict=True):
        actual = inspect.signature(target).parameters[arg.arg].default
        if default is None:
            assert actual is inspect.Parameter.empty, f"{name}: {arg.arg} has a default"
        elif isinstance(default, ast.Constant) and default.value is Ellipsis:
            continue  # "clock=...": documented elsewhere in words
        elif isinstance(default, ast.Name):
            assert getattr(actual, "__name__", None) == default.id, arg.arg
        else:
            assert actual == ast.literal_eval(default), arg.arg


def test_the_log_events_table_lists_every_event_the_package_emits() -> None:
    emitted = {
        event
        for source in SOURCES
        for event in re.findall(r"\"(idempotency\.[a-z_]+)\"", source.read_text())
    }
    rows = table_after("| event (message) | level | fields |")
    documented = {row[0].strip("`") for row in rows}
    assert documented == emitted


def test_the_exit_codes_table_is_the_clis() -> None:
    rows = table_after("| code | meaning |")
    assert [int(row[0]) for row in rows] == [int(code) for code in Exit]


def test_the_environment_variables_named_are_the_ones_read() -> None:
    code = "\n".join(
        p.read_text()
        for p in [*SOURCES, ROOT / "tests" / "conftest.py", *ROOT.glob("examples/*.py")]
    )
    named = set(re.findall(r"\bIDEMPOTENCY_[A-Z_]+\b", README))
    assert ENV_URL in named
    assert {n for n in named if n not in code} == set()
    # The examples read the one database variable the CLI and alembic read, if any.
    for example in ROOT.glob("examples/*.py"):
        assert set(re.findall(r"\bIDEMPOTENCY_[A-Z_]+\b", example.read_text())) <= {ENV_URL}


def test_the_startup_message_names_the_command_the_readme_names() -> None:
    from asgi_idempotency.stores.sql import store as sql

    command = "asgi-idempotency migrate --database-url"
    assert command in README
    assert command in inspect.getsource(sql.SQLStore.prepare)


def _answers(cls: type[IdempotencyError]) -> list[type[IdempotencyError]]:
    return [cls, *(sub for child in cls.__subclasses__() for sub in _answers(child))]


def test_the_readme_lists_every_problem_type_the_guard_answers() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"with a stable `type` \(`urn:asgi-idempotency:problem:(.+?)\)", readme)
    assert match is not None, "the README lists no problem types"
    documented = re.findall(r"[a-z-]+", match.group(1))
    slugs = {cls.slug for cls in _answers(IdempotencyError) if cls is not IdempotencyError}
    assert sorted(documented) == sorted(slugs)


def test_the_outcomes_table_lists_every_outcome_and_counts_the_series() -> None:
    rows = table_after("| outcome | what happened | status |")
    assert [row[0].strip("`") for row in rows] == [outcome.value for outcome in Outcome]
    assert f"guarded routes \N{MULTIPLICATION SIGN} {len(Outcome)}." in README
