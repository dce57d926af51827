"""The endpoint picker's metrics (decision 076): the LoRA-info gauge's label set, hashed adapter names, the info
gauge's one current series, the KV ratio, and the replica totals."""

from __future__ import annotations

from types import SimpleNamespace

from loraplex.engine.metrics import (FAMILIES, INFO, MAX_WAITING_ADAPTER_NAMES, TenantLabels, hashed_adapter, kv_values,
                                     live_values, lora_info)
from loraplex.engine.stats import EngineStats
from loraplex.lora.catalog import shared_key, tenant_key
from loraplex.lora.store import ADAPTER_NAME
from loraplex.triton.metrics_publisher import MAX_INFO_SERIES, TritonMetrics

PLAIN = TenantLabels(100)


def req(lora: str | None, tenant: str = "acme", key: str | None = None):
    """What lora_info reads of a Request: its lora_name, tenant and the manager key the catalog resolved."""
    if key is None and lora is not None:
        key = lora  # a shared folder of the store (or multi_lora.json) is registered under its name
    return SimpleNamespace(params=SimpleNamespace(lora_name=lora), tenant=tenant, adapter_key=key)


def info(running, waiting, max_loras: int = 8, labels: TenantLabels = PLAIN) -> tuple:
    ((name, label_values), value), = lora_info(running, waiting, max_loras, labels).items()
    assert name == "lora_requests_info" and value == 0.0
    return label_values


def test_lora_info_names_the_distinct_adapters_of_running_and_of_waiting_requests():
    running = [req("b"), req("a"), req("b"), req(None)]
    waiting = [req("c"), req("a"), req(None)]
    assert info(running, waiting) == ("8", "a,b", "a,c")  # an adapter with requests in both is in both, as vLLM's
    assert info([], [], max_loras=4) == ("4", "", "")
    family = next(f for f in FAMILIES if f.name == "lora_requests_info")
    assert family.kind == INFO and family.labels == ("max_lora", "running_lora_adapters", "waiting_lora_adapters")


def test_waiting_names_are_bounded_but_never_below_the_slots():
    waiting = [req(f"w{i:03d}") for i in range(300)]
    assert len(info([], waiting, max_loras=8)[2].split(",")) == MAX_WAITING_ADAPTER_NAMES
    assert len(info([], waiting, max_loras=100)[2].split(",")) == 100  # the picker's "a slot is free" stays exact


def test_hashed_labels_hide_a_tenants_own_adapter_names_and_keep_shared_ones():
    hashed = TenantLabels(100, hashed=True, salt="s3cret")
    upload = req("support", "acme", tenant_key("acme", "support", "0123456789abcdef"))
    other = req("support", "globex", tenant_key("globex", "support", "fedcba9876543210"))
    loaded = req("ops", "acme", shared_key("ops", "0123456789abcdef"))
    folder = req("demo-a", "acme")
    running = info([upload, other, loaded, folder], [], labels=hashed)[1].split(",")
    assert "support" not in running and {"ops", "demo-a"} <= set(running)
    mine, theirs = hashed_adapter("acme", "support", "s3cret"), hashed_adapter("globex", "support", "s3cret")
    assert mine != theirs and {mine, theirs} <= set(running) and len(running) == 4  # each still takes its slot
    assert not ADAPTER_NAME.fullmatch(mine)  # no request's model can name it
    assert hashed_adapter("acme", "support", "other salt") != mine
    assert info([upload], [])[1] == "support"  # plain labels: the name the client sends


def test_kv_ratio_counts_held_blocks_only():
    values = kv_values({"used": 25, "cached": 40, "free": 75}, 100, 16)
    assert values == {("kv_cache_usage_ratio", ()): 0.25, ("cache_config_info", ("16", "100")): 1}


def test_replica_totals_sum_the_tenants():
    stats = EngineStats()
    stats.accepted.update({"acme": 5, "globex": 2})
    stats.started.update({"acme": 4})
    stats.ended_started.update({"acme": 1})
    values = live_values(stats)
    assert values[("num_requests_running", ())] == 3 and values[("num_requests_waiting", ())] == 1 + 2


class Pb:
    """pb_utils.MetricFamily's surface as Triton 2.51 behaves: a family holds every series made from it."""

    def __init__(self):
        self.families: list = []
        pb = self

        class MetricFamily:
            GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"

            def __new__(cls, name, description, kind):
                family = SimpleNamespace(name=name, metrics=[])
                family.Metric = lambda labels, buckets=None: _metric(family, labels)
                pb.families.append(family)
                return family
        self.MetricFamily = MetricFamily


def _metric(family, labels):
    metric = SimpleNamespace(labels=labels, value=0.0)
    metric.set = lambda v: setattr(metric, "value", v)
    family.metrics.append(metric)
    return metric


def current(metrics: TritonMetrics) -> dict:
    """The series the picker takes from what the port shows (the family the model holds): the largest value."""
    return max(metrics._families["lora_requests_info"].metrics, key=lambda m: m.value).labels


def test_the_info_gauge_shows_its_current_label_set_with_the_largest_value():
    pb = Pb()
    metrics = TritonMetrics(pb, "lora_llm", "1")
    key = "lora_requests_info"
    for running in ("a", "a,b", "a"):  # a label set that comes back is current again
        metrics.publish({(key, ("8", running, "")): 0.0}, [])
        assert current(metrics) == {"model": "lora_llm", "version": "1", "max_lora": "8",
                               "running_lora_adapters": running, "waiting_lora_adapters": ""}
    calls = [m.value for m in pb.families[-1].metrics]
    metrics.publish({(key, ("8", "a", "")): 0.0}, [])  # unchanged: no IPC
    assert [m.value for m in pb.families[-1].metrics] == calls


def test_the_info_family_is_made_anew_past_its_bound(monkeypatch):
    pb = Pb()
    metrics = TritonMetrics(pb, "lora_llm", "1")
    monkeypatch.setattr("loraplex.triton.metrics_publisher.time.time", lambda: 1000.0)  # a clock that stands still
    first = [f for f in pb.families if f.name == "loraplex_lora_requests_info"][0]
    for i in range(MAX_INFO_SERIES + 1):
        metrics.publish({("lora_requests_info", ("8", f"a{i}", "")): 0.0}, [])
        assert current(metrics)["running_lora_adapters"] == f"a{i}"  # values still grow
    families = [f for f in pb.families if f.name == "loraplex_lora_requests_info"]
    assert len(families) == 2 and len(first.metrics) == MAX_INFO_SERIES and len(families[1].metrics) == 1
    assert metrics._families["lora_requests_info"] is families[1]  # the old one is released (Triton drops it)
