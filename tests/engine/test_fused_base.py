"""The base q/k/v and gate/up fused into one GEMM each (LORAPLEX_FUSED_BASE, decision 057), with the LoRA
group kernels on the shim: a batch of two adapters and the base model still equals peft token for token."""

from __future__ import annotations

import collections

import pytest

import peft_reference as ref
from tiny_llama import build_model_and_adapters, run_greedy
from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.kernels import cpu_runner, dispatch
from loraplex.models import llama

BLOCK_SIZE = 8
MODEL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
ADAPTERS = {  # one adapter targets part of each group (k_proj without q/v, gate without up): zero stacks fused in
    "attn": dict(r=4, alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "up_proj"], seed=31),
    "mlp": dict(r=8, alpha=16, target_modules=["k_proj", "gate_proj", "down_proj"], seed=32),
}
REQUESTS = [("attn", "attn", "The quick brown fox", 1), ("mlp", "mlp", "Hello world", 1), ("base", None, "1, 2,", 1)]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_model_and_adapters(tmp_path_factory.mktemp("fused-model"), MODEL, ADAPTERS)


def test_fused_base_and_group_kernels_match_peft(tiny, monkeypatch):
    monkeypatch.setenv(llama.FUSED_BASE_ENV, "on")
    monkeypatch.setenv(dispatch.ENV, "shim")
    monkeypatch.setattr(dispatch, "MODE", dispatch.read_mode())
    launches = collections.Counter()
    launch = cpu_runner.CpuRunner.launch

    def counting(self, family, name, grid, block, args):
        launches[name.split("<")[0]] += 1
        return launch(self, family, name, grid, block, args)

    monkeypatch.setattr(cpu_runner.CpuRunner, "launch", counting)
    model_dir, adapters = tiny
    engine = LLMEngine(EngineConfig(
        model_dir=model_dir, device="cpu", dtype="float32", multi_lora=adapters, max_loras=2, max_lora_rank=8,
        num_kv_blocks=64, block_size=BLOCK_SIZE,
    ))
    assert engine.model.fused_weights is not None and engine.model.packed is None
    assert engine.model.layers[0]["q_proj"] is None  # only the fused copy is kept
    requests, tokens = run_greedy(engine, REQUESTS, MAX_TOKENS)
    assert launches["shrink_bgmv_group"] >= 1 and launches["expand_bgmv_group"] >= 1, launches
    for rid, req in requests.items():
        lora = req.params.lora_name
        want = ref.greedy_tokens(model_dir, adapters[lora] if lora else None, req.prompt_token_ids, MAX_TOKENS)
        assert tokens[rid, 0] == want, rid


@pytest.mark.parametrize(("value", "device", "want"), [
    ("", "cuda", True), ("", "cpu", False), ("auto", "cpu", False), ("on", "cpu", True), ("off", "cuda", False),
])
def test_fused_base_switch(monkeypatch, value, device, want):
    monkeypatch.setenv(llama.FUSED_BASE_ENV, value)
    assert llama.fused_base_enabled(device) is want


def test_fused_base_switch_rejects_unknown(monkeypatch):
    monkeypatch.setenv(llama.FUSED_BASE_ENV, "yes")
    with pytest.raises(ValueError, match="auto, on, off"):
        llama.fused_base_enabled("cpu")
