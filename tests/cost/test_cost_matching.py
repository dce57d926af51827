"""Cost of matching a structured-output grammar a tenant sends, step by step on the engine loop
(worker/grammar_mask.py): an ambiguous grammar that compiles at once but whose matching grows with every token
(xgrammar's Earley parser keeps every parse), generated for n and 2n tokens through an in-process engine on the
demo model. Its sample is ended at its matching budget (worker/grammar_budget.py), so the cost at 2n is the cost
at n: bounded, whatever max_tokens asks."""

import itertools
import os
from pathlib import Path

from cost_harness import assert_linear

# no end (root is never complete): the sample runs to its max_tokens or its budget
HOSTILE = 'root ::= x root\nx ::= x y | y x | "a" | "b"\ny ::= x x | "a" | ""'
_engines: list = []
_ids = itertools.count()


def _engine():
    """One engine per child (repeats share it), on the demo model, every knob at its default."""
    if not _engines:
        from loraplex.config import EngineConfig
        from loraplex.engine.llm_engine import LLMEngine
        from loraplex.models.builtin.demo import default_out_dir

        demo = Path(os.environ.get("LORAPLEX_DEMO_DIR", default_out_dir()))
        _engines.append(LLMEngine(EngineConfig(model_dir=str(demo / "model"))))
    return _engines[0]


def _generated(engine, request) -> None:
    """Run the request to its end; its error (if any) raised, so the harness reports how it ended."""
    outputs = engine.generate([request])[request.request_id]
    if outputs[-1].error is not None:
        raise outputs[-1].error


def ambiguous_grammar_matched(n: int):
    """One sample under the ambiguous grammar, asked for n tokens, greedy (the grammar compiled before timing)."""
    from loraplex.engine.request import SamplingParams

    engine = _engine()
    request = engine.make_request(f"hostile-{next(_ids)}", "Hello", SamplingParams.from_dict(
        {"max_tokens": n, "temperature": 0, "structured_outputs": {"grammar": HOSTILE}}))
    return lambda: _generated(engine, request)


def test_an_ambiguous_grammar_is_matched_within_its_budget(demo):
    small, large = assert_linear(ambiguous_grammar_matched, 96, max_seconds=1.5, repeats=1, timeout_s=60)
    assert large.raised and large.raised.startswith("InvalidRequest: structured_outputs: matching the grammar took")
