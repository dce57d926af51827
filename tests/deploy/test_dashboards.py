"""The Grafana dashboard and the Prometheus rules query only what the model exports.

The contract is ``loraplex.engine.metrics.EXPORTED_METRICS`` (histograms by base name); anything else a
query reads must be in ALLOWED_FOREIGN below, by name. Label values that the model enumerates
(failure reasons, KV block states, adapter tiers, ...) are checked too, so a typo such as
``state="use"`` fails here instead of drawing an empty panel.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml

from loraplex.engine import metrics
from promql_names import PromQLError, base_name, check_expression, label_matchers, metric_names

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "loraplex-dashboard.json"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
RULES = ROOT / "deploy" / "prometheus" / "alerts" / "loraplex.rules.yml"

EXPORTED = metrics.EXPORTED_METRICS

# Metrics that are not the model's, each named on purpose: Triton's own per-model counters, NVIDIA
# DCGM exporter's GPU gauges, and Prometheus's synthetic `up`.
ALLOWED_FOREIGN = frozenset({
    "nv_inference_request_success", "nv_inference_request_failure", "nv_inference_pending_request_count",
    "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED",
    "up",
})

# Label values the model enumerates (issue 12; the metrics module's own constants where it has them).
LABEL_VALUES = {
    ("loraplex_request_failure_total", "reason"): tuple(getattr(metrics, "FAILURE_REASONS", (
        "invalid", "not_found", "unauthenticated", "quota", "cancelled", "timeout", "internal"))),
    ("loraplex_kv_cache_blocks", "state"): ("used", "cached", "free"),
    ("loraplex_adapters_resident", "tier"): ("device", "host"),
    ("loraplex_num_sequences", "state"): ("running", "waiting", "swapped"),
    ("loraplex_request_finished_total", "finish_reason"): ("stop", "length", "timeout", "abort", "error"),
    ("loraplex_adapter_loads_total", "tier"): ("device", "host"),
    ("loraplex_adapter_evictions_total", "tier"): ("device", "host"),
}

# Labels a series can carry besides its family's own: model/version (every loraplex family) and what
# Prometheus adds to a target (prometheus.yml's relabelling, the Prometheus Operator's).
TARGET_LABELS = frozenset({"model", "version", "instance", "job", "namespace", "pod", "node", "service",
                           "endpoint", "container"})


def family_labels() -> dict[str, frozenset[str]]:
    """Each exported family's labels, from backend/engine/metrics.py's table of families."""
    out = {}
    for family in (*metrics.FAMILIES, metrics.UPLOADS):
        extra = {"le"} if family.kind == metrics.HISTOGRAM else set()
        out[metrics.PREFIX + family.name] = frozenset(family.labels) | TARGET_LABELS | extra
    assert set(out) == EXPORTED
    return out


LABELS = family_labels()

# What the dashboard must show (issue 12): throughput, TTFT/TPOT, KV use, prefix-cache hit rate,
# adapter residency and loads, preemptions, failures by reason.
DASHBOARD_MUST_READ = {
    "loraplex_generation_tokens_total", "loraplex_time_to_first_token_seconds",
    "loraplex_time_per_output_token_seconds", "loraplex_kv_cache_blocks",
    "loraplex_prefix_cache_hit_tokens_total", "loraplex_prefix_cache_query_tokens_total",
    "loraplex_adapters_resident", "loraplex_adapter_loads_total", "loraplex_preemptions_total",
    "loraplex_request_failure_total",
}
ALERTS_REQUIRED = {"LoraplexQueueGrowing", "LoraplexServerFailureRate", "LoraplexKVCacheExhausted",
                   "LoraplexAdapterThrash"}
SEVERITIES = {"critical", "warning", "info"}
DURATION = re.compile(r"^(\d+(ms|[smhdwy]))+$")


def check(expr: str) -> set[str]:
    """The families ``expr`` reads; PromQLError for a foreign metric, a label value the model never
    sets, or a label (in a matcher or a by/without clause) that none of its loraplex families has."""
    families = check_expression(expr, EXPORTED, ALLOWED_FOREIGN, LABEL_VALUES)
    for name, label, _, _ in label_matchers(expr):
        family = base_name(name, EXPORTED)
        if family in LABELS and label not in LABELS[family]:
            raise PromQLError(f"{family} has no label {label!r} (it has {sorted(LABELS[family] - TARGET_LABELS)}), in {expr!r}")
    if families <= EXPORTED:  # foreign metrics have labels of their own (DCGM's gpu, Hostname): not checked
        known = set().union(*(LABELS[f] for f in families)) if families else set()
        for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
            for label in filter(None, (g.strip() for g in group.split(","))):
                if label not in known:
                    raise PromQLError(f"grouping by {label!r}, which none of {sorted(families)} has, in {expr!r}")
    return families


# ---- the extractor itself ----------------------------------------------------------------------

@pytest.mark.parametrize("expr, names", [
    ("loraplex_requests_waiting", {"loraplex_requests_waiting"}),
    ('sum by (tenant) (rate(loraplex_generation_tokens_total{tenant=~"$tenant", model="m"}[$__rate_interval]))',
     {"loraplex_generation_tokens_total"}),
    ('histogram_quantile(0.99, sum by (le, tenant) (rate(loraplex_time_to_first_token_seconds_bucket[5m])))',
     {"loraplex_time_to_first_token_seconds_bucket"}),
    ("sum(rate(a_total[5m])) by (instance) / on (instance) group_left (pod) b_info",
     {"a_total", "b_info"}),
    ("deriv(sum by (namespace, instance) (loraplex_requests_waiting)[10m:1m]) > 0",
     {"loraplex_requests_waiting"}),
    ('{__name__="loraplex_kv_cache_blocks", state="used"}', {"loraplex_kv_cache_blocks"}),
    ('label_replace(up, "dst", "loraplex_not_a_metric", "src", "(.*)")', {"up"}),
    ("x offset 5m and bool y unless z @ 1609746000", {"x", "y", "z"}),
    ("rate(x[5m] offset 1h) * 1e3 + 0x1f - .5", {"x"}),
    ("count_values(\"v\", build_info) or vector(0) > bool 1", {"build_info"}),
    ('label_values(loraplex_generation_tokens_total{model=~"$model"}, tenant)', {"loraplex_generation_tokens_total"}),
    ("label_values(instance)", set()),
    ("sum without (le) (rate(h_count[1m])) / time()", {"h_count"}),
])
def test_metric_names(expr, names):
    assert metric_names(expr) == names


def test_matchers_belong_to_their_metric():
    expr = 'a{state="used"} / b{reason=~"quota|internal", tenant!="x"}'
    assert label_matchers(expr) == [("a", "state", "=", "used"), ("b", "reason", "=~", "quota|internal"),
                                    ("b", "tenant", "!=", "x")]


@pytest.mark.parametrize("expr, message", [
    ("rate(loraplex_generation_token_total[5m])", "not a metric the model exports"),  # one letter off
    ("loraplex_requests_waiting / loraplex_requests_pending", "loraplex_requests_pending"),
    ("histogram_quantil(0.9, sum by (le) (rate(loraplex_queue_time_seconds_bucket[5m])))", "unknown PromQL function"),
    ("rate(loraplex_generation_tokens_total_bucket[5m])", "not a metric"),  # a counter has no buckets
    ("rate(loraplex_preemptions_total[5m]", "unclosed"),
    ('loraplex_request_failure_total{reason="oops"}', "not among"),
    ('loraplex_kv_cache_blocks{state=~"used|evicted"}', "['evicted']"),
    ('loraplex_adapters_resident{tier="gpu"}', "not among"),
    ('{state="used"}', "without a metric name"),
    ("nv_gpu_utilization", "nor allow-listed"),  # a real Triton metric, but not on the allow-list
    ('loraplex_kv_cache_blocks{tenant="acme"}', "has no label 'tenant'"),  # KV blocks are per replica
    ("sum by (tenant) (rate(loraplex_preemptions_total[5m]))", "grouping by 'tenant'"),
    ('rate(loraplex_adapter_loads_total{tier="disk"}[5m])', "not among"),
])
def test_check_expression_rejects(expr, message):
    with pytest.raises(PromQLError, match=re.escape(message)):
        check(expr)


def test_histogram_series_map_to_their_family():
    for suffix in ("_bucket", "_sum", "_count"):
        assert base_name("loraplex_e2e_request_latency_seconds" + suffix, EXPORTED) == "loraplex_e2e_request_latency_seconds"
    assert check('loraplex_kv_cache_blocks{state=~".*"}') == {"loraplex_kv_cache_blocks"}  # a regex: not enumerated


# ---- the dashboard -----------------------------------------------------------------------------

def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels_of(dashboard: dict):
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows hold their panels


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, query) for every PromQL query of the dashboard: panel targets and variable queries."""
    out = []
    for panel in panels_of(dashboard):
        for target in panel.get("targets", []):
            out.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            out.append((f"variable {var['name']}", query))
    return out


