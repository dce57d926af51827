"""The engine with the demo model under scheduling pressure: preemption, caps, forks, timeouts, limits.

Numerics are checked against transformers + peft: a preempted and resumed sequence must
generate exactly the tokens of an uninterrupted one, and its streamed deltas must add up
to them (nothing lost, nothing sent twice).
"""

from __future__ import annotations

import functools

import pytest
from peft_reference import greedy_tokens

from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.request import SamplingParams
from loraplex.exceptions import EngineOverloaded, InvalidRequest

PROMPTS = [
    "Preemption keeps every token.",
    "Preemption keeps every token, twice over",  # shares a prefix with the first
    "The quick brown fox jumps over the lazy dog",
    "LoRA adapters share one base model",
    "1 2 3 4 5 6 7 8 9 10",
    "Swap space lives in host memory",
    "Tiny pools thrash",
    "What is continuous batching?",
]
ADAPTERS = [None, "demo-a", None, "demo-b", None, "demo-a", None, None]
MAX_TOKENS = 40




@functools.lru_cache(maxsize=None)
def reference_ignore_eos(model_dir: str, adapter_dir: str | None, prompt_ids: tuple, max_new_tokens: int) -> list[int]:
    """Greedy tokens from transformers (+ peft) that do not stop at EOS (the engine's ignore_eos); cached."""
    return greedy_tokens(model_dir, adapter_dir, list(prompt_ids), max_new_tokens, ignore_eos=True)


def make_engine(demo, **config) -> LLMEngine:
    adapters = {name: str(demo[name]) for name in ("demo-a", "demo-b")}
    return LLMEngine(EngineConfig(model_dir=str(demo["model"]), multi_lora=adapters, **config))


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


def run(engine: LLMEngine, requests, on_step=None) -> dict:
    """Step until idle; outputs per request id."""
    for r in requests:
        engine.add_request(r)
    outputs: dict = {r.request_id: [] for r in requests}
    for _ in range(10_000):
        if not engine.has_work():
            return outputs
        for out in engine.step():
            outputs[out.request_id].append(out)
        if on_step is not None:
            on_step(engine)
    raise AssertionError("engine did not finish")


def assert_pool_idle(engine: LLMEngine) -> None:
    kv, sched = engine.kv_manager, engine.scheduler
    kv.check_invariants()
    assert kv.usage()["used"] == 0 and kv.num_free_blocks == kv.num_blocks
    sched.swap_space.flush()
    assert sched.swap_space.num_free == sched.swap_space.num_blocks
    assert engine.adapters.pinned_count() == 0 and not sched.has_work()


def assert_streams(engine, demo, requests, outputs, max_tokens=MAX_TOKENS) -> None:
    for r in requests:
        outs = outputs[r.request_id]
        assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished, r.request_id
        adapter = str(demo[r.params.lora_name]) if r.params.lora_name else None
        expected = reference_ignore_eos(str(demo["model"]), adapter, tuple(r.prompt_token_ids), max_tokens)
        assert sum((o.token_ids for o in outs), []) == expected, (r.request_id, r.params.lora_name)
        assert "".join(o.text for o in outs) == engine.tokenizer.decode(expected, skip_special_tokens=True)


# ---------------------------------------------------------------- preemption


