"""The chart's monitoring: the Grafana dashboard ConfigMap (off by default) and the PodMonitors (only where the
Prometheus operator's CRDs are served), rendered with helm; the dashboard names metrics the code exports."""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import pytest
import yaml

pytestmark = [pytest.mark.k8s]

REPO = pathlib.Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "splitserve"
DASHBOARD = CHART / "dashboards" / "splitserve.json"
# Where the exported metrics are defined: prometheus_client's Counter/Gauge/Histogram("name", ...).
METRIC_SOURCES = ["engine/metrics.py", "router/app.py", "router/cache_routing.py", "transfer/metrics.py",
                  "operator/planner_loop.py"]
SUFFIXES = ("_bucket", "_count", "_sum", "_total")


def rendered(cluster: Any, *args: str) -> list[dict[str, Any]]:
    out = cluster.cp.helm("template", "splitserve", str(CHART), "--namespace", "splitserve-system", *args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def exported_metrics() -> dict[str, str]:
    """Metric name -> type, of every metric the code defines."""
    found = {}
    for source in METRIC_SOURCES:
        text = (REPO / source).read_text()
        for kind, name in re.findall(r'\b(Counter|Gauge|Histogram)\(\s*"(splitserve_[a-z_]+)"', text):
            found[name] = kind
    return found


def dashboard_metrics(dashboard: dict[str, Any]) -> set[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    return {m for e in exprs for m in re.findall(r"\b(splitserve_[a-z_]+)", e)}


def base_name(metric: str, exported: dict[str, str]) -> str | None:
    if metric in exported:
        return metric
    for suffix in SUFFIXES:
        if metric.endswith(suffix) and metric[: -len(suffix)] in exported:
            return metric[: -len(suffix)]
    return None


def test_the_dashboard_parses_and_every_metric_it_queries_is_exported() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_metrics()
    assert {"splitserve_time_to_first_token_seconds", "splitserve_router_route_decisions",
            "splitserve_transfer_bytes", "splitserve_planner_desired_replicas"} <= set(exported)
    used = dashboard_metrics(dashboard)
    unknown = sorted(m for m in used if base_name(m, exported) is None)
    assert unknown == [], f"the dashboard queries metrics nothing exports: {unknown}"
    # Counters are queried by their exposed name (_total), histograms by their buckets.
    for metric in used:
        base = base_name(metric, exported)
        if exported[base] == "Counter":
            assert metric == f"{base}_total", metric
        if exported[base] == "Histogram":
            assert metric == f"{base}_bucket", metric
    covered = {base_name(m, exported) for m in used}
    for wanted in ("splitserve_time_to_first_token_seconds", "splitserve_inter_token_latency_seconds",
                   "splitserve_requests_waiting", "splitserve_kv_pages_used", "splitserve_prefix_cache_hit_rate",
                   "splitserve_router_route_decisions", "splitserve_transfer_bytes",
                   "splitserve_planner_desired_replicas", "splitserve_planner_current_replicas"):
        assert wanted in covered, wanted
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_the_dashboard_configmap_is_off_by_default_and_carries_the_sidecar_label(cluster: Any) -> None:
    assert not [o for o in rendered(cluster) if o["kind"] == "ConfigMap"]
    (configmap,) = [o for o in rendered(cluster, "--set", "dashboards.enabled=true") if o["kind"] == "ConfigMap"]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["splitserve.json"]) == json.loads(DASHBOARD.read_text())
    other = rendered(cluster, "--set", "dashboards.enabled=true", "--set", "dashboards.label=dash",
                     "--set", "dashboards.namespace=monitoring")
    (configmap,) = [o for o in other if o["kind"] == "ConfigMap"]
    assert configmap["metadata"]["labels"]["dash"] == "1" and configmap["metadata"]["namespace"] == "monitoring"


def test_podmonitors_only_where_the_prometheus_operator_is(cluster: Any) -> None:
    assert not [o for o in rendered(cluster) if o["kind"] == "PodMonitor"]
    with_crds = rendered(cluster, "--api-versions", "monitoring.coreos.com/v1")
    monitors = {o["metadata"]["name"]: o for o in with_crds if o["kind"] == "PodMonitor"}
    assert set(monitors) == {"splitserve-engines", "splitserve-operator"}
    engines = monitors["splitserve-engines"]["spec"]
    assert engines["namespaceSelector"] == {"any": True}
    assert engines["podMetricsEndpoints"][0]["port"] == "http"
    assert {r["targetLabel"] for r in engines["podMetricsEndpoints"][0]["relabelings"]} == {"group", "role"}
    assert monitors["splitserve-operator"]["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    scoped = rendered(cluster, "--api-versions", "monitoring.coreos.com/v1", "--set", "watchNamespaces={a,b}")
    engines = next(o for o in scoped if o["kind"] == "PodMonitor" and o["metadata"]["name"].endswith("engines"))
    assert engines["spec"]["namespaceSelector"] == {"matchNames": ["a", "b"]}
    off = rendered(cluster, "--api-versions", "monitoring.coreos.com/v1", "--set", "podMonitors.enabled=false")
    assert not [o for o in off if o["kind"] == "PodMonitor"]
    # The operator serves the planner's metrics on the port the operator PodMonitor scrapes.
    deployment = next(o for o in with_crds if o["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "metrics", "containerPort": 8081} in container["ports"]
    assert {"name": "SPLITSERVE_METRICS_PORT", "value": "8081"} in container["env"]


def test_the_operator_may_scale_roles_through_the_scale_subresource(cluster: Any) -> None:
    for args in ([], ["--set", "watchNamespaces={a}"]):
        roles = [o for o in rendered(cluster, *args) if o["kind"] in ("ClusterRole", "Role")]
        rules = [r for o in roles for r in o["rules"]]
        assert any("servingroles/scale" in r["resources"] and "patch" in r["verbs"] for r in rules), args