def check_dashboard(dashboard: dict) -> set[str]:
    families = set()
    for where, query in dashboard_queries(dashboard):
        try:
            families |= check(query)
        except PromQLError as exc:
            raise PromQLError(f"{where}: {exc}") from None
    return families


def test_dashboard_queries_only_exported_metrics():
    families = check_dashboard(load_dashboard())
    assert DASHBOARD_MUST_READ <= families, DASHBOARD_MUST_READ - families


def test_dashboard_check_sees_a_foreign_metric():
    dashboard = load_dashboard()
    broken = copy.deepcopy(dashboard)
    panel = next(p for p in panels_of(broken) if p.get("targets"))
    panel["targets"][0]["expr"] += " + on() vllm:num_requests_waiting"
    with pytest.raises(PromQLError, match="vllm:num_requests_waiting"):
        check_dashboard(broken)
    broken = copy.deepcopy(dashboard)
    next(v for v in broken["templating"]["list"] if v["name"] == "tenant")["query"]["query"] = \
        "label_values(loraplex_tenant_info, tenant)"
    with pytest.raises(PromQLError, match="variable tenant"):
        check_dashboard(broken)


def test_every_allow_listed_metric_is_used():
    used = check_dashboard(load_dashboard())
    for rule in all_rules():
        used |= check(rule["expr"])
    assert ALLOWED_FOREIGN <= used, f"allow-listed but unused: {sorted(ALLOWED_FOREIGN - used)}"


