"""Cost of the structured-output constraints a tenant sends (engine/constraints.py), parsed and compiled as
make_request does on an admission worker, each at n and 2n: deep JSON schemas, regexes and grammars with groups
nested deep (refused before xgrammar), and a big regex of many shallow groups that passes those checks and
compiles past its bound (stopped: its worker process is killed). The harness counts the engine process's CPU
(a compile's worker is another process: the big regex's case checks that it is gone once refused)."""

from pathlib import Path

from cost_harness import assert_linear

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = ROOT / ".cache" / "smollm2" / "model"  # a real vocabulary: 49,152 tokens
_compilers: dict = {}


def _compiler(timeout_s: float = 10.0):
    """One compiler per child (repeats share it), on SmolLM2's tokenizer, one worker."""
    if timeout_s not in _compilers:
        from transformers import AutoTokenizer

        from loraplex.engine.constraints import ConstraintCompiler

        tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
        args = (tokenizer, len(tokenizer), [tokenizer.eos_token_id], timeout_s)
        try:
            _compilers[timeout_s] = ConstraintCompiler(*args, workers=1)
        except TypeError:  # the code before compile workers (it fails these cases by their cost, not here)
            _compilers[timeout_s] = ConstraintCompiler(*args)
    return _compilers[timeout_s]


def _compile(constraint):
    return _compiler().compile(constraint, "tenant")


def _parsed_and_compiled(fields: dict):
    """Parsed, then compiled (the tokenizer loaded at the first compile: a refusal before it costs no start-up)."""
    from loraplex.engine.constraints import parse_structured_outputs

    return lambda: _compile(parse_structured_outputs(fields))


def deep_json_schema(n: int):
    """An object nested in an object n times (the issue's schema: 8.8 s at 400 before)."""
    schema: dict = {"type": "string"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return _parsed_and_compiled({"json": schema})


def _nested_alternation(depth: int, grammar: bool) -> str:
    """(a|(a|(...b)*)*)*: xgrammar's compile grows about as depth³ on this vocabulary."""
    a, b = ('"a"', '"b"') if grammar else ("a", "b")
    return f"({a} | " * depth + b + ")*" * depth if grammar else f"({a}|" * depth + b + ")*" * depth


def nested_regex(n: int):
    return _parsed_and_compiled({"regex": _nested_alternation(n, grammar=False)})


def nested_grammar(n: int):
    return _parsed_and_compiled({"grammar": "root ::= " + _nested_alternation(n, grammar=True)})


def big_regex_past_its_bound(n: int):
    """n groups, each nested 16 deep (within the checks), in a row: each costs xgrammar about 0.2 s here, so the
    compile runs past its 1 s bound; refused, its worker process killed."""
    from loraplex.engine.constraints import Constraint, parse_structured_outputs
    from loraplex.launch.processes import process_running

    compiler = _compiler(timeout_s=1.0)
    compiler.compile(Constraint("regex", f"warm{n}"), "warm-up")  # a worker up and idle, xgrammar loaded: not timed
    constraint = parse_structured_outputs({"regex": _nested_alternation(16, grammar=False) * n})

    def call():
        workers = getattr(compiler, "worker_pids", list)()  # the one that will run it
        try:
            compiler.compile(constraint, "tenant")
        finally:
            if not workers or any(process_running(pid) for pid in workers):
                raise RuntimeError("the compile was not stopped with its worker")

    return call


def test_a_deep_json_schema_is_refused_before_xgrammar():
    small, large = assert_linear(deep_json_schema, 200, max_seconds=0.5, repeats=1, mem_mb=3072)
    assert "json nests more than 64 levels deep" in large.raised


def test_a_regex_of_deeply_nested_groups_is_refused_before_xgrammar():
    small, large = assert_linear(nested_regex, 64, max_seconds=0.5, repeats=1, mem_mb=3072)
    assert "regex nests its groups 128 deep" in large.raised


def test_a_grammar_of_deeply_nested_groups_is_refused_before_xgrammar():
    small, large = assert_linear(nested_grammar, 64, max_seconds=0.5, repeats=1, mem_mb=3072)
    assert "grammar nests its groups 128 deep" in large.raised


def test_a_big_regex_compiling_past_its_bound_is_stopped_with_its_worker():
    small, large = assert_linear(big_regex_past_its_bound, 100, max_seconds=0.5, repeats=1, mem_mb=4096,
                                 timeout_s=90)
    for cost in (small, large):
        assert cost.raised.startswith("InvalidRequest") and "took over 1 s (the compile was stopped)" in cost.raised
