"""EngineStats: what the engine records for metrics, checked on the demo engine stepped by the test."""

from __future__ import annotations

import pytest

from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.stats import (
    BATCH_SEQUENCES, BATCH_TOKENS, E2E, QUEUE, STEP_HOST, TPOT, TTFT, EngineStats, failure_reason,
)
from loraplex.exceptions import (AdapterError, AdapterNotFound, EngineOverloaded, EngineShuttingDown, InvalidApiKey, InvalidRequest, QuotaExceeded, RequestCancelled)
from loraplex.engine.request import SamplingParams


@pytest.fixture(scope="module")
def engine(demo):
    return LLMEngine(EngineConfig(model_dir=str(demo["model"]), multi_lora={"demo-a": str(demo["demo-a"])}))


def by_name(observations) -> dict[str, list]:
    grouped: dict[str, list] = {}
    for name, label, value in observations:
        grouped.setdefault(name, []).append((label, value))
    return grouped


def test_failure_reasons():
    assert failure_reason(InvalidApiKey()) == "unauthenticated"
    assert failure_reason(InvalidRequest("x")) == "invalid"
    assert failure_reason(AdapterError("x")) == "invalid"
    assert failure_reason(AdapterNotFound("x")) == "not_found"
    assert failure_reason(QuotaExceeded("x")) == failure_reason(EngineOverloaded("x")) == "quota"
    assert failure_reason(RequestCancelled("x")) == failure_reason(EngineShuttingDown("x")) == "cancelled"
    assert failure_reason(RuntimeError("x")) == failure_reason(None) == "internal"


def test_requests_tokens_and_latencies_are_recorded_once_per_request(engine):
    engine.stats = stats = EngineStats()
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    two = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, n=2)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    requests = [engine.make_request("a", "hello there", params, "acme"),
                engine.make_request("b", "forked", two, "acme"),
                engine.make_request("c", "single", one, "globex")]
    assert stats.requests_by_state() == ({}, {})
    engine.generate(requests)
    assert stats.requests_by_state() == ({"acme": 0, "globex": 0}, {"acme": 0, "globex": 0})
    prompt = {label: sum(len(r.prompt_token_ids) for r in requests if r.metric_label == label)
              for label in ("acme", "globex")}
    assert stats.prompt_tokens == prompt
    assert stats.succeeded == {"acme": 2, "globex": 1} and stats.failures() == {}
    seen = by_name(stats.drain())
    assert sorted(label for label, _ in seen[QUEUE]) == ["acme", "acme", "globex"]
    assert sorted(label for label, _ in seen[TTFT]) == ["acme", "acme", "globex"]
    assert sorted(label for label, _ in seen[E2E]) == ["acme", "acme", "globex"]
    assert sorted(label for label, _ in seen[TPOT]) == ["acme", "acme"]  # a 1-token request has no interval
    assert all(v >= 0 for name in (QUEUE, TTFT, E2E, TPOT) for _, v in seen[name])
    steps = engine.num_steps
    assert len(seen[BATCH_SEQUENCES]) == len(seen[BATCH_TOKENS]) == len(seen[STEP_HOST]) > 0
    assert sum(v for _, v in seen[BATCH_TOKENS]) == sum(len(r.prompt_token_ids) for r in requests) + 4 + 2 * 2
    assert max(v for _, v in seen[BATCH_SEQUENCES]) <= 4 and steps >= len(seen[STEP_HOST])
    assert stats.drain() == []


def test_failures_by_reason(engine):
    engine.stats = stats = EngineStats()
    timed_out = engine.make_request("t", "too slow", SamplingParams(max_tokens=50, ignore_eos=True, timeout=1e-9), "acme")
    cancelled = engine.make_request("c", "cancel me", SamplingParams(max_tokens=50, ignore_eos=True), "acme")
    engine.add_request(timed_out)
    engine.add_request(cancelled)
    engine.step()
    _, waiting = stats.requests_by_state()
    engine.abort("c")
    engine.generate([])
    while engine.has_work():
        engine.step()
    stats.refuse("other", InvalidApiKey())
    stats.refuse("acme", AdapterNotFound("nope"))
    assert stats.failures() == {("acme", "timeout"): 1, ("acme", "cancelled"): 1, ("other", "unauthenticated"): 1,
                                ("acme", "not_found"): 1}
    assert stats.succeeded == {}
    assert stats.requests_by_state() == ({"acme": 0}, {"acme": 0})
    assert len(by_name(stats.drain())[E2E]) == 2
