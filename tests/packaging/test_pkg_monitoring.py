"""Grafana dashboard and Prometheus alert rules in deploy/monitoring.

PromQL is parsed by Prometheus itself (`promtool`, Debian package `prometheus`) when it is installed:
every dashboard query becomes a recording rule for `promtool check rules`, and the alerts run through
`promtool test rules` with the cases in alerts_unittest.yaml.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from pkg_k8s import parse_manifests, validate_objects
from pkg_sources import REPO_ROOT

MONITORING_DIR = REPO_ROOT / "deploy" / "monitoring"
DASHBOARD_FILE = MONITORING_DIR / "grafana-dashboard.json"
RULE_FILE = MONITORING_DIR / "prometheusrule.yaml"
ALERT_CASES = Path(__file__).with_name("alerts_unittest.yaml")

ROUTER_METRICS = {
    "splitserve_router_queue_depth",
    "splitserve_router_inflight_requests",
    "splitserve_router_requests_total",
    "splitserve_router_ttft_seconds_bucket",
    "splitserve_router_itl_seconds_bucket",
    "splitserve_router_e2e_seconds_bucket",
    "splitserve_router_kv_handoff_seconds_bucket",
    "splitserve_router_fallbacks_total",
    "splitserve_router_retries_total",
    "splitserve_router_ejections_total",
}
OPERATOR_METRICS = {"splitserve_autoscaler_desired_replicas", "splitserve_autoscaler_prometheus_up"}
WORKER_METRICS = {
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:nixl_num_failed_transfers_total",
    "vllm:inter_token_latency_seconds_bucket",
}
KUBE_STATE_METRICS = {"kube_deployment_status_replicas_available", "kube_deployment_spec_replicas"}
# Series the recording rules create.
RECORDED = re.compile(r"^splitserve:router_(ttft|itl)_slow_ratio:rate(5m|30m|1h|6h)$")
KNOWN_METRICS = (
    ROUTER_METRICS
    | OPERATOR_METRICS
    | WORKER_METRICS
    | KUBE_STATE_METRICS
    | {
        "splitserve_router_ttft_seconds_count",
        "splitserve_router_itl_seconds_count",
    }
)
PROMQL_WORDS = {
    "sum", "avg", "max", "min", "by", "without", "rate", "increase", "histogram_quantile", "and", "or",
    "unless", "on", "ignoring", "group_left", "group_right", "round", "time", "timestamp", "le", "bool",
}  # fmt: skip
METRIC_TOKEN = re.compile(r"(?<![\w:$\"])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?=\{|\[)")
REQUIRED_ALERTS = {
    "SplitserveTTFTBudgetBurnFast",
    "SplitserveTTFTBudgetBurnSlow",
    "SplitserveITLBudgetBurnFast",
    "SplitserveITLBudgetBurnSlow",
    "SplitserveKVTransferFailures",
    "SplitservePoolNotReady",
    "SplitserveAutoscalerBlind",
}


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("generate_dashboard", MONITORING_DIR / "generate_dashboard.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD_FILE.read_text())
    return loaded


def dashboard_exprs() -> list[str]:
    return [target["expr"] for panel in dashboard()["panels"] for target in panel.get("targets", [])]


def rule_groups() -> list[dict[str, Any]]:
    [rule] = parse_manifests(RULE_FILE.read_text())
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def all_rules() -> list[dict[str, Any]]:
    return [rule for group in rule_groups() for rule in group["rules"]]


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers directly followed by a selector or a range."""
    without_strings = re.sub(r'"[^"]*"', '""', expr)
    return {name for name in METRIC_TOKEN.findall(without_strings) if name not in PROMQL_WORDS}


def assert_balanced(expr: str) -> None:
    pairs = {")": "(", "]": "[", "}": "{"}
    stack: list[str] = []
    for char in re.sub(r'"[^"]*"', '""', expr):
        if char in "([{":
            stack.append(char)
        elif char in pairs:
            assert stack and stack.pop() == pairs[char], f"unbalanced {char!r} in {expr}"
    assert stack == [], f"unclosed {stack} in {expr}"
    assert expr.count('"') % 2 == 0, f"odd number of quotes in {expr}"


def as_plain_promql(expr: str) -> str:
    """Replace Grafana's template variables with values Prometheus accepts."""
    return expr.replace("$__rate_interval", "5m").replace("$namespace", ".*").replace("$deployment", ".*")


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool not installed (apt-get install prometheus): PromQL not parsed by Prometheus")
    return found


def run_promtool(promtool: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *args], capture_output=True, text=True, check=False, timeout=120)


def test_committed_dashboard_is_the_generators_output() -> None:
    generator = load_generator()
    assert DASHBOARD_FILE.read_text() == generator.render(), "run python deploy/monitoring/generate_dashboard.py"


