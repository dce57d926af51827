"""Structured outputs in the shared batch, against transformers + peft generating under xgrammar's own
HF logits processor on the same constraint: token for token, base model and both demo adapters, with
unconstrained rows in the same steps that stay equal to their unconstrained references."""

from __future__ import annotations

import json

import jsonschema
import pytest
from peft_reference import greedy_constrained, greedy_tokens

from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.request import SamplingParams
from loraplex.exceptions import InvalidRequest

MAX_TOKENS = 48
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
# (prompt, adapter, sampling parameters that constrain it; None: unconstrained)
ROWS = [
    ("Give me a person as JSON:", None, {"structured_outputs": {"json": SCHEMA}}),
    ("Give me a person as JSON:", "demo-a", {"guided_json": json.dumps(SCHEMA)}),
    ("Is LoRA cheap?", "demo-b", {"structured_outputs": json.dumps({"choice": ["Positive", "Negative"]})}),
    ("A date:", None, {"structured_outputs": {"regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"}}),
    ("Any JSON object:", "demo-a", {"structured_outputs": {"json_object": True}}),
    ("Count:", "demo-b", {"guided_grammar": 'root ::= "one" (", " ("two" | "three"))*'}),
    ("The quick brown fox", None, None),
    ("The quick brown fox", "demo-a", None),
    ("LoRA adapters share one base model", "demo-b", None),
]


@pytest.fixture(scope="module")
def engine(demo):
    adapters = {name: str(demo[name]) for name in ("demo-a", "demo-b")}
    return LLMEngine(EngineConfig(model_dir=str(demo["model"]), multi_lora=adapters))


def params(extra: dict | None, lora: str | None, **kw) -> SamplingParams:
    return SamplingParams.from_dict({"max_tokens": MAX_TOKENS, "temperature": 0, "lora_name": lora,
                                     **(extra or {}), **kw})


def tokens_of(outputs) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


def test_constrained_and_free_rows_in_one_batch_equal_peft_under_xgrammars_processor(engine, demo):
    requests = [engine.make_request(f"r{i}", prompt, params(extra, lora)) for i, (prompt, lora, extra) in enumerate(ROWS)]
    outputs = engine.generate(requests)
    for i, ((prompt, lora, extra), request) in enumerate(zip(ROWS, requests)):
        adapter = str(demo[lora]) if lora else None
        if extra is None:
            want = greedy_tokens(str(demo["model"]), adapter, request.prompt_token_ids, MAX_TOKENS)
        else:
            want = greedy_constrained(str(demo["model"]), adapter, request.prompt_token_ids, MAX_TOKENS,
                                      request.grammar)
        got = outputs[f"r{i}"]
        assert tokens_of(got) == want, (prompt, lora, extra)
        assert got[-1].finished and got[-1].error is None
    text = {i: "".join(o.text for o in outputs[f"r{i}"]) for i in range(len(ROWS))}
    for i in (0, 1):  # ended by themselves: the schema's JSON
        if outputs[f"r{i}"][-1].finish_reason == "stop":
            jsonschema.validate(json.loads(text[i]), SCHEMA)
    assert text[2] in ("Positive", "Negative") and outputs["r2"][-1].finish_reason == "stop"


def test_each_sample_has_its_own_matcher_and_ends_where_the_grammar_may(engine):
    choices = ["alpha", "beta", "gamma", "delta"]
    request = engine.make_request("n4", "Pick one:", params({"guided_choice": choices}, "demo-a", n=4, seed=3,
                                                             temperature=1.0))
    outs = engine.generate([request])["n4"]
    for index in range(4):
        mine = [o for o in outs if o.index == index]
        assert "".join(o.text for o in mine) in choices and mine[-1].finish_reason == "stop"


NESTED: dict = {"type": "string"}
for _ in range(40):  # 81 levels as a JSON document
    NESTED = {"type": "object", "properties": {"a": NESTED}}


@pytest.mark.parametrize("extra, message", [
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}, "json"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "regex"),
    ({"structured_outputs": {"grammar": "root ::= missing_rule"}}, "grammar"),
    ({"guided_json": "{" * 100}, "json"),
    ({"structured_outputs": {"regex": "a" * 70000}}, "over 65536 bytes"),
    ({"guided_json": json.dumps(NESTED)}, "json nests more than 64 levels deep"),
    ({"structured_outputs": {"regex": "(a|" * 33 + "b" + ")*" * 33}}, "regex nests its groups 33 deep"),
])
def test_a_bad_constraint_is_refused_at_once_naming_what_is_wrong(engine, extra, message):
    with pytest.raises(InvalidRequest, match=message):
        engine.make_request("bad", "Hello", params(extra, None))
    ok = engine.make_request("ok", "Hello", params({"guided_choice": ["yes", "no"]}, None))  # the engine serves on
    assert "".join(o.text for o in engine.generate([ok])["ok"]) in ("yes", "no")


def test_constraints_compile_in_a_worker_and_each_tenant_has_its_own_cache(engine):
    extra = {"structured_outputs": {"regex": "[a-c]{4}"}}
    compiled = engine.constraints.compiled
    mine = engine.make_request("acme-1", "Hello", params(extra, None), "acme")
    assert engine.make_request("acme-2", "Hello", params(extra, None), "acme").grammar is mine.grammar
    theirs = engine.make_request("globex-1", "Hello", params(extra, None), "globex")
    assert theirs.grammar is not mine.grammar and engine.constraints.compiled == compiled + 2  # no hit across
    assert engine.constraints.worker_pids()  # the compiles ran in a worker process first
    text = "".join(o.text for o in engine.generate([theirs])["globex-1"])
    assert len(text) == 4 and set(text) <= set("abc")


# ---- property: random schemas -------------------------------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(lambda values: {"enum": values}, st.lists(st.sampled_from(["x", "yy", 3, True, None]), min_size=1,
                                                        max_size=3, unique=True)),
    st.just({"type": "null"}),
)


def _object(props: dict, required: list[bool]) -> dict:
    return {"type": "object", "properties": props, "additionalProperties": False,
            "required": [name for name, needed in zip(props, required) if needed]}


SCHEMAS = st.recursive(
    LEAVES,
    lambda inner: st.one_of(
        st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, inner, st.integers(0, 3)),
        st.dictionaries(st.sampled_from(["a", "b", "key", "v1"]), inner, min_size=1, max_size=3).flatmap(
            lambda props: st.lists(st.booleans(), min_size=len(props), max_size=len(props)).map(
                lambda req: _object(props, req))),
    ),
    max_leaves=6,
)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=SCHEMAS, seed=st.integers(0, 2**31 - 1), lora=st.sampled_from([None, "demo-a", "demo-b"]))
def test_every_sampled_output_that_ends_by_itself_validates_against_its_random_schema(engine, schema, seed, lora):
    # sampled (temperature 1, seeded), whitespace compact so outputs end within the token budget
    constraint = {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}
    request = engine.make_request("p", "JSON:", params(constraint, lora, temperature=1.0, seed=seed, n=2,
                                                       max_tokens=96))
    outs = engine.generate([request])["p"]
    for index in (0, 1):
        mine = [o for o in outs if o.index == index]
        assert mine[-1].error is None
        if mine[-1].finish_reason == "stop":
            text = "".join(o.text for o in mine)
            assert "\ufffd" not in text  # valid UTF-8: no surrogate's bytes, no stray byte
            jsonschema.validate(json.loads(text), schema)
