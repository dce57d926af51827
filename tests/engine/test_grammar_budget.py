"""A constrained sample over its matching budget (worker/grammar_budget.py) fails its request alone: one final
error naming structured_outputs, its KV blocks and adapter pin returned, while the other rows of its steps go on
token for token; and what the matching took is counted per tenant."""

from __future__ import annotations

import pytest

from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.request import SamplingParams
from loraplex.exceptions import InvalidRequest
from loraplex.worker.grammar_budget import GrammarBudget

# An ambiguous grammar with no end: its matching cost grows with every token (xgrammar's Earley parser keeps
# every parse), so the default budget ends it within a few dozen tokens on any machine.
HOSTILE = 'root ::= x root\nx ::= x y | y x | "a" | "b"\ny ::= x x | "a" | ""'
MAX_TOKENS = 200
NEIGHBOUR_TOKENS = 24


TOKEN_MS, MEAN_MS = 4.0, 0.8  # not the defaults: the knobs are seen to reach the runner


@pytest.fixture(scope="module")
def engine(demo):
    return LLMEngine(EngineConfig(model_dir=str(demo["model"]), multi_lora={"demo-a": str(demo["demo-a"])},
                                  grammar_token_budget_ms=TOKEN_MS, grammar_mean_budget_ms=MEAN_MS))


def _neighbour(engine: LLMEngine, rid: str):
    return engine.make_request(rid, "The quick brown fox", SamplingParams(max_tokens=NEIGHBOUR_TOKENS, temperature=0,
                                                                         ignore_eos=True), "neighbour")


def test_a_hostile_grammar_is_ended_at_its_budget_and_its_neighbour_keeps_its_exact_tokens(engine):
    alone = engine.generate([_neighbour(engine, "alone")])["alone"]
    want = [t for o in alone for t in o.token_ids]
    assert len(want) == NEIGHBOUR_TOKENS
    hostile = engine.make_request("hostile", "Hello", SamplingParams.from_dict(
        {"max_tokens": MAX_TOKENS, "temperature": 0, "n": 2, "lora_name": "demo-a",
         "structured_outputs": {"grammar": HOSTILE}}), "mallory")
    outputs = engine.generate([hostile, _neighbour(engine, "beside")])
    outs = outputs["hostile"]
    error = outs[-1].error
    assert isinstance(error, InvalidRequest) and str(error).startswith("structured_outputs: matching the grammar took")
    assert "budget" in str(error)
    assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished  # exactly one final response
    assert [o.error is not None for o in outs] == [False] * (len(outs) - 1) + [True]
    streamed = sum(len(o.token_ids) for o in outs)
    assert 0 < streamed < 2 * MAX_TOKENS  # ended mid-stream, by the budget, not by its length
    assert [t for o in outputs["beside"] for t in o.token_ids] == want
    assert outputs["beside"][-1].finish_reason == "length" and outputs["beside"][-1].error is None
    kv = engine.kv_manager
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks  # the hostile samples' blocks went back
    assert engine.adapters.total_pins() == 0 and engine._requests == {}
    spent = engine.runner.grammar_seconds
    assert spent["mallory"] > 0 and "neighbour" not in spent  # counted per tenant, the unconstrained one not at all
    assert engine.snapshot()[("grammar_match_seconds_total", ("mallory",))] == spent["mallory"]


def test_the_knobs_reach_the_runner_and_a_budget_of_zero_lets_the_grammar_run(engine, monkeypatch):
    budget = engine.runner.grammar_budget
    assert (budget.token_ms, budget.mean_ms) == (TOKEN_MS, MEAN_MS)
    monkeypatch.setattr(engine.runner, "grammar_budget", GrammarBudget(token_ms=0, mean_ms=0))
    request = engine.make_request("free", "Hello", SamplingParams.from_dict(
        {"max_tokens": 40, "temperature": 0, "structured_outputs": {"grammar": HOSTILE}}))
    outs = engine.generate([request])["free"]
    assert outs[-1].error is None and sum(len(o.token_ids) for o in outs) == 40
    with pytest.raises(ValueError, match="grammar_token_budget_ms"):
        EngineConfig(grammar_token_budget_ms=-1)