def test_dashboard_is_well_formed() -> None:
    board = dashboard()
    panels = board["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    assert board["uid"] and board["title"]
    variables = {variable["name"] for variable in board["templating"]["list"]}
    assert {"datasource", "namespace", "deployment"} <= variables
    graphs = [panel for panel in panels if panel["type"] != "row"]
    assert len(graphs) >= 10
    for panel in graphs:
        assert panel["targets"], panel["title"]
        assert panel["description"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24
    titles = " ".join(panel["title"] for panel in graphs).lower()
    for topic in ("first token", "inter-token", "queue depth", "replicas", "kv transfer", "outcomes"):
        assert topic in titles, topic


def test_dashboard_promql_is_balanced_and_uses_known_metrics() -> None:
    used: set[str] = set()
    for expr in dashboard_exprs():
        assert_balanced(expr)
        names = metric_names(expr)
        assert names, expr
        assert names <= KNOWN_METRICS, names - KNOWN_METRICS
        used |= names
    assert used >= ROUTER_METRICS | OPERATOR_METRICS
    assert {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:nixl_num_failed_transfers_total"} <= used


def test_dashboard_ttft_shows_p50_and_p99() -> None:
    ttft = [expr for expr in dashboard_exprs() if "splitserve_router_ttft_seconds_bucket" in expr]
    assert any(expr.startswith("histogram_quantile(0.5,") for expr in ttft)
    assert any(expr.startswith("histogram_quantile(0.99,") for expr in ttft)


def test_dashboard_queries_parse_in_prometheus(promtool: str, tmp_path: Path) -> None:
    rules = [
        {"record": f"dashboard:query_{number}", "expr": as_plain_promql(expr)}
        for number, expr in enumerate(dashboard_exprs())
    ]
    rules_file = tmp_path / "dashboard-queries.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = run_promtool(promtool, "check", "rules", str(rules_file))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


def test_prometheus_rule_has_the_required_alerts_with_documentation() -> None:
    alerts = {rule["alert"]: rule for rule in all_rules() if "alert" in rule}
    assert set(alerts) >= REQUIRED_ALERTS
    for name, alert in alerts.items():
        assert alert["labels"]["severity"] in {"critical", "warning"}, name
        assert {"summary", "description", "runbook_url"} <= set(alert["annotations"]), name
        assert_balanced(alert["expr"])


def test_rule_expressions_use_known_metrics() -> None:
    for rule in all_rules():
        for name in metric_names(rule["expr"]):
            assert name in KNOWN_METRICS or RECORDED.match(name), name
    for rule in all_rules():
        if "record" in rule:
            assert RECORDED.match(rule["record"]), rule["record"]


def test_prometheus_rule_object_is_valid(promtool: str, tmp_path: Path) -> None:
    [rule] = parse_manifests(RULE_FILE.read_text())
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["kind"] == "PrometheusRule"
    report = validate_objects([rule], custom_schemas={})
    assert report.errors == [] and len(report.skipped) == 1  # third-party kind; its spec is promtool's job
    rules_file = tmp_path / "splitserve-rules.yaml"
    rules_file.write_text(yaml.safe_dump(rule["spec"]))
    result = run_promtool(promtool, "check", "rules", str(rules_file))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(all_rules())} rules found" in result.stdout


def test_alerts_fire_on_the_cases_they_are_for(promtool: str, tmp_path: Path) -> None:
    [rule] = parse_manifests(RULE_FILE.read_text())
    rules_file = tmp_path / "splitserve-rules.yaml"
    rules_file.write_text(yaml.safe_dump(rule["spec"]))
    cases_file = tmp_path / "alerts_unittest.yaml"
    cases_file.write_text(ALERT_CASES.read_text().replace("RULES_FILE", str(rules_file)))
    result = run_promtool(promtool, "test", "rules", str(cases_file))
    assert result.returncode == 0, result.stdout + result.stderr


SERIES_SUFFIXES: dict[str, tuple[str, ...]] = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_count", "_sum"),
    "gauge": ("",),
}
ROUTER_METRICS_DOC = REPO_ROOT / "workers" / "router" / "METRICS.md"
DOC_ROW = re.compile(r"^\| `(?P<name>splitserve_router_[a-z_]+)` \| (?P<type>counter|gauge|histogram) \|", re.MULTILINE)


def router_exposed_names() -> set[str]:
    """Series the router exports, as Prometheus names them: its METRICS.md contract (kept in sync with the
    code by the router's own test) plus whatever its registry describes without traffic."""
    names: set[str] = set()
    if ROUTER_METRICS_DOC.exists():
        for row in DOC_ROW.finditer(ROUTER_METRICS_DOC.read_text()):
            base = row["name"].removesuffix("_total")
            names |= {base + suffix for suffix in SERIES_SUFFIXES[row["type"]]}
    metrics_module = pytest.importorskip("splitserve.router.metrics", reason="router metrics module not available")
    for family in metrics_module.RouterMetrics().registry.collect():
        names |= {family.name + suffix for suffix in SERIES_SUFFIXES.get(family.type, ("",))}
    return names


def test_router_metric_names_match_what_the_router_exports() -> None:
    exposed = router_exposed_names()
    used = set()
    for expr in dashboard_exprs() + [rule["expr"] for rule in all_rules()]:
        used |= {name for name in metric_names(expr) if name.startswith("splitserve_router_")}
    assert used <= exposed, used - exposed


def test_monitoring_kustomization_ships_dashboard_and_rules(kustomize_build: Callable[[Path], str]) -> None:
    objects = parse_manifests(kustomize_build(MONITORING_DIR))
    [config_map] = [obj for obj in objects if obj["kind"] == "ConfigMap"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["splitserve.json"]) == dashboard()
    report = validate_objects([config_map], custom_schemas={})
    assert report.errors == []
    assert [obj["kind"] for obj in objects if obj["kind"] != "ConfigMap"] == ["PrometheusRule"]
