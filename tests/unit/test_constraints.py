"""engine/constraints.py: vLLM's keys parsed and checked, compiles in worker processes stopped at their bound,
queued compiles withdrawn, the cache per tenant with protected shares.

The pool's tests run fake workers (tests/support/fake_compile_worker.py: the real worker's life around a compile
that does what the constraint's text says); one test compiles with xgrammar for real."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

from loraplex.engine.constraints import Constraint, ConstraintCompiler, parse_guided, parse_structured_outputs
from loraplex.engine.grammar_cache import GrammarCache
from loraplex.exceptions import (EngineOverloaded, EngineShuttingDown, InvalidRequest, QuotaExceeded,
                                 RequestCancelled)
from loraplex.launch.processes import process_running

FAKE_WORKER = [sys.executable, str(Path(__file__).resolve().parents[1] / "support" / "fake_compile_worker.py")]


class Compiled:
    """The engine-side compile's result in the fake tests: a grammar of a given size."""

    def __init__(self, spec: str, size: int):
        self.spec, self.memory_size_bytes = spec, size


@pytest.fixture
def jobs(tmp_path, monkeypatch) -> Path:
    """The file where fake workers write each job's text as it arrives."""
    log = tmp_path / "jobs.log"
    monkeypatch.setenv("LORAPLEX_FAKE_COMPILE_LOG", str(log))
    return log


@pytest.fixture
def fake_compiler(jobs):
    made = []

    def make(timeout_s: float = 10.0, size: int = 1000, **kw) -> ConstraintCompiler:
        compiler = ConstraintCompiler(None, 0, [], timeout_s, worker_command=FAKE_WORKER, **kw)
        compiler._worker_init = lambda: {}
        compiler._compile_here = lambda constraint: Compiled(constraint.spec, size)
        made.append(compiler)
        return compiler

    yield make
    for compiler in made:
        compiler.close()


def received(jobs: Path) -> list[str]:
    return jobs.read_text().splitlines() if jobs.exists() else []


def until(condition, what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def in_thread(fn, *args, **kw) -> tuple[threading.Thread, list]:
    """fn run on a thread; the list gets its result or the exception it raised."""
    out = []

    def run():
        try:
            out.append(fn(*args, **kw))
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def regex(spec: str) -> Constraint:
    return Constraint("regex", spec)


# ---- parsing and the checks before xgrammar ----------------------------------------------------------------------
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


def nested_objects(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_a_schema_nested_past_its_bound_is_refused_before_xgrammar():
    assert parse_structured_outputs({"json": nested_objects(20)}).kind == "json"  # 41 levels as a document
    with pytest.raises(InvalidRequest, match="structured_outputs: json nests more than 64 levels deep"):
        parse_structured_outputs({"json": nested_objects(40)})
    with pytest.raises(InvalidRequest, match="nests more than 64"):  # far past Python's recursion: no RecursionError
        parse_guided("guided_json", nested_objects(10_000))


def test_groups_nested_past_the_bound_are_refused_in_regexes_grammars_and_schema_patterns():
    deep, ok = "(" * 33 + "a" + ")" * 33, "(" * 32 + "a" + ")" * 32
    assert parse_structured_outputs({"regex": ok}).spec == ok
    with pytest.raises(InvalidRequest, match="structured_outputs: regex nests its groups 33 deep, more than 32"):
        parse_structured_outputs({"regex": deep})
    with pytest.raises(InvalidRequest, match="grammar nests its groups 33 deep"):
        parse_guided("guided_grammar", "root ::= " + '("a" ' * 33 + ")" * 33)
    with pytest.raises(InvalidRequest, match="a pattern in json nests its groups 33 deep"):
        parse_structured_outputs({"json": {"type": "object", "properties": {"s": {"type": "string", "pattern": deep}}}})
    with pytest.raises(InvalidRequest, match="a patternProperties key in json"):
        parse_structured_outputs({"json": {"type": "object", "patternProperties": {deep: {}}}})
    # parentheses that are not groups: escaped, in a class, in a grammar's string literal or comment
    for spec in ["\\(" * 40, "[" + "(" * 40 + "]", "[]" + "(" * 40 + "]", "[^]" + "(" * 40 + "]"]:
        assert parse_structured_outputs({"regex": spec}).spec == spec
    grammar = 'root ::= "' + "(" * 40 + "\" [" + "(" * 40 + "] # " + "(" * 40 + "\n"
    assert parse_guided("guided_grammar", grammar).spec == grammar


# ---- compiles with xgrammar ----------------------------------------------------------------------------------------
def test_a_compiled_constraint_is_cached_per_tenant_and_costs_no_compile(demo):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo["model"])
    compiler = ConstraintCompiler(tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id], workers=1)
    try:
        constraint = regex("[0-9]{3}")
        first = compiler.compile(constraint, "acme")
        assert compiler.worker_pids() and type(first).__name__ == "CompiledGrammar"  # a worker compiled it first
        assert compiler.compile(constraint, "acme") is first and compiler.compiled == 1
        other = compiler.compile(constraint, "globex")  # not acme's hit: compiled again, for globex
        assert other is not first and compiler.compiled == 2
        assert compiler.compile(constraint, "acme") is first and compiler.compile(constraint, "globex") is other
        with pytest.raises(InvalidRequest, match=r"structured_outputs.regex is not valid: .*parenthesis"):
            compiler.compile(regex("(unclosed"), "acme")  # xgrammar's refusal, from the worker
    finally:
        compiler.close()


