"""The shipped Prometheus rules and Grafana dashboard (``asgi_idempotency.ops``).

promtool checks the rules and runs their unit tests (tests/ops/alerts_test.yml) on
synthetic series, and every metric and label the files query is one the package
exports: a rule or panel on a name nothing exports is silently empty forever, which
no one notices until the alert it was meant to be should have fired.

promtool is not mocked: these tests fail, never skip, when it is missing (.ci/run
installs Debian's ``prometheus`` package, which has it).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]  # PyYAML ships no types; only dicts are read
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from asgi_idempotency import ops
from asgi_idempotency.observability.metrics import Outcome
from asgi_idempotency.observability.prometheus import PrometheusMetrics
from asgi_idempotency.stores.duplicates import SuspectedDuplicate
from tests.project.docs_text import docs_text

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "src" / "asgi_idempotency" / "ops" / "alerts.yml"
DASHBOARD = ROOT / "src" / "asgi_idempotency" / "ops" / "dashboard.json"
RULE_TESTS = ROOT / "tests" / "ops" / "alerts_test.yml"
NOW = datetime(2026, 12, 5, tzinfo=UTC)


def promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.fail(
            "promtool is not on PATH, so the shipped alert rules cannot be checked. "
            "Install it: apt-get install prometheus (Debian/Ubuntu; .ci/run does this), "
            "or put the promtool of a Prometheus release on PATH."
        )
    return subprocess.run(
        [exe, *map(str, args)], capture_output=True, text=True, timeout=120, check=False
    )


def assert_ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, f"{result.args}:\n{result.stdout}\n{result.stderr}"


# --- What the package exports: read from a real registry, not written down here.


def exported() -> tuple[set[str], set[str]]:
    """Sample names and label names of a PrometheusMetrics that has seen every outcome,
    a timed store operation, a take-over, a suspected regenerated key and an audit."""
    registry = CollectorRegistry()
    metrics = PrometheusMetrics(registry)
    for outcome in Outcome:
        metrics.observe("/orders/{order_id}", outcome)
    metrics.observe_store("claim", "SQLStore", 0.002)
    metrics.observe_takeover("/orders/{order_id}")
    metrics.observe_regenerated_key("/orders/{order_id}")
    metrics.observe_audit(
        [SuspectedDuplicate("/orders/{order_id}", "s" * 64, "h" * 64, 2, 2, NOW, NOW)]
    )
    names: set[str] = set()
    labels: set[str] = set()
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            names.add(sample.name)
            labels.update(sample.labels)
    return names, labels


# --- What the files query.

# Words of PromQL that look like metric names where they stand.
KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "group_left", "group_right"}
MODIFIER = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
MATCHERS = re.compile(r"\{([^}]*)\}")
# A label matcher: name, operator, quoted value.
MATCHER = re.compile(r'([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
# A name that does not continue a word, a number, a $variable or a {{template}}, and is
# not a function call: what is left of it once matchers and ranges are gone.
NAME = re.compile(r"(?<![\w:$.])([A-Za-z_:][\w:]*)(?![\w:])(?!\s*\()")


def metric_names(expr: str) -> set[str]:
    """Every metric name an expression selects."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings hold values, not names
    bare = MATCHERS.sub("", bare)
    bare = re.sub(r"\[[^\]]*\]", "", bare)  # ranges: 5m, $__rate_interval
    bare = MODIFIER.sub("", bare)  # label names
    return {name for name in NAME.findall(bare) if name not in KEYWORDS}


def label_names(expr: str) -> set[str]:
    """Every label name an expression matches on or aggregates by."""
    found = {m.group(1) for block in MATCHERS.findall(expr) for m in MATCHER.finditer(block)}
    for group in MODIFIER.findall(expr):
        found.update(name.strip() for name in group.split(",") if name.strip())
    return found


def outcome_values(expr: str) -> set[str]:
    """The outcome values an expression names with = or != (not regexes)."""
    return {
        m.group(3)
        for block in MATCHERS.findall(expr)
        for m in MATCHER.finditer(block)
        if m.group(1) == "outcome" and m.group(2) in ("=", "!=")
    }


def rules() -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def rule_exprs() -> Iterator[tuple[str, str]]:
    for rule in rules():
        yield rule.get("record") or rule["alert"], rule["expr"]


LABEL_VALUES = re.compile(r"^label_values\(\s*(?:(.+?)\s*,\s*)?(\w+)\s*\)$")


def dashboard_exprs() -> Iterator[tuple[str, str]]:
    """Every panel's PromQL, and the metric a template variable lists values of."""
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield f"{panel['title']} {target['refId']}", target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]
        text = query["query"] if isinstance(query, dict) else query
        m = LABEL_VALUES.match(text)
        assert m, f"variable {variable['name']}: a query this test cannot read: {text}"
        if m.group(1):
            yield f"${variable['name']}", f"count by ({m.group(2)}) ({m.group(1)})"


# --- promtool


def test_the_packaged_rules_are_the_ones_tested() -> None:
    # The unit tests name the source file; what an installed package reads is the
    # resource. They are the same file, so testing one tests the other.
    assert ops.ALERTS.read_text() == RULES.read_text()
    assert ops.DASHBOARD.read_text() == DASHBOARD.read_text()