def test_dashboard_variables_and_datasource():
    dashboard = load_dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    tenant = variables["tenant"]
    assert tenant["type"] == "query" and tenant["multi"] and tenant["includeAll"] and tenant["allValue"] == ".*"
    assert re.fullmatch(r"label_values\(.+,\s*tenant\)", tenant["query"]["query"])
    assert metric_names(tenant["query"]["query"]) == {"loraplex_generation_tokens_total"}
    for panel in panels_of(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    assert dashboard["schemaVersion"] >= 36 and dashboard["uid"] and dashboard["title"]


def test_tenant_panels_follow_the_tenant_variable():
    for panel in panels_of(load_dashboard()):
        for target in panel.get("targets", []):
            reads_tenant = any(label == "tenant" for _, label, _, _ in label_matchers(target["expr"]))
            if "tenant" in panel["title"].lower():
                assert reads_tenant and '$tenant' in target["expr"], panel["title"]


def test_quantiles_come_from_buckets_by_le():
    seen = 0
    for where, expr in dashboard_queries(load_dashboard()) + [(r["alert"], r["expr"]) for r in all_rules()]:
        if "histogram_quantile" not in expr:
            continue
        seen += 1
        assert all(n.endswith("_bucket") for n in metric_names(expr)), where
        groups = re.findall(r"\bby\s*\(([^)]*)\)", expr)
        assert groups and all("le" in [g.strip() for g in group.split(",")] for group in groups), where
    assert seen >= 10


def test_panel_layout():
    ids, cells = set(), set()
    for panel in panels_of(load_dashboard()):
        assert panel["id"] not in ids
        ids.add(panel["id"])
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, panel["title"]
        mine = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not mine & cells, f"{panel['title']!r} overlaps another panel"
        cells |= mine


# ---- the rules and the scrape configuration ----------------------------------------------------

def all_rules() -> list[dict]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def test_rules_query_only_exported_metrics():
    for rule in all_rules():
        try:
            check(rule["expr"])
        except PromQLError as exc:
            raise AssertionError(f"{rule['alert']}: {exc}") from None


def test_rules_structure():
    doc = yaml.safe_load(RULES.read_text())
    assert set(doc) == {"groups"}
    group_names = [g["name"] for g in doc["groups"]]
    assert len(group_names) == len(set(group_names))
    names = []
    for group in doc["groups"]:
        assert set(group) <= {"name", "interval", "rules", "limit"} and group["rules"], group["name"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}, rule
            assert re.fullmatch(r"Loraplex[A-Z][A-Za-z0-9]+", rule["alert"])
            assert DURATION.match(rule["for"]), rule["alert"]
            assert rule["labels"]["severity"] in SEVERITIES, rule["alert"]
            for key in ("summary", "description"):
                text = rule["annotations"][key]
                assert text.strip() and text.count("{{") == text.count("}}"), (rule["alert"], key)
            names.append(rule["alert"])
    assert len(names) == len(set(names))
    assert ALERTS_REQUIRED <= set(names)


def test_scrape_config():
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    for path in config["rule_files"]:
        assert (PROMETHEUS_CONFIG.parent / path).is_file(), path
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["loraplex-triton"]["metrics_path"] == "/metrics"
    # The static job relabels itself to the same job name, so `up{job="loraplex-triton"}` covers both.
    assert {"target_label": "job", "replacement": "loraplex-triton"} in jobs["loraplex-triton-static"]["relabel_configs"]
    assert jobs["loraplex-triton-static"]["static_configs"][0]["targets"] == ["localhost:8002"]
    up_jobs = {value for rule in all_rules() for metric, label, _, value in label_matchers(rule["expr"])
               if metric == "up" and label == "job"}
    assert up_jobs and up_jobs <= set(jobs)