# ---- the worker processes ----------------------------------------------------------------------------------------
def test_a_compile_over_its_bound_is_refused_naming_the_constraint(fake_compiler):
    """... and stopped: its worker process is killed (its CPU stops) and another serves the next compile."""
    compiler = fake_compiler(timeout_s=0.3, workers=1)
    compiler.compile(regex("warm"))
    [worker] = compiler.worker_pids()
    with pytest.raises(InvalidRequest, match=r"structured_outputs.regex: compiling it took over 0.3 s "
                                             r"\(the compile was stopped\)"):
        compiler.compile(regex("spin"))  # burns CPU until killed
    assert not process_running(worker)  # killed and reaped: its CPU stopped
    assert compiler.compile(regex("after"), "other").spec == "after"
    assert compiler.worker_pids() and worker not in compiler.worker_pids()


def test_a_compile_over_its_memory_bound_is_refused_and_compiles_go_on(fake_compiler):
    compiler = fake_compiler(workers=1, memory_bytes=256 << 20)
    with pytest.raises(InvalidRequest, match="structured_outputs.regex: compiling it needed over 256 MiB of memory"):
        compiler.compile(regex("hog"))  # 8 GiB under the worker's rlimit
    assert compiler.compile(regex("next")).spec == "next"


def test_a_worker_that_dies_mid_compile_refuses_that_constraint_only(fake_compiler):
    compiler = fake_compiler(workers=1)
    with pytest.raises(InvalidRequest, match=r"compiling it stopped: its worker process died \(exit status 3\)"):
        compiler.compile(regex("die"))
    with pytest.raises(InvalidRequest, match="structured_outputs.regex is not valid: cannot compile 'bad'"):
        compiler.compile(regex("bad"))
    assert compiler.compile(regex("chatty")).spec == "chatty"  # its print went to stderr, not into the replies
    assert compiler.compile(regex("next")).spec == "next"


def test_a_refused_requests_queued_compile_never_runs(fake_compiler, jobs, tmp_path):
    compiler = fake_compiler(workers=1, wait_s=0.2)
    release = tmp_path / "release"
    holder, held = in_thread(compiler.compile, regex(f"hold:{release}"), "acme")
    until(lambda: received(jobs), "the held compile started")
    with pytest.raises(EngineOverloaded, match=r"structured_outputs.regex: every compile worker was busy for 0.2 s"):
        compiler.compile(regex("queued-then-refused"), "globex")
    release.touch()
    holder.join(10)
    assert held[0].spec == f"hold:{release}"
    assert compiler.compile(regex("after"), "globex").spec == "after"  # its allowance is back
    assert received(jobs) == [f"hold:{release}", "after"]  # the refused one never reached a worker


def test_a_cancelled_requests_queued_compile_never_runs(fake_compiler, jobs, tmp_path):
    compiler = fake_compiler(workers=1)
    release = tmp_path / "release"
    holder, _ = in_thread(compiler.compile, regex(f"hold:{release}"), "acme")
    until(lambda: received(jobs), "the held compile started")
    asked = []
    with pytest.raises(RequestCancelled, match="cancelled while its structured_outputs.regex compiled"):
        compiler.compile(regex("queued-then-cancelled"), "globex", cancelled=lambda: asked.append(1) or True)
    assert asked
    release.touch()
    holder.join(10)
    assert compiler.compile(regex("after"), "globex").spec == "after"
    assert received(jobs) == [f"hold:{release}", "after"]


def test_a_tenant_compiles_one_at_a_time_and_others_are_not_held(fake_compiler, jobs, tmp_path):
    compiler = fake_compiler(workers=2)
    release = tmp_path / "release"
    holder, _ = in_thread(compiler.compile, regex(f"hold:{release}"), "hostile")
    until(lambda: received(jobs), "the held compile started")
    with pytest.raises(QuotaExceeded, match="compiling"):
        compiler.compile(regex("other"), "hostile")
    assert compiler.compile(regex("polite"), "polite").spec == "polite"  # the other worker serves others
    release.touch()
    holder.join(10)
    assert compiler.compile(regex("other"), "hostile").spec == "other"  # its turn again
    assert compiler._in_flight == {}


