"""A windowed Mistral checkpoint through the engine (decision 065): prompts of 3x the window in KV pools smaller
than one sequence, blocks freed as the window moves, a prefix hit past the freed hole, preemption (recompute and
swap) inside the window; greedy tokens equal transformers' throughout."""

from __future__ import annotations

import functools

import pytest
from exactness import ENGINE_DEVICE
from peft_reference import greedy_tokens

from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.request import SamplingParams
from loraplex.models.builtin.demo import build_tiny_llama

WINDOW = 8
BS = 4
MAX_TOKENS = 12
PROMPTS = ["Sliding windows free their blocks.", "Tiny pools hold only the window!", "Preempted inside it, too."]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return str(build_tiny_llama(tmp_path_factory.mktemp("swa-kv") / "model", model_type="mistral",
                                sliding_window=WINDOW, max_position_embeddings=64))


@functools.lru_cache(maxsize=None)
def reference(model_dir: str, prompt_ids: tuple) -> list[int]:
    return greedy_tokens(model_dir, None, list(prompt_ids), MAX_TOKENS, ignore_eos=True)


def serve(engine: LLMEngine, prompts: list[str], n: int = 1, tag: str = "r") -> tuple[dict, int]:
    """Run prompts to the end: (request id -> (prompt ids, tokens per sample), the most blocks used after a step)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, n=n)
    requests = [engine.make_request(f"{tag}{i}", p, params, "t") for i, p in enumerate(prompts)]
    for r in requests:
        assert len(r.prompt_token_ids) >= 3 * WINDOW
        engine.add_request(r)
    tokens = {(r.request_id, i): [] for r in requests for i in range(n)}
    peak = 0
    while engine.has_work():
        for out in engine.step():
            assert out.error is None, out.error
            tokens[(out.request_id, out.index)] += out.token_ids
        peak = max(peak, engine.kv_manager.usage()["used"])
        engine.kv_manager.check_invariants()
    return {r.request_id: (r.prompt_token_ids, [tokens[(r.request_id, i)] for i in range(n)]) for r in requests}, peak


def assert_exact(model_dir: str, served: dict) -> None:
    for rid, (prompt_ids, samples) in served.items():
        for sample in samples:
            assert sample == reference(model_dir, tuple(prompt_ids)), rid


def assert_idle(engine: LLMEngine) -> None:
    kv = engine.kv_manager
    kv.check_invariants()
    assert kv.usage()["used"] == 0 and kv.num_free_blocks == kv.num_usable_blocks


def test_long_prompts_hold_a_window_of_blocks_and_a_later_prompt_hits_past_the_hole(mistral):
    engine = LLMEngine(EngineConfig(model_dir=mistral, device=ENGINE_DEVICE, dtype="float32", num_kv_blocks=16,
                                    block_size=BS, max_num_batched_tokens=8))
    kv = engine.kv_manager
    assert engine.kv_window == WINDOW and kv.null_block == 0
    first, peak = serve(engine, PROMPTS[:1], tag="first")
    assert_exact(mistral, first)
    longest = len(first["first0"][0]) + MAX_TOKENS
    assert peak <= kv.max_blocks_held(longest, 8) == 5 < -(-longest // BS)  # ceil((8 + 8 + 4 - 2) / 4), not 12
    assert_idle(engine)
    # the same prompt first among others, two samples each: its first query reads only the window before it, so
    # the hit starts past the hole its first run left
    served, peak = serve(engine, PROMPTS, n=2)
    assert_exact(mistral, served)
    assert kv.num_hits_past_a_hole == 1 and engine.scheduler.prefix_hit_tokens["t"] >= 3 * WINDOW
    assert peak <= 6 * 5 and kv.num_freed_by_window > 0
    assert_idle(engine)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_inside_the_window_resumes_exactly(mistral, mode):
    # 8 usable blocks (the null block aside), fewer than one sequence's 12: each holds up to 5 at once (3 while
    # decoding), so three decoding together do not fit
    engine = LLMEngine(EngineConfig(model_dir=mistral, device=ENGINE_DEVICE, dtype="float32", num_kv_blocks=9,
                                    block_size=BS, max_num_batched_tokens=8, preemption_mode=mode,
                                    swap_space_bytes=1 << 20, victim_policy="longest_first"))
    served, peak = serve(engine, PROMPTS)
    assert engine.scheduler.num_preemptions > 0
    if mode == "swap":
        assert engine.scheduler.num_swapped_out > 0
    assert_exact(mistral, served)
    assert peak <= engine.kv_manager.num_usable_blocks == 8
    assert_idle(engine)
