"""Writes grafana-dashboard.json: `python deploy/monitoring/generate_dashboard.py`.

The dashboard is generated so that its PromQL stays in one readable place; tests/packaging checks
that the committed JSON is this script's output and that every query parses (promtool).

Label conventions (see splitserve.autoscaling.queries): router series carry `namespace`,
`deployment` (the InferenceDeployment) and `pool`; worker series carry `namespace`, `deployment`
and `role` (prefill, decode, aggregated); kube-state-metrics names Deployments `<name>-<role>-<generation>`
(the KV generation, 10 hex digits; `<name>-<role>` for pools an operator before generations made).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

DASHBOARD_FILE = Path(__file__).with_name("grafana-dashboard.json")
ROUTER = 'namespace=~"$namespace",deployment=~"$deployment"'
WORKERS = 'namespace=~"$namespace",deployment=~"$deployment"'
OPERATOR = 'deployment=~"$deployment"'
KSM_POOLS = 'namespace=~"$namespace",deployment=~"($deployment)-(prefill|decode|aggregated)(-[0-9a-f]{10})?"'
RATE = "$__rate_interval"


def quantiles(metric: str, selector: str, by: str = "") -> list[tuple[str, str]]:
    group = f"le, {by}" if by else "le"
    suffix = f" {{{{{by}}}}}" if by else ""
    return [
        (
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{selector}}}[{RATE}])))",
            f"p{int(q * 100)}{suffix}",
        )
        for q in (0.5, 0.99)
    ]


def panel(title: str, targets: list[tuple[str, str]], unit: str, description: str) -> dict[str, Any]:
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


PANELS: list[dict[str, Any]] = [
    row("Latency"),
    panel(
        "Time to first token (router)",
        quantiles("splitserve_router_ttft_seconds", ROUTER),
        "s",
        "What clients see: from request arrival at the router to the first streamed byte.",
    ),
    panel(
        "Inter-token latency (router)",
        quantiles("splitserve_router_itl_seconds", ROUTER),
        "s",
        "Gap between streamed events as clients see it.",
    ),
    panel(
        "Inter-token latency by worker role (vLLM)",
        quantiles("vllm:inter_token_latency_seconds", WORKERS, by="role"),
        "s",
        "vLLM's own ITL per pool; compare with the router's to spot network or router overhead.",
    ),
    panel(
        "End-to-end latency (router)",
        quantiles("splitserve_router_e2e_seconds", ROUTER),
        "s",
        "Whole request, router in to last byte out.",
    ),
    row("Pools"),
    panel(
        "Router queue depth per pool",
        [
            (f"sum by (pool) (splitserve_router_queue_depth{{{ROUTER}}})", "queued {{pool}}"),
            (f"sum by (pool) (splitserve_router_inflight_requests{{{ROUTER}}})", "in flight {{pool}}"),
        ],
        "short",
        "Requests waiting for a worker slot and requests holding one, per pool.",
    ),
    panel(
        "Waiting in vLLM per role",
        [
            (f"sum by (role) (vllm:num_requests_waiting{{{WORKERS}}})", "waiting {{role}}"),
            (f"sum by (role) (vllm:num_requests_running{{{WORKERS}}})", "running {{role}}"),
        ],
        "short",
        "vLLM scheduler queues inside the workers.",
    ),
    panel(
        "KV cache usage per role",
        [
            (f"avg by (role) (vllm:kv_cache_usage_perc{{{WORKERS}}})", "avg {{role}}"),
            (f"max by (role) (vllm:kv_cache_usage_perc{{{WORKERS}}})", "max {{role}}"),
        ],
        "percentunit",
        "GPU KV cache occupancy; decode pools near 1.0 preempt requests.",
    ),
    panel(
        "Replicas per pool",
        [
            (f"sum by (pool) (splitserve_autoscaler_desired_replicas{{{OPERATOR}}})", "desired {{pool}}"),
            (f"sum by (deployment) (kube_deployment_status_replicas_available{{{KSM_POOLS}}})", "ready {{deployment}}"),
        ],
        "short",
        "Autoscaler decision vs ready pods (ready pods come from kube-state-metrics).",
    ),
    row("KV transfer"),
    panel(
        "KV handoff time (router)",
        quantiles("splitserve_router_kv_handoff_seconds", ROUTER),
        "s",
        "From the prefill answer to decode's first byte: KV pull plus first decode step.",
    ),
    panel(
        "KV transfer failures and fallbacks",
        [
            (
                f"sum by (role) (rate(vllm:nixl_num_failed_transfers_total{{{WORKERS}}}[{RATE}]))",
                "NIXL failed {{role}}",
            ),
            (f"sum by (reason) (rate(splitserve_router_fallbacks_total{{{ROUTER}}}[{RATE}]))", "fallback {{reason}}"),
        ],
        "reqps",
        "Failed NIXL transfers on workers, and requests the router served aggregated instead.",
    ),
    row("Requests"),
    panel(
        "Request outcomes",
        [
            (
                f"sum by (outcome, mode) (rate(splitserve_router_requests_total{{{ROUTER}}}[{RATE}]))",
                "{{outcome}} {{mode}}",
            )
        ],
        "reqps",
        "Finished requests per second by outcome and serving mode (disaggregated or aggregated).",
    ),
    panel(
        "Retries and ejections",
        [
            (f"sum by (pool) (rate(splitserve_router_retries_total{{{ROUTER}}}[{RATE}]))", "retries {{pool}}"),
            (f"sum by (pool) (increase(splitserve_router_ejections_total{{{ROUTER}}}[{RATE}]))", "ejections {{pool}}"),
        ],
        "short",
        "Upstream attempts retried elsewhere, and workers ejected after consecutive failures.",
    ),
    panel(
        "Autoscaler sees Prometheus",
        [(f"min(splitserve_autoscaler_prometheus_up{{{OPERATOR}}})", "up")],
        "bool",
        "0 means the autoscaler is blind and holds replicas; see the SplitserveAutoscalerBlind alert.",
    ),
]


def layout(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Grid positions: rows span the width, panels go two per line."""
    y = 0
    column = 0
    placed: list[dict[str, Any]] = []
    for number, item in enumerate(panels, start=1):
        item = dict(item, id=number)
        if item["type"] == "row":
            y += 8 if column else 0
            column = 0
            item["gridPos"] = {"h": 1, "w": 24, "x": 0, "y": y}
            y += 1
        else:
            item["gridPos"] = {"h": 8, "w": 12, "x": 12 * column, "y": y}
            column = (column + 1) % 2
            y += 8 if column == 0 else 0
        placed.append(item)
    return placed


def variable(name: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": name,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": query, "refId": f"{name}-variable"},
        "definition": query,
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def dashboard() -> dict[str, Any]:
    return {
        "uid": "splitserve-overview",
        "title": "splitserve: disaggregated serving",
        "description": "Router, prefill/decode pools, KV transfer and autoscaler of splitserve InferenceDeployments.",
        "tags": ["splitserve", "vllm", "llm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                },
                variable("namespace", "label_values(splitserve_router_requests_total, namespace)"),
                variable(
                    "deployment",
                    'label_values(splitserve_router_requests_total{namespace=~"$namespace"}, deployment)',
                ),
            ]
        },
        "annotations": {"list": []},
        "panels": layout(PANELS),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    DASHBOARD_FILE.write_text(render())
    print(f"wrote {DASHBOARD_FILE}")
    sys.exit(0)