def test_a_tenants_next_compile_never_sees_its_finished_one_in_flight(fake_compiler, monkeypatch):
    """A future's waiter can wake before its done-callbacks run (CI saw it under load): a tenant's back-to-back
    compiles must not be refused as 'compiling' for a compile that has already returned."""
    from concurrent.futures import Future

    invoke = Future._invoke_callbacks
    monkeypatch.setattr(Future, "_invoke_callbacks", lambda self: (time.sleep(0.3), invoke(self)))
    compiler = fake_compiler(workers=1)
    for spec in ("first", "second", "third"):
        assert compiler.compile(regex(spec), "tenant").spec == spec
    until(lambda: compiler._in_flight == {}, "every compile settled")
    assert compiler.compiled == 3 and compiler.compile(regex("first"), "tenant").spec == "first"  # cached once


def test_a_tenant_whose_compile_was_stopped_waits_behind_the_others(fake_compiler, jobs, tmp_path):
    compiler = fake_compiler(workers=1)
    with pytest.raises(InvalidRequest, match="stopped"):
        compiler.compile(regex("die"), "hostile")
    release = tmp_path / "release"
    threads = [in_thread(compiler.compile, regex(f"hold:{release}"), "acme")[0]]
    until(lambda: len(received(jobs)) == 2, "the held compile started")
    threads.append(in_thread(compiler.compile, regex("hostile-again"), "hostile")[0])
    until(lambda: len(compiler._pool._queues[1]) == 1, "the hostile compile waits")
    threads.append(in_thread(compiler.compile, regex("polite"), "polite")[0])
    until(lambda: len(compiler._pool._queues[0]) == 1, "the polite compile waits")
    release.touch()
    for thread in threads:
        thread.join(10)
    assert received(jobs)[2:] == ["polite", "hostile-again"]  # arrived second, served first


def test_closing_ends_waiting_and_running_compiles_and_kills_the_workers(fake_compiler, jobs):
    compiler = fake_compiler(workers=1)
    running, ran = in_thread(compiler.compile, regex("spin"), "acme")
    until(lambda: received(jobs), "the spinning compile started")
    waiting, waited = in_thread(compiler.compile, regex("queued"), "globex")
    until(lambda: len(compiler._pool._queues[0]) == 1, "the other compile waits")
    [worker] = compiler.worker_pids()
    compiler.close()
    for thread in (running, waiting):
        thread.join(10)
    assert all(isinstance(out[0], EngineShuttingDown) for out in (ran, waited)), (ran, waited)
    assert not process_running(worker) and received(jobs) == ["spin"]
    with pytest.raises(EngineShuttingDown):
        compiler.compile(regex("late"))


# ---- the cache ------------------------------------------------------------------------------------------------------
def test_a_tenant_filling_its_share_does_not_evict_another_tenants_entries(fake_compiler):
    compiler = fake_compiler(size=1000, cache_bytes=10_000)
    mine = {spec: compiler.compile(regex(spec), "globex") for spec in ("g1", "g2", "g3")}
    for i in range(30):  # acme fills the cache and keeps going
        compiler.compile(regex(f"a{i}"), "acme")
    compiled = compiler.compiled
    assert all(compiler.compile(regex(spec), "globex") is grammar for spec, grammar in mine.items())
    assert compiler.compiled == compiled  # globex's three were hits
    assert compiler._cache.bytes_of("acme") == 7000 and compiler._cache.keys_of("acme")[0] == regex("a23")


def test_the_cache_drops_the_least_recently_used_past_its_bytes():
    """... of the tenant holding the most bytes."""
    cache = GrammarCache(max_bytes=100)
    for key in ("a1", "a2", "a3"):
        cache.put("acme", key, key.upper(), 30)
    assert cache.get("acme", "a1") == "A1"  # now a2 is acme's least recently used
    cache.put("globex", "g1", "G1", 30)  # over: acme holds the most and loses a2
    assert cache.keys_of("acme") == ["a3", "a1"] and cache.keys_of("globex") == ["g1"]
    cache.put("globex", "g2", "G2", 30)  # over, a tie (60 and 60): the inserting tenant gives up its own
    assert cache.keys_of("acme") == ["a3", "a1"] and cache.keys_of("globex") == ["g2"]
    cache.put("acme", "a4", "A4", 30)
    assert cache.keys_of("acme") == ["a1", "a4"] and cache.keys_of("globex") == ["g2"] and cache.total_bytes == 90
    cache.put("acme", "huge", "H", 101)  # bigger than the whole bound: not kept
    assert cache.get("acme", "huge") is None and cache.get("globex", "a1") is None  # keys are per tenant
