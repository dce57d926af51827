"""Every dense family, in-process, exact against transformers + peft on a tiny random checkpoint with the family's
real quirks: base rows and four adapters (attention, all-linear, rsLoRA, DoRA) in one batch, greedy tokens equal
and each step's logprob of the chosen token equal to peft's teacher-forced log-softmax (issue 40)."""

from __future__ import annotations

import pytest
import torch
from exactness import ENGINE_DEVICE, assert_matches_oracle, run_greedy_logprobs
from family_checkpoints import ADAPTERS, DENSE_FAMILIES, SMALL, WINDOW, build_family

from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.triton.model_config import fitting_adapters

MAX_TOKENS = 12
# 3x the sliding window, so windowed layers attend to a part of the prompt only
PROMPTS = ["The quick brown fox jumps over", "ab" * (3 * WINDOW // 2)]


@pytest.fixture(scope="module", params=list(DENSE_FAMILIES))
def family(request, tmp_path_factory):
    return request.param, *build_family(tmp_path_factory.mktemp("families"), request.param)


def _engine(model_dir: str, adapters: dict[str, str]) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=model_dir, device=ENGINE_DEVICE, dtype="float32", max_model_len=256,
                                  num_kv_blocks=64, block_size=4, max_loras=len(adapters), max_lora_rank=16,
                                  multi_lora=adapters))


@pytest.mark.parametrize("loras", [[None], [None, *ADAPTERS]], ids=["base-only", "mixed"])
def test_base_and_adapters_in_one_batch_equal_peft(family, loras):
    """Base rows alone (a Llama-like family's one-call decode), then mixed with every adapter kind."""
    name, model_dir, adapters = family
    engine = _engine(model_dir, adapters)
    batch = {f"{lora}:{i}": (prompt, lora) for i, (prompt, lora) in enumerate(
        (prompt, lora) for prompt in PROMPTS for lora in loras)}
    requests, tokens, logprobs = run_greedy_logprobs(engine, batch, MAX_TOKENS)
    assert_matches_oracle(lambda lora: (model_dir, adapters.get(lora)), batch, requests, tokens, logprobs, name)
    assert engine.adapters.pinned_count() == 0


def test_multi_lora_fitting_takes_every_adapter_of_the_family(family):
    """multi_lora.json's shape check reads the module names each family's adapters use (Phi-3's fused ones)."""
    name, model_dir, adapters = family
    assert fitting_adapters(adapters, model_dir) == adapters, name


def test_longrope_past_its_pretraining_length_is_refused_naming_the_fix_and_not_the_default(tmp_path):
    """transformers moves every position to the long factors once a sequence passes the pretraining length, which
    a cache of keys rotated earlier cannot follow: refused, not served wrong."""
    model_dir, _ = build_family(tmp_path, "phi3-longrope", adapters=False)
    with pytest.raises(ValueError, match=r"original_max_position_embeddings \(256\).*max_model_len <= 256"):
        LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", dtype="float32", max_model_len=512))
    # unset, max_model_len is the pretraining length, not max_position_embeddings (1024)
    assert LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", dtype="float32")).max_model_len == 256


def test_biases_on_every_projection_are_served_and_unknown_tensors_refused(tmp_path):
    """A Llama with attention and MLP biases equals transformers; a checkpoint tensor the forward would not read
    (a feature we do not implement) is refused at load, not ignored."""
    from peft_reference import greedy_tokens
    from safetensors.torch import load_file, save_file

    from loraplex.models.builtin.demo import build_tiny_llama

    model_dir = str(build_tiny_llama(tmp_path / "biased", **{**SMALL, "attention_bias": True, "mlp_bias": True}))
    engine = LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", dtype="float32", max_model_len=64,
                                    num_kv_blocks=32, block_size=4))
    batch = {"r": ("Biases everywhere", None)}
    requests, tokens, _ = run_greedy_logprobs(engine, batch, MAX_TOKENS)
    assert tokens["r"] == greedy_tokens(model_dir, None, requests["r"].prompt_token_ids, MAX_TOKENS, ignore_eos=True)
    weights = f"{model_dir}/model.safetensors"
    save_file({**load_file(weights), "model.layers.0.mlp.shared_expert.weight": torch.zeros(4, 4)}, weights)
    with pytest.raises(ValueError, match="1 checkpoint tensors are not used .*model.layers.0.mlp.shared_expert"):
        LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", dtype="float32", max_model_len=64))
