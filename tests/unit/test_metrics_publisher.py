"""The metrics table and the publisher, against a fake pb_utils that records every call (each is an IPC in Triton)."""

from __future__ import annotations

import time

import pytest

from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.metrics import EXPORTED_METRICS, FAMILIES, HISTOGRAM, PREFIX, UPLOADS, live_values
from loraplex.engine.request import SamplingParams
from loraplex.exceptions import InvalidRequest
from loraplex.triton.metrics_publisher import MetricsPublisher, TritonMetrics, metrics_enabled, start_publisher


class FakePbUtils:
    """pb_utils.MetricFamily's surface: families, metrics with labels (and buckets), and a log of calls."""

    def __init__(self, fail: bool = False):
        self.calls: list[tuple] = []
        self.families: dict[str, FakeFamily] = {}
        outer = self

        class MetricFamily:
            GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"

            def __new__(cls, name, description, kind):
                if fail:
                    raise RuntimeError("metrics are disabled")
                family = outer.families[name] = FakeFamily(outer, name, kind)
                return family

        self.MetricFamily = MetricFamily

    def value(self, name: str, **labels):
        for metric in self.families[name].metrics:
            if all(metric.labels.get(k) == v for k, v in labels.items()):
                return metric.value
        return None


class FakeFamily:
    def __init__(self, pb, name, kind):
        self.pb, self.name, self.kind, self.metrics = pb, name, kind, []

    def Metric(self, labels, buckets=None):  # pb_utils' name
        metric = FakeMetric(self.pb, self, labels, buckets)
        self.metrics.append(metric)
        return metric


class FakeMetric:
    def __init__(self, pb, family, labels, buckets):
        self.pb, self.family, self.labels, self.buckets = pb, family, labels, buckets
        self.value = [] if family.kind == "histogram" else 0

    def set(self, value):
        self.pb.calls.append(("set", self.family.name, value))
        self.value = value

    def increment(self, value):
        assert value > 0
        self.pb.calls.append(("increment", self.family.name, value))
        self.value += value

    def observe(self, value):
        self.pb.calls.append(("observe", self.family.name, value))
        self.value.append(value)


@pytest.fixture(scope="module")
def engine(demo):
    return LLMEngine(EngineConfig(model_dir=str(demo["model"])))


def test_exported_metrics_is_the_table():
    assert EXPORTED_METRICS == {PREFIX + f.name for f in (*FAMILIES, UPLOADS)}
    assert len(EXPORTED_METRICS) == len(FAMILIES) + 1
    for family in (*FAMILIES, UPLOADS):
        assert family.kind != HISTOGRAM or list(family.buckets) == sorted(set(family.buckets)), family.name
        assert family.kind == HISTOGRAM or not family.name.endswith(("_bucket", "_sum", "_count"))


@pytest.mark.parametrize("value, enabled", [(None, True), ("true", True), ("false", False), ("False", False),
                                            ("0", False), ("off", False), ("yes", True)])
def test_report_custom_metrics_parameter(value, enabled):
    config = {} if value is None else {"parameters": {"REPORT_CUSTOM_METRICS": {"string_value": value}}}
    assert metrics_enabled(config) is enabled


def test_publish_sends_only_changes_and_counters_by_delta():
    pb = FakePbUtils()
    metrics = TritonMetrics(pb, "lora_llm", "1")
    metrics.publish({("kv_cache_blocks", ("used",)): 3, ("preemptions_total", ()): 0}, [])
    assert pb.value("loraplex_kv_cache_blocks", state="used", model="lora_llm", version="1") == 3
    assert pb.value("loraplex_preemptions_total") == 0  # a counter shows from 0
    pb.calls.clear()
    metrics.publish({("kv_cache_blocks", ("used",)): 3, ("preemptions_total", ()): 5}, [])
    metrics.publish({("kv_cache_blocks", ("used",)): 3, ("preemptions_total", ()): 7}, [])
    assert pb.calls == [("increment", "loraplex_preemptions_total", 5), ("increment", "loraplex_preemptions_total", 2)]
    metrics.publish({}, [("time_to_first_token_seconds", "acme", 0.5), ("batch_tokens", None, 12)])
    ttft = pb.families["loraplex_time_to_first_token_seconds"].metrics[0]
    assert ttft.labels == {"model": "lora_llm", "version": "1", "tenant": "acme"} and ttft.value == [0.5]
    assert ttft.buckets == list(next(f.buckets for f in FAMILIES if f.name == "time_to_first_token_seconds"))
    assert pb.value("loraplex_batch_tokens") == [12]


