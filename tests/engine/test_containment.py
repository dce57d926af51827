"""A failure stays with the request it came from, and the loop thread never dies.

Faults are planted in the real engine (demo model, two adapters): a newcomer whose
tokens make the forward pass raise, a row of NaN logits, a detokenizer and a prefix
lookup that raise, a scheduler bug in the loop thread. Every other request must finish
with exactly peft's greedy tokens, the guilty one with exactly one error output, and
afterwards every block, pin and counter is back to idle.
"""

from __future__ import annotations

import queue

import pytest
from peft_reference import greedy_tokens

from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.request import SamplingParams
from loraplex.exceptions import EngineShuttingDown, InvalidRequest

GOOD = [("Hello there", None), ("The quick brown fox", "demo-a"), ("LoRA adapters", "demo-b"), ("Tenants", None)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def engine_factory(demo):
    adapters = {name: str(demo[name]) for name in ("demo-a", "demo-b")}

    def make(**config) -> LLMEngine:
        return LLMEngine(EngineConfig(model_dir=str(demo["model"]), multi_lora=adapters, **config))

    return make


@pytest.fixture(scope="module")
def reference(demo):
    """peft's greedy tokens (ignore_eos) for a prompt and adapter."""
    cache: dict = {}

    def get(engine: LLMEngine, prompt: str, lora: str | None) -> list[int]:
        if (prompt, lora) not in cache:
            ids = engine.tokenizer(prompt).input_ids
            adapter = str(demo[lora]) if lora else None
            cache[prompt, lora] = greedy_tokens(str(demo["model"]), adapter, ids, MAX_TOKENS, ignore_eos=True)
        return cache[prompt, lora]

    return get


def request(engine: LLMEngine, rid: str, prompt: str, lora: str | None = None, **params):
    sampling = SamplingParams(**{"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "lora_name": lora,
                                 **params})
    return engine.make_request(rid, prompt, sampling)


def run(engine: LLMEngine, outputs: dict, steps: int | None = None) -> dict:
    """Step `steps` times, or until idle, collecting outputs per request id."""
    for _ in range(steps or 2000):
        if steps is None and not engine.has_work():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert steps is not None, "engine did not drain"
    return outputs


def collect(delivered: queue.SimpleQueue, num_finals: int) -> dict:
    """Outputs the loop thread delivered, per request id, until num_finals final ones arrived."""
    outputs: dict = {}
    while len([o for outs in outputs.values() for o in outs if o.finished]) < num_finals:
        out = delivered.get(timeout=60)
        outputs.setdefault(out.request_id, []).append(out)
    return outputs


def assert_exact(engine, outputs: dict, rid: str, prompt: str, lora: str | None, reference) -> None:
    outs = outputs[rid]
    assert all(o.error is None for o in outs), [o.error for o in outs]
    assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
    assert [t for o in outs for t in o.token_ids] == reference(engine, prompt, lora), rid


def assert_failed_once(outputs: dict, rid: str, message: str) -> None:
    """Deltas (if any), then exactly one final output: the error."""
    outs = outputs[rid]
    assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished, outs
    assert [o.error is not None for o in outs] == [False] * (len(outs) - 1) + [True]
    assert message in str(outs[-1].error)


def assert_good_and_idle(engine: LLMEngine, outputs: dict, jobs, reference) -> None:
    """Every good job equals peft exactly, and the engine holds nothing."""
    for rid, prompt, lora in jobs:
        assert_exact(engine, outputs, rid, prompt, lora, reference)
    assert_idle(engine)


def assert_idle(engine: LLMEngine) -> None:
    kv = engine.kv_manager
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks
    assert engine.adapters.total_pins() == 0 and engine.adapters.pinned_count() == 0
    sched = engine.scheduler
    assert not (sched.running or sched.waiting or sched.swapped)
    assert engine.num_waiting_requests() == 0 and engine._requests == {}
    assert engine.processor._open == {}  # the text state of every request went with its final output


def add_good(engine: LLMEngine, prefix: str = "g") -> list[tuple[str, str, str | None]]:
    jobs = [(f"{prefix}{i}", prompt, lora) for i, (prompt, lora) in enumerate(GOOD)]
    for rid, prompt, lora in jobs:
        engine.add_request(request(engine, rid, prompt, lora))
    return jobs


def test_a_newcomer_that_breaks_the_forward_fails_alone(engine_factory, reference):
    engine = engine_factory()
    poison = engine.tokenizer("\x07").input_ids[-1]
    forward = engine.model.forward

    def poisoned(input_ids, *args):
        if bool((input_ids == poison).any()):
            raise RuntimeError("planted forward failure")
        return forward(input_ids, *args)

    engine.model.forward = poisoned
    running = add_good(engine, "run")
    outputs = run(engine, {}, steps=3)  # the first requests are decoding when the poison arrives
    engine.add_request(request(engine, "poison", "bad \x07 prompt", "demo-b"))
    newcomers = add_good(engine, "new")  # admitted in the same step as the poison
    run(engine, outputs)
    assert_failed_once(outputs, "poison", "planted forward failure")
    assert_good_and_idle(engine, outputs, running + newcomers, reference)
    assert engine.finished_requests[("default", "error")] == 1


@pytest.mark.parametrize("found", ["by argmax_rows", "on the device"])
def test_a_row_of_nan_logits_fails_only_its_request(engine_factory, reference, found):
    """Found by the CPU's argmax pass, or as a GPU finds it: rows zeroed and flags fetched with the ids."""
    engine = engine_factory()
    engine.runner._finite_on_device = found == "on the device"
    logits, execute, current = engine.model.logits, engine.runner.execute, []
    target = engine.tokenizer("NaN row").input_ids

    def remember_batch(batch, *args, **kwargs):
        current[:] = [s for s, n in zip(batch.seqs, batch.num_new_tokens) if s.num_computed_tokens + n == len(s.token_ids)]
        return execute(batch, *args, **kwargs)

    def nan_for_target(hidden, *buffer):
        out = logits(hidden, *buffer)
        for row, seq in enumerate(current):  # sampled rows, in batch order
            if seq.token_ids[: len(target)] == target and seq.num_output_tokens == 2:
                out[row] = float("nan")
        return out

    engine.runner.execute, engine.model.logits = remember_batch, nan_for_target
    jobs = add_good(engine)
    engine.add_request(request(engine, "nan", "NaN row", "demo-a"))
    outputs = run(engine, {})
    assert_failed_once(outputs, "nan", "NaN or infinite logits")
    assert_good_and_idle(engine, outputs, jobs, reference)


def test_detokenizer_and_prefix_lookup_failures_fail_only_their_request(engine_factory, reference):
    engine = engine_factory()
    lookup = engine.kv_manager.find_cached_prefix
    bad_lookup = engine.tokenizer("lookup breaks").input_ids

    def find_cached_prefix(token_ids, namespace):
        if list(token_ids[: len(bad_lookup)]) == bad_lookup:
            raise RuntimeError("planted prefix lookup failure")
        return lookup(token_ids, namespace)

    engine.kv_manager.find_cached_prefix = find_cached_prefix
    jobs = add_good(engine)
    engine.add_request(request(engine, "lookup", "lookup breaks", "demo-b"))
    detok = request(engine, "detok", "detokenizer breaks", "demo-a", n=2, seed=7)
    engine.add_request(detok)
    outputs = run(engine, {}, steps=2)  # prefilled and forked

    def broken_decode(*args):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "planted detokenizer failure")

    class BrokenStream:
        step = staticmethod(broken_decode)

    detok = engine.processor._open["detok"].samples[1].detok  # sample 1 of the n=2 request
    detok._decode, detok._stream = broken_decode, (None, BrokenStream())
    run(engine, outputs)
    assert_failed_once(outputs, "lookup", "planted prefix lookup failure")
    assert_failed_once(outputs, "detok", "planted detokenizer failure")
    assert_good_and_idle(engine, outputs, jobs, reference)