def test_promtool_checks_the_rules() -> None:
    result = promtool("check", "rules", "--lint=all", "--lint-fatal", RULES)
    assert_ok(result)
    assert "SUCCESS" in result.stdout


def test_promtool_runs_the_rule_unit_tests() -> None:
    # The seed scenario among them: 0.4% replays for a day fire nothing, 22% fires the
    # spike alert; one mismatch fires the conflict alert.
    result = promtool("test", "rules", RULE_TESTS)
    assert_ok(result)
    assert "SUCCESS" in result.stdout


def test_every_alert_is_seen_firing_in_the_unit_tests() -> None:
    alerts = {rule["alert"] for rule in rules() if "alert" in rule}
    fired = {
        case["alertname"]
        for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert alerts == fired


def test_every_alert_tells_the_operator_what_it_means_and_what_to_do() -> None:
    for rule in rules():
        if "alert" not in rule:
            continue
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
        # "What to do" is the description's job: it names where to look.
        assert len(rule["annotations"]["description"]) > 200, rule["alert"]


def test_the_dashboard_queries_are_promql(tmp_path: Path) -> None:
    # Grafana is not here to run them, but Prometheus' parser is: each query becomes a
    # recording rule, with Grafana's variables replaced by what Grafana would put there.
    grafana = {"$__rate_interval": "5m", "$__range": "6h", "$route": ".*"}
    recorded = []
    for i, (_, expr) in enumerate(dashboard_exprs()):
        for var, value in grafana.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, expr
        recorded.append({"record": f"dashboard:query{i}", "expr": expr})
    rule_file = tmp_path / "dashboard_queries.yml"
    rule_file.write_text(yaml.safe_dump({"groups": [{"name": "q", "rules": recorded}]}))
    assert_ok(promtool("check", "rules", rule_file))


def test_the_dashboard_panels_use_the_datasource_variable() -> None:
    # So that an imported dashboard asks which Prometheus to read, instead of pointing
    # at a datasource uid from somebody else's Grafana.
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "asgi-idempotency"
    titles = set()
    for panel in dashboard["panels"]:
        titles.add(panel["title"])
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    assert {
        "Requests by outcome",
        "Replay rate by route",
        "Conflict rate by route",
        "Store unavailable by route",
        "In progress (409) by route",
    } <= titles


# --- Only exported names


def test_the_name_extraction_finds_what_it_must() -> None:
    expr = (
        'sum by (route) (rate(idempotency_requests_total{outcome="replayed", route=~"$route"}'
        "[$__rate_interval])) / on (route) group_left made_up:ratio_rate5m offset 5m"
        ' > bool 0.5e3 and made_up_total unless vector(0) or label_replace(x, "a", "$1", "b", ".*")'
    )
    assert metric_names(expr) == {
        "idempotency_requests_total",
        "made_up:ratio_rate5m",
        "made_up_total",
        "x",
    }
    assert label_names(expr) == {"route", "outcome"}
    assert outcome_values(expr) == {"replayed"}


def test_every_metric_the_files_query_is_exported() -> None:
    names, _ = exported()
    assert "idempotency_requests_total" in names  # the registry was read
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    # The rules may use each other's results; the dashboard only the raw counter, so
    # it works without the rules loaded.
    sources = [(f"alerts.yml {n}", e, names | recorded) for n, e in rule_exprs()] + [
        (f"dashboard.json {n}", e, names) for n, e in dashboard_exprs()
    ]
    unknown = {
        (where, name)
        for where, expr, known in sources
        for name in metric_names(expr)
        if name not in known
    }
    assert not unknown, f"queried but not exported: {sorted(unknown)}"
    # Every query was read: an extraction that finds nothing would pass the above.
    assert all(metric_names(expr) for _, expr, _ in sources)


def test_every_label_and_outcome_the_files_query_is_exported() -> None:
    # A typo in a label or outcome value (outcome="replay") empties a query as surely
    # as a made-up metric name.
    _, labels = exported()
    outcomes = {o.value for o in Outcome}
    for where, expr in [*rule_exprs(), *dashboard_exprs()]:
        assert label_names(expr) <= labels, (where, label_names(expr) - labels)
        assert outcome_values(expr) <= outcomes, (where, outcome_values(expr) - outcomes)


# --- The README's "Alerts and dashboard" section says what the files do


def readme_alerts_section() -> str:
    text = docs_text()
    start = text.index("\n#### Alerts and dashboard\n")
    return text[start : text.index("\n#### ", start + 1)]


def test_the_readme_alert_table_matches_the_rules() -> None:
    section = readme_alerts_section()
    rows = {
        cells[0].strip("`"): (cells[2], cells[3])
        for line in section.splitlines()
        if line.startswith("| `Idempotency")
        for cells in [[c.strip() for c in line.strip().strip("|").split(" | ")]]
    }
    in_rules = {
        rule["alert"]: (rule.get("for", "0m"), rule["labels"]["severity"])
        for rule in rules()
        if "alert" in rule
    }
    assert rows == in_rules
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    named = set(re.findall(r"`(route:[\w:]+)`", section))
    assert named
    assert named <= recorded


def test_the_readme_commands_copy_the_files_out() -> None:
    commands = re.findall(r'^python -c "(.+?)" > ', readme_alerts_section(), re.M)
    assert len(commands) == 2
    outputs = [
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
        for code in commands
    ]
    assert outputs == [RULES.read_text(), DASHBOARD.read_text()]