def test_publisher_captures_when_due_or_idle_and_publishes_on_its_thread(engine):
    pb = FakePbUtils()
    publisher = start_publisher(pb, {}, "lora_llm", "1", engine)
    assert engine.on_step == publisher.on_step
    try:
        calls = len(pb.calls)
        request = engine.make_request("r", "hello", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), "acme")
        engine.add_request(request)
        while engine.has_work():
            engine.step()
            publisher.on_step(engine)  # what the loop thread does after each step
        deadline = time.monotonic() + 5
        while pb.value("loraplex_request_success_total", tenant="acme") != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pb.value("loraplex_request_success_total", tenant="acme") == 1
        assert pb.value("loraplex_generation_tokens_total", tenant="acme") == 3
        assert pb.value("loraplex_requests_running", tenant="acme") == 0
        assert len(pb.calls) > calls
        engine.stats.refuse("acme", InvalidRequest("bad"))
        publisher.wake()
        deadline = time.monotonic() + 5
        while pb.value("loraplex_request_failure_total", tenant="acme", reason="invalid") != 1 \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pb.value("loraplex_request_failure_total", tenant="acme", reason="invalid") == 1
    finally:
        publisher.stop(engine)
        engine.on_step = None
    assert not publisher._thread.is_alive()


def test_a_snapshot_is_not_taken_every_step(engine, monkeypatch):
    publisher = MetricsPublisher(TritonMetrics(FakePbUtils(), "m", "1"), engine.stats)
    taken = []
    monkeypatch.setattr(engine, "snapshot", lambda: taken.append(1) or {})
    monkeypatch.setattr(engine, "has_work", lambda: True)
    for _ in range(100):
        publisher.on_step(engine)
    assert len(taken) == 1  # the rest fell within CAPTURE_SECONDS
    monkeypatch.setattr(engine, "has_work", lambda: False)
    publisher.on_step(engine)
    assert len(taken) == 2  # going idle always hands one over


def test_metrics_off_or_unavailable_serve_without_them(engine):
    for pb, config in ((FakePbUtils(), {"parameters": {"REPORT_CUSTOM_METRICS": {"string_value": "false"}}}),
                       (FakePbUtils(fail=True), {})):
        engine.on_step = None
        assert start_publisher(pb, config, "lora_llm", "1", engine) is None
        assert engine.on_step is None and pb.calls == []
        engine.stats.step(1, 1, 0.0)
        assert engine.stats.drain() == []  # nobody would drain them: none are kept


def test_the_snapshot_and_live_values_name_only_known_families(engine):
    names = {f.name for f in FAMILIES}
    assert {name for name, _ in engine.snapshot()} <= names
    assert {name for name, _ in live_values(engine.stats)} <= names


def test_a_tenants_grammar_matching_time_is_a_counter_of_its_own(engine, monkeypatch):
    # what the runner counts per tenant label (tests/engine/test_grammar_budget.py counts it from real matching)
    monkeypatch.setattr(engine.runner, "grammar_seconds", {"acme": 0.25, "t0123456789ab": 0.5})
    pb = FakePbUtils()
    metrics = TritonMetrics(pb, "lora_llm", "1")
    metrics.publish(engine.snapshot(), [])
    assert pb.value("loraplex_grammar_match_seconds_total", tenant="acme") == 0.25
    assert pb.value("loraplex_grammar_match_seconds_total", tenant="t0123456789ab") == 0.5
    engine.runner.grammar_seconds["acme"] = 0.75
    pb.calls.clear()
    metrics.publish(engine.snapshot(), [])
    assert pb.calls == [("increment", "loraplex_grammar_match_seconds_total", 0.5)]
    assert PREFIX + "grammar_match_seconds_total" in EXPORTED_METRICS
