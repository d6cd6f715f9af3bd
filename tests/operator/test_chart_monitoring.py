"""The chart's Grafana dashboard and PrometheusRule read only series the engine exports, with labels they carry.

The exported names come from a real `ServerMetrics` rendering, not a hand list; the labels are the engine's
own plus those prometheus-operator puts on every target of the PodMonitor the operator renders.
"""

import json
import re
import subprocess

import pytest
import yaml

from ddtree.serving.metrics import ServerMetrics
from ddtree_operator.api import SpeculativeDeploymentSpec
from ddtree_operator.render import Owner, render_pod_monitor
from kube_testbed import CHART, EXAMPLES

# What prometheus-operator puts on every series scraped through a PodMonitor (its target labels).
POD_MONITOR_TARGET_LABELS = {"namespace", "pod", "container", "endpoint", "job", "instance"}
KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS |= {"inf", "nan"}
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
MATCHERS = re.compile(r"\{([^}]*)\}")
STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
IDENTIFIER = re.compile(r"(?<![\w.$])[A-Za-z_:][\w:]*")


def exported_series() -> tuple[set[str], set[str]]:
    """Sample names and label names of a ServerMetrics' /metrics page, every family with a sample."""
    from prometheus_client.parser import text_string_to_metric_families

    metrics = ServerMetrics("smollm2")
    # the families labelled by more than the model get a child, as a serving engine's have
    metrics.request_finished(200)
    metrics.num_drafts.labels(model="smollm2", budget="8")
    body, _ = metrics.render()
    samples = [s for family in text_string_to_metric_families(body.decode()) for s in family.samples]
    return {s.name for s in samples}, {label for s in samples for label in s.labels}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions, aggregations,
    keywords, label names (inside matchers or grouping clauses) or durations."""
    expr = STRING.sub('""', expr)
    expr = MATCHERS.sub("", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range and subquery durations
    expr = GROUPING.sub("", expr)
    names = set()
    for match in IDENTIFIER.finditer(expr):
        if re.match(r"\s*\(", expr[match.end() :]) or match.group() in KEYWORDS:
            continue  # a function or aggregation call, or a keyword
        names.add(match.group())
    return names


def label_names(expr: str) -> set[str]:
    """Label names a PromQL expression matches on or groups by."""
    expr = STRING.sub('""', expr)
    names = set()
    for matchers in MATCHERS.findall(expr):
        names |= {m.group(1) for m in re.finditer(r"([A-Za-z_]\w*)\s*(=~|!~|!=|=)", matchers)}
    for _, labels in GROUPING.findall(expr):
        names |= {label.strip() for label in labels.split(",") if label.strip()}
    return names


def made_labels(expr: str) -> set[str]:
    """Labels an expression creates itself (count_values, label_replace/label_join targets)."""
    made = set(re.findall(r'count_values\s*(?:by\s*\([^)]*\)\s*)?\(\s*"(\w+)"', expr))
    return made | set(re.findall(r'label_(?:replace|join)\s*\(.*?,\s*"(\w+)"', expr))


def rendered(helm: str) -> list[dict]:
    result = subprocess.run(
        [helm, "template", "ddtree", str(CHART), "--set", "dashboards.enabled=true", "--set", "alerts.enabled=true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and query variable; label_values(selector, label) reads as the
    query it stands for, `count by (label) (selector)`."""
    queries = [(f"panel {p['title']!r}", t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["definition"])
            assert match, variable["definition"]
            queries.append((f"variable {variable['name']!r}", f"count by ({match.group(2)}) ({match.group(1)})"))
    return queries


@pytest.fixture(scope="module")
def expressions(helm) -> list[tuple[str, str]]:
    docs = rendered(helm)
    (config_map,) = (d for d in docs if d["kind"] == "ConfigMap")
    (dashboard_json,) = config_map["data"].values()
    (rule,) = (d for d in docs if d["kind"] == "PrometheusRule")
    alerts = [(f"alert {r['alert']}", r["expr"]) for g in rule["spec"]["groups"] for r in g["rules"]]
    return dashboard_queries(json.loads(dashboard_json)) + alerts


def test_the_name_extractor_sees_every_selected_metric():
    expr = (
        'sum by (budget) (rate(a_total{namespace="$ns", job="$ns/$d"}[$__rate_interval])'
        ' * on (namespace, pod) group_left (budget) count_values by (pod) ("budget", b_gauge{x="y"}))'
        " / histogram_quantile(0.99, sum by (le) (rate(c_bucket[5m] offset 1d))) > bool 1e3 and d"
    )
    assert metric_names(expr) == {"a_total", "b_gauge", "c_bucket", "d"}
    assert label_names(expr) == {"namespace", "job", "budget", "pod", "le", "x"}
    assert made_labels(expr) == {"budget"}


def test_dashboard_and_alerts_read_only_metrics_the_engine_exports(expressions):
    exported, _ = exported_series()
    unknown = {}
    for where, expr in expressions:
        names = metric_names(expr)
        assert names, f"{where} selects no metric: {expr}"
        if names - exported:
            unknown[where] = sorted(names - exported)
    assert not unknown, f"not exported by ddtree.serving.metrics.ServerMetrics: {unknown}"


def test_dashboard_and_alerts_use_only_labels_the_series_carry(expressions):
    _, engine_labels = exported_series()
    assert "model" in engine_labels
    for where, expr in expressions:
        unknown = label_names(expr) - engine_labels - POD_MONITOR_TARGET_LABELS - made_labels(expr)
        assert not unknown, f"{where} uses labels no series has: {sorted(unknown)} in {expr}"


def test_series_of_a_resource_carry_its_name_in_the_job_label():
    """Dashboard and alerts tell resources apart by job="<namespace>/<name>": prometheus-operator's job
    label for a PodMonitor without jobLabel, which the operator names after the resource."""
    spec = SpeculativeDeploymentSpec.model_validate(yaml.safe_load((EXAMPLES / "smollm2-cpu.yaml").read_text())["spec"])
    pod_monitor = render_pod_monitor(Owner(name="smollm2-cpu", namespace="llm", uid="u"), spec)
    assert pod_monitor["metadata"]["name"] == "smollm2-cpu" and pod_monitor["metadata"]["namespace"] == "llm"
    assert "jobLabel" not in pod_monitor["spec"]


def test_dashboard_panels_cover_the_serving_picture(expressions):
    selected = set().union(*(metric_names(expr) for where, expr in expressions if where.startswith("panel")))
    for metric in [
        "ddtree_spec_decode_num_accepted_tokens_total",
        "ddtree_generation_tokens_total",
        "ddtree_time_to_first_token_seconds_bucket",
        "ddtree_inter_token_latency_seconds_bucket",
        "ddtree_requests_waiting",
        "ddtree_requests_running",
        "ddtree_kv_cache_usage_ratio",
        "ddtree_spec_budget",
        "ddtree_spec_decode_num_drafts_total",
        "ddtree_spec_decode_forecast_accepted_tokens_total",
        "ddtree_smoke_test_passed",
        "ddtree_load",
        "ddtree_connections_refused_total",
        "ddtree_connections_timed_out_total",
    ]:
        assert metric in selected, metric
