"""engine/constraints.py: vLLM's keys parsed, compiles cached, bounded per tenant and in time."""

from __future__ import annotations

import json
import threading

import pytest

from loraplex.engine import constraints
from loraplex.engine.constraints import Constraint, ConstraintCompiler, parse_guided, parse_structured_outputs
from loraplex.exceptions import InvalidRequest, QuotaExceeded


@pytest.fixture(scope="module")
def tokenizer(demo):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo["model"])


def compiler_for(tokenizer, **kw) -> ConstraintCompiler:
    return ConstraintCompiler(tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id], **kw)


def test_vllms_spellings_parse_to_one_constraint():
    choice = Constraint("choice", json.dumps(["a", "b"]))
    assert parse_structured_outputs({"choice": ["a", "b"]}) == choice
    assert parse_structured_outputs(json.dumps({"choice": ["a", "b"]})) == choice  # vllm_backend sends a string
    assert parse_guided("guided_choice", ["a", "b"]) == choice
    schema = {"type": "object", "properties": {"b": {}, "a": {}}}
    assert parse_structured_outputs({"json": json.dumps(schema)}) == parse_guided("guided_json", schema)
    assert parse_structured_outputs({"json_object": True}).kind == "json_object"
    assert not parse_structured_outputs({"regex": "x", "disable_any_whitespace": True}).any_whitespace
    assert parse_structured_outputs(None) is None and parse_guided("guided_regex", None) is None


def test_a_compiled_constraint_is_cached_and_costs_no_compile(tokenizer):
    compiler = compiler_for(tokenizer)
    constraint = Constraint("regex", "[0-9]{3}")
    first = compiler.compile(constraint, "acme")
    assert compiler.compile(constraint, "acme") is first and compiler.compiled == 1


def test_the_cache_drops_the_least_recently_used_past_its_bytes(tokenizer, monkeypatch):
    compiler = compiler_for(tokenizer)
    one, two, three = (Constraint("regex", r) for r in ("a+", "b+", "c+"))
    size = compiler.compile(one).memory_size_bytes
    monkeypatch.setattr(constraints, "CACHE_BYTES", 2 * size + size // 2)  # room for two of these
    compiler.compile(two)
    compiler.compile(one)  # used again: two is now the least recently used
    compiler.compile(three)
    assert list(compiler._cache) == [one, three] and compiler.compiled == 3


def test_a_tenant_compiles_one_at_a_time_and_others_are_not_held(tokenizer):
    compiler = compiler_for(tokenizer)
    started, release = threading.Event(), threading.Event()
    real = compiler._compile_now

    def slow(constraint):
        if constraint.spec == "slow":
            started.set()
            release.wait(10)
        return real(constraint)

    compiler._compile_now = slow
    waiting = threading.Thread(target=compiler.compile, args=(Constraint("regex", "slow"), "hostile"))
    waiting.start()
    assert started.wait(10)
    with pytest.raises(QuotaExceeded, match="compiling"):
        compiler.compile(Constraint("regex", "other"), "hostile")
    assert compiler.compile(Constraint("regex", "[ab]"), "polite") is not None  # the other thread serves others
    release.set()
    waiting.join(10)
    assert compiler.compile(Constraint("regex", "other"), "hostile") is not None  # its turn again
    assert compiler._in_flight == {}


def test_a_compile_over_its_bound_is_refused_naming_the_constraint(tokenizer):
    compiler = compiler_for(tokenizer, timeout_s=0.05)
    release = threading.Event()
    compiler._compile_now = lambda constraint: release.wait(10)
    with pytest.raises(InvalidRequest, match=r"structured_outputs.grammar: compiling it took over 0.05 s"):
        compiler.compile(Constraint("grammar", 'root ::= "x"'))
    release.set()