def test_the_loop_thread_survives_a_failure_outside_any_step(engine_factory, reference):
    engine = engine_factory()
    delivered: queue.SimpleQueue = queue.SimpleQueue()
    engine.on_outputs = lambda outs: [delivered.put(o) for o in outs]
    schedule, calls = engine.scheduler.schedule, []

    def failing_schedule():
        calls.append(1)
        if len(calls) == 4:
            raise AssertionError("planted scheduler bug")
        return schedule()

    engine.scheduler.schedule = failing_schedule
    jobs = add_good(engine)
    engine.start()
    try:
        outputs = collect(delivered, len(jobs))
        for rid, _, _ in jobs:  # every held request ended once, with the loop's error
            finals = [o for o in outputs[rid] if o.finished]
            assert len(finals) == 1 and "planted scheduler bug" in str(finals[0].error)
        assert engine.num_recoveries == 1
        again = add_good(engine, "after")  # the engine serves on, from a clean state
        outputs = collect(delivered, len(again))
    finally:
        engine.stop()
    assert_good_and_idle(engine, outputs, again, reference)
    assert engine.scheduler.prefix_query_tokens["default"] > 0  # counters carried over the reset


def test_extreme_sampling_values_are_refused_or_contained(engine_factory, reference):
    engine = engine_factory(max_n=4, max_logprobs=5)
    for values, message in [
        ({"seed": 2**64}, "'seed' has value 18446744073709551616"),
        ({"temperature": float("nan")}, "'temperature' has value nan"),
        ({"n": 5}, "at most 4 is allowed (max_n)"),
        ({"logprobs": 6}, "at most 5 is allowed (max_logprobs)"),
        ({"stop_token_ids": [engine.vocab_size]}, f"below the vocabulary size {engine.vocab_size}"),
    ]:
        with pytest.raises(InvalidRequest) as err:
            params = SamplingParams.from_dict(values)
            engine.make_request("x", "hi", params)
        assert message in str(err.value)
    # a temperature below vLLM's epsilon is greedy; the largest seeds are usable
    tiny = SamplingParams.from_dict({"temperature": 1e-45, "max_tokens": MAX_TOKENS, "ignore_eos": True})
    engine.add_request(engine.make_request("tiny", "Hello there", tiny))
    seeded = SamplingParams.from_dict({"seed": 2**63 - 1, "n": 4, "max_tokens": 4, "logprobs": 5})
    engine.add_request(engine.make_request("seeded", "Hello there", seeded))
    outputs = run(engine, {})
    assert_exact(engine, outputs, "tiny", "Hello there", None, reference)
    assert sorted({o.index for o in outputs["seeded"]}) == [0, 1, 2, 3]
    assert all(o.error is None for o in outputs["seeded"])
    assert_idle(engine)


def test_shutdown_ends_every_held_and_queued_request_once_and_refuses_new_ones(engine_factory):
    engine = engine_factory()
    jobs = add_good(engine)
    run(engine, {}, steps=2)  # held by the engine, mid-generation
    engine.add_request(request(engine, "queued", "still in the inbox"))
    outputs: dict = {}
    for out in engine.shutdown() + engine.shutdown():  # finalize() and the unload watch may both call it
        outputs.setdefault(out.request_id, []).append(out)
    assert sorted(outputs) == sorted([rid for rid, _, _ in jobs] + ["queued"])
    for rid in outputs:
        assert_failed_once(outputs, rid, "the model is shutting down")
    with pytest.raises(EngineShuttingDown):
        engine.add_request(request(engine, "late", "too late"))