@pytest.mark.parametrize("policy", ["longest_first", "most_preempted_last", "lowest_priority"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forced_preemption_streams_equal_peft(demo, mode, policy):
    # 16 blocks of 16 tokens; 8 requests of ~30-60 tokens each need up to 6 blocks apiece
    engine = make_engine(demo, num_kv_blocks=16, preemption_mode=mode, victim_policy=policy,
                         swap_space_bytes=8 * 32 * 1024)
    assert engine.num_host_blocks == (8 if mode == "swap" else 0)
    requests = [
        engine.make_request(f"r{i}", p, greedy(lora_name=ADAPTERS[i], priority=i % 3)) for i, p in enumerate(PROMPTS)
    ]
    outputs = run(engine, requests)
    sched = engine.scheduler
    assert sched.num_preemptions >= 2
    assert (sched.num_swapped_out > 0) == (mode == "swap")
    assert_streams(engine, demo, requests, outputs)
    assert_pool_idle(engine)


def test_admission_cap_drops_under_sustained_pressure_and_recovers(demo):
    # 12 short prompts all fit at first (one block each), then grow together in 16 blocks
    engine = make_engine(demo, num_kv_blocks=16, max_num_seqs=16, preemption_window_steps=8, preemption_threshold=2,
                         victim_policy="longest_first")
    caps = []
    requests = [engine.make_request(f"r{i}", f"grow {i}", greedy()) for i in range(12)]
    outputs = run(engine, requests, on_step=lambda e: caps.append(e.scheduler.cap.value))
    # with ignore_eos the schedule depends only on lengths, so the trace is exact: the cap halves
    # (16 -> 6, later 12 -> 4), doubles after each 8 quiet steps, and is back at 16 by the end
    assert caps == [16] * 10 + [6] * 8 + [12] * 8 + [4] * 8 + [8] * 8 + [16] * 42
    assert (engine.scheduler.num_preemptions, engine.scheduler.cap.num_lowered) == (7, 2)
    assert_streams(engine, demo, requests, outputs)
    assert_pool_idle(engine)


# ---------------------------------------------------------------- n > 1


def _peak_used_blocks(engine, requests) -> tuple[int, dict]:
    peak = [0]
    outputs = run(engine, requests, on_step=lambda e: peak.__setitem__(0, max(peak[0], e.kv_manager.usage()["used"])))
    return peak[0], outputs


def _by_index(outputs) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    for o in outputs:
        tokens.setdefault(o.index, []).extend(o.token_ids)
    return tokens


def test_greedy_n3_gives_three_identical_streams_and_shares_the_prompt_blocks(demo):
    prompt = "Copy-on-write shares the prompt; n=3 makes three samples"  # 57 tokens: 3 full blocks + 9
    engine = make_engine(demo)
    request = engine.make_request("n3", prompt, greedy(max_tokens=6, n=3))
    assert len(request.prompt_token_ids) == 57
    peak, outputs = _peak_used_blocks(engine, [request])
    samples = _by_index(outputs["n3"])
    expected = reference_ignore_eos(str(demo["model"]), None, tuple(request.prompt_token_ids), 6)
    assert samples == {0: expected, 1: expected, 2: expected}
    assert [o.finished for o in outputs["n3"]].count(True) == 3  # one final per sample; the responder sends one FINAL
    # three full prompt blocks shared, the partly filled 4th copied for two of the samples
    assert peak == 3 + 3
    separate = [engine.make_request(f"s{i}", prompt, greedy(max_tokens=6)) for i in range(3)]
    engine.kv_manager.reset_prefix_cache()
    separate_peak, _ = _peak_used_blocks(engine, separate)
    assert separate_peak == 3 * 4
    assert_pool_idle(engine)


def test_seeded_n3_gives_three_reproducible_samples(demo):
    engine = make_engine(demo)
    params = dict(max_tokens=12, temperature=1.0, seed=1234, n=3, ignore_eos=True)
    first = _by_index(run(engine, [engine.make_request("a", "Sample me", SamplingParams(**params))])["a"])
    again = _by_index(run(engine, [engine.make_request("b", "Sample me", SamplingParams(**params))])["b"])
    assert first == again and len(first) == 3 and all(len(t) == 12 for t in first.values())
    assert len({tuple(t) for t in first.values()}) == 3
    # sample i uses seed + i, like a single request with that seed
    single = run(engine, [engine.make_request("c", "Sample me", SamplingParams(**{**params, "n": 1, "seed": 1236}))])
    assert _by_index(single["c"])[0] == first[2]
    assert_pool_idle(engine)


# ---------------------------------------------------------------- timeouts and limits


def test_timeout_ends_with_finish_reason_timeout_and_frees_blocks(demo):
    engine = make_engine(demo, default_timeout=100.0)
    now = [0.0]
    engine.scheduler.clock = lambda: now[0]
    timed = engine.make_request("t", "Time runs out", greedy(max_tokens=50, timeout=3.5))
    default = engine.make_request("d", "Default timeout", greedy(max_tokens=50))
    timed.arrival_time = default.arrival_time = 0.0
    for r in (timed, default):
        engine.add_request(r)
    outputs: dict = {"t": [], "d": []}
    while engine.has_work():
        now[0] += 1.0 if now[0] < 5 else 50.0
        for out in engine.step():
            outputs[out.request_id].append(out)
    t, d = outputs["t"], outputs["d"]
    assert [o.finished for o in t] == [False, False, False, True] and t[-1].finish_reason == "timeout"
    assert t[-1].error is None and t[-1].token_ids == []
    expected = reference_ignore_eos(str(demo["model"]), None, tuple(timed.prompt_token_ids), 3)
    assert sum((o.token_ids for o in t), []) == expected  # steps at t = 1, 2, 3; expired at 4
    # steps at t = 1, 2, 3, 4, 5, 55 each add a token; at t = 105 the 100 s default has passed
    assert d[-1].finish_reason == "timeout" and len(sum((o.token_ids for o in d), [])) == 6
    assert_pool_idle(engine)


def test_max_waiting_requests_refuses_at_once(demo):
    engine = make_engine(demo, max_waiting_requests=2, max_num_seqs=1)
    requests = [engine.make_request(f"r{i}", "Queue me", greedy(max_tokens=3)) for i in range(5)]
    engine.add_request(requests[0])
    engine.add_request(requests[1])
    with pytest.raises(EngineOverloaded) as err:
        engine.add_request(requests[2])
    assert str(err.value) == "server overloaded: 2 requests are waiting (max_waiting_requests=2); retry later"
    assert engine.num_waiting_requests() == 2
    engine.step()  # r0 starts running; r1 still waits
    assert engine.num_waiting_requests() == 1
    engine.add_request(requests[2])
    with pytest.raises(EngineOverloaded):
        engine.add_request(requests[3])
    while engine.has_work():
        engine.step()
    assert engine.num_waiting_requests() == 0
    engine.add_request(requests[3])
    engine.abort("r3")  # a request aborted before it started leaves the count too
    engine.step()
    assert engine.num_waiting_requests() == 0 and not engine.has_work()


def test_requests_that_can_never_run_are_refused(demo):
    engine = make_engine(demo, num_kv_blocks=8, max_num_seqs=2)
    with pytest.raises(InvalidRequest) as err:
        engine.make_request("big", "x" * 100, greedy(max_tokens=30))
    assert str(err.value) == (
        "prompt has 101 tokens and max_tokens is 30: a sequence may need 9 KV blocks of 16 tokens, "
        "but the KV cache has 7 for sequences"
    )
    with pytest.raises(InvalidRequest) as err:
        engine.make_request("wide", "x", greedy(max_tokens=3, n=3))
    assert str(err.value) == "n is 3 but max_num_seqs is 2"


# ---------------------------------------------------------------- adapters (issue 4 part)


def test_requests_wait_for_an_adapter_slot_and_resident_adapters_go_first(demo):
    engine = make_engine(demo, max_loras=1)
    jobs = [("a1", "demo-a", 12), ("b1", "demo-b", 4), ("a2", "demo-a", 4), ("base", None, 4)]
    requests = [engine.make_request(rid, f"Adapter {rid}", greedy(max_tokens=m, lora_name=lora))
                for rid, lora, m in jobs]
    first_step: dict = {}
    step = [0]

    def note(e):
        step[0] += 1
        for seq in e.scheduler.running:
            first_step.setdefault(seq.request.request_id, step[0])

    outputs = run(engine, requests, on_step=note)
    assert first_step["a1"] == first_step["a2"] == first_step["base"] == 1
    assert first_step["b1"] == 13  # after a1 (12 steps) and a2 release demo-a's only slot
    for r, (_, _, m) in zip(requests, jobs):
        adapter = str(demo[r.params.lora_name]) if r.params.lora_name else None
        expected = reference_ignore_eos(str(demo["model"]), adapter, tuple(r.prompt_token_ids), m)
        assert sum((o.token_ids for o in outputs[r.request_id]), []) == expected
    assert_pool_idle(engine)


# ---------------------------------------------------------------- prefix cache scope


@pytest.mark.parametrize("scope, other_tenant_hit", [("tenant", 0), ("global", 48)])
def test_prefix_cache_scope(demo, scope, other_tenant_hit):
    engine = make_engine(demo, prefix_cache_scope=scope)
    prompt = "Shared system prompt for every tenant of the deployment."  # 57 tokens: 3 full blocks
    tenants = ["acme", "acme", "globex"]
    requests = [engine.make_request(f"r{i}", prompt, greedy(max_tokens=2), tenant=t) for i, t in enumerate(tenants)]
    for r in requests:  # one after another: each finds what the previous computed
        assert_streams(engine, demo, [r], run(engine, [r]), max_tokens=2)
    sched = engine.scheduler
    assert sched.prefix_query_tokens == {"acme": 114, "globex": 57}
    # 57 prompt tokens: the 3 full blocks (48 tokens) can hit; the partial 4th block is computed
    assert sched.prefix_hit_tokens == {"acme": 48, "globex": other_tenant_hit}
    assert_pool_idle(engine)


# ---------------------------------------------------------------- repeated decode batches


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_repeated_decode_inputs_equal_a_rebuild_through_preemption_and_forks(demo, mode):
    """Every step's inputs, repeated or not, equal StepArrays.build's; the streams stay peft's."""
    import numpy as np

    from loraplex.worker.step_arrays import StepArrays

    engine = make_engine(demo, num_kv_blocks=16, preemption_mode=mode, swap_space_bytes=8 * 32 * 1024)
    inputs, repeats = engine.runner._inputs, []
    build = inputs.build

    def checked(batch):
        step, plans = build(batch)
        want = StepArrays.build(batch, engine.config.block_size)
        for name in ("input_ids", "positions", "slot_mapping", "block_tables", "context_lens", "cu",
                     "sample_rows", "sample_seqs"):
            assert np.array_equal(getattr(step, name), getattr(want, name)), name
        repeats.append(plans is not None)
        return step, plans

    inputs.build = checked
    requests = [engine.make_request(f"r{i}", p, greedy(lora_name=ADAPTERS[i])) for i, p in enumerate(PROMPTS)]
    prompt = "Copy-on-write shares the prompt; n=3 makes three samples"
    forked = engine.make_request("n3", prompt, greedy(max_tokens=12, n=3))
    outputs = run(engine, [*requests, forked])
    assert engine.scheduler.num_preemptions >= 2 and any(repeats) and not all(repeats)
    assert_streams(engine, demo, requests, outputs)
    expected = reference_ignore_eos(str(demo["model"]), None, tuple(forked.prompt_token_ids), 12)
    assert _by_index(outputs["n3"]) == {0: expected, 1: expected, 2: expected}
    assert_pool_idle(engine)


# ---------------------------------------------------------------- static batching


@pytest.mark.parametrize("first_lengths", [[3, 20, 20, 20], [20, 20, 20, 3]], ids=["first-ends-first", "last-ends-first"])
@pytest.mark.parametrize("batching", ["static", "static-shrink"])
def test_static_batching_streams_equal_peft_and_padding_rows_keep_the_batch_shape(demo, batching, first_lengths):
    """A static batch keeps a row for each ended sequence (its output dropped) until its last one ends;
    static-shrink lets them leave. Either way every stream is peft's and every block comes back. When the
    batch's last row ends first, the padded batch has the same sequences in the same order as the step
    before: it must not repeat that step's inputs moved on (a padding row does not advance)."""
    engine = make_engine(demo, batching=batching, max_num_seqs=4)
    lengths = [*first_lengths, 5, 9, 16, 4]
    requests = [engine.make_request(f"r{i}", p, greedy(max_tokens=lengths[i], lora_name=ADAPTERS[i]))
                for i, p in enumerate(PROMPTS)]
    rows, execute = [], engine.runner.execute

    def recorded(batch, copies=True):
        rows.append((len(batch.seqs), batch.num_padding))
        return execute(batch, copies)

    engine.runner.execute = recorded
    outputs = run(engine, requests)
    first_batch = rows[:20]  # r0-r3 admitted together: 20 steps, the longest have 20 tokens
    assert first_batch == [(4, 0)] * 3 + ([(4, 1)] if batching == "static" else [(3, 0)]) * 17
    assert rows[20][1] == 0  # the next batch starts without padding
    for r, n in zip(requests, lengths):
        outs = outputs[r.request_id]
        assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished, r.request_id
        adapter = str(demo[r.params.lora_name]) if r.params.lora_name else None
        expected = reference_ignore_eos(str(demo["model"]), adapter, tuple(r.prompt_token_ids), n)
        assert sum((o.token_ids for o in outs), []) == expected, r.request_id
    assert_pool_idle(engine)
