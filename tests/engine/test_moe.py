"""Mixtral and Qwen3-MoE in-process, exact against transformers + peft on tiny random checkpoints (4 experts, top-2;
Qwen3-MoE with norm_topk_prob both ways and an mlp_only layer), in both checkpoint layouts, with expert LoRA in both
adapter layouts (issue 40, decision 066).

Oracles: transformers' own MoE block and model; peft for attention LoRA and for LoRA on the fused experts
(target_parameters, or expert target_modules that peft on transformers 5 turns into them); for per-expert-module
adapters (transformers 4.x's layout) transformers on the same weights with each module's delta s * B @ A merged into
that module's (each expert's into that expert's) weight: moe_models.merged_model. fp32 throughout: the MoE block is
bit-equal to transformers' without LoRA, within BLOCK_ATOL with it; logprobs within LOGPROB_ATOL.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from moe_models import ATTENTION, EXPERT_NAMES, MOE_FAMILIES, build_adapter, build_moe, fuse_experts, merged_model, \
    per_expert_adapter
from exactness import ENGINE_DEVICE, assert_matches_oracle, run_greedy_logprobs
from peft_reference import reference_model, teacher_forced_logits

from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.lora.adapter import load_peft_adapter
from loraplex.lora.backends import KernelLoraBackend, NativeLoraBackend, TorchLoraBackend
from loraplex.lora.moe_layout import expert_layout
from loraplex.lora.shapes import module_shapes
from loraplex.lora.slots import LoraSlots
from loraplex.models.loader import load_hf_config, load_safetensors
from loraplex.models.moe import take_moe
from loraplex.triton.model_config import fitting_adapters

BLOCK_ATOL = 1e-5  # the block's outputs are O(1); LoRA's sums run in another order than peft's merged weights
MAX_TOKENS = 8
PROMPTS = ["The quick brown fox jumps over", "abab 1, 2, 3"]


@dataclass
class Moe:
    name: str
    model_dir: str
    fused_dir: str
    adapters: dict[str, str]
    oracles: dict[str | None, tuple[str, str | None]]  # adapter -> (model dir, peft adapter dir or None)


@pytest.fixture(scope="module", params=list(MOE_FAMILIES))
def moe(request, tmp_path_factory) -> Moe:
    name, root = request.param, tmp_path_factory.mktemp("moe")
    model_dir = build_moe(root, name)
    experts = list(EXPERT_NAMES[MOE_FAMILIES[name]["model_type"]])
    adapters = {
        "attn": build_adapter(model_dir, root / "attn", 8, 16, 11, ATTENTION),
        "dora-attn": build_adapter(model_dir, root / "dora", 4, 8, 17, ATTENTION, use_dora=True),
        # target_modules on the experts: peft (transformers 5) saves target_parameters, gate_up_proj at rank 2r
        "experts": build_adapter(model_dir, root / "experts", 4, 8, 12, ["q_proj", *experts]),
        # all-linear: attention, experts and the router (target_parameters gate.weight)
        "all-linear": build_adapter(model_dir, root / "all", 4, 4, 16, "all-linear"),
        "down-rslora": build_adapter(model_dir, root / "down", 8, 8, 13, [], use_rslora=True,
                                     target_parameters=["mlp.experts.down_proj"]),
        "per-expert": per_expert_adapter(model_dir, root / "per-expert", 4, 8, 14),
        "some-experts": per_expert_adapter(model_dir, root / "some", 4, 8, 15, experts=(1, 3),
                                           rank_pattern={f"experts.3.{m}": 2 for m in experts}),
    }
    oracles = {None: (model_dir, None),
               **{a: (model_dir, adapters[a]) for a in ("attn", "dora-attn", "experts", "all-linear", "down-rslora")}}
    for a in ("per-expert", "some-experts"):
        oracles[a] = (merged_model(model_dir, adapters[a], root / f"merged-{a}"), None)
    return Moe(name, model_dir, fuse_experts(model_dir, root / "fused"), adapters, oracles)


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_block_equals_transformers_moe_block(moe, layout):
    """MoeBlock from either checkpoint layout equals the HF model's own sparse block on the same rows."""
    config = load_hf_config(moe.model_dir)
    weights = load_safetensors(moe.model_dir if layout == "per-expert" else moe.fused_dir, torch.float32, "cpu")
    hf = reference_model(moe.model_dir, None)
    x = torch.randn(11, config.hidden_size, generator=torch.Generator().manual_seed(0))
    sparse = expert_layout(config).layers
    for layer in range(config.num_hidden_layers):
        block = take_moe(weights, layer, config, torch.float32, "cpu")
        assert (block is None) == (layer not in sparse)
        if block is not None:
            with torch.no_grad():
                want = hf.model.layers[layer].mlp(x[None])[0]
            assert torch.equal(block(x, None, layer), want), f"{moe.name} layer {layer}"


@pytest.mark.parametrize("backend", [TorchLoraBackend, KernelLoraBackend, NativeLoraBackend])
@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_block_rows_of_mixed_adapters_equal_peft(moe, backend, step):
    """Rows of the base model, of all-linear LoRA (target_parameters on the experts and the router) and of
    per-expert LoRA (with the router's) in one call: each row's output is its oracle's block output, whichever
    backend plans the rows and whether they come as a prefill or decode step."""
    config = load_hf_config(moe.model_dir)
    layout = expert_layout(config)
    slots = LoraSlots(config.num_hidden_layers, module_shapes(config), 2, 16, torch.float32, "cpu", experts=layout)
    for slot, name in enumerate(("all-linear", "per-expert")):
        slots.load(slot, load_peft_adapter(moe.adapters[name], name, config, 16))
    lora = backend(slots, torch.from_numpy)
    rows = np.array([-1, 0, 1], dtype=np.int32)  # 3 rows each of base, "all-linear", "per-expert"
    if step == "prefill":
        plan = lora.plan(rows, np.array([0, 3, 6, 9]), is_decode=False)
    else:
        plan = lora.plan(np.repeat(rows, 3), np.arange(10), is_decode=True)
    weights = load_safetensors(moe.model_dir, torch.float32, "cpu")
    x = torch.randn(9, config.hidden_size, generator=torch.Generator().manual_seed(1))
    for layer in layout.layers:
        got = take_moe(weights, layer, config, torch.float32, "cpu")(x, plan, layer)
        for i, name in enumerate((None, "all-linear", "per-expert")):
            model = reference_model(*moe.oracles[name])
            model = model.base_model.model if name == "all-linear" else model
            with torch.no_grad():
                want = model.model.layers[layer].mlp(x[None, 3 * i:3 * i + 3])[0]
            torch.testing.assert_close(got[3 * i:3 * i + 3], want, atol=BLOCK_ATOL, rtol=0,
                                       msg=lambda m, name=name, layer=layer: f"{moe.name} {name} layer {layer}: {m}")


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_engine_batch_of_base_and_expert_adapters_equals_peft(moe, layout):
    """Base rows and seven adapters (attention, with DoRA too; experts by target_modules; all-linear with the
    router; target_parameters with rsLoRA; every expert's modules and the router's, as transformers 4.x saves them;
    two experts' at two ranks) in one continuous batch, three slots for seven adapters so that expert stacks are
    loaded, evicted and reused: greedy tokens equal, each chosen token's logprob within LOGPROB_ATOL."""
    model_dir = moe.model_dir if layout == "per-expert" else moe.fused_dir
    engine = LLMEngine(EngineConfig(model_dir=model_dir, device=ENGINE_DEVICE, dtype="float32", max_model_len=128,
                                    num_kv_blocks=96, block_size=4, max_loras=3, max_cpu_loras=2, max_lora_rank=16,
                                    multi_lora=moe.adapters))
    batch = {f"{lora}:{i}": (prompt, lora) for i, (prompt, lora) in enumerate(
        (prompt, lora) for prompt in PROMPTS for lora in [None, *moe.adapters])}
    requests, tokens, logprobs = run_greedy_logprobs(engine, batch, MAX_TOKENS)
    assert_matches_oracle(moe.oracles.__getitem__, batch, requests, tokens, logprobs, moe.name)
    assert engine.adapters.pinned_count() == 0
    assert engine.adapters.evictions > 0 and engine.adapters.host_evictions > 0  # slots and host copies reused


def test_adapters_change_the_outputs_and_fit(moe):
    """Every adapter moves the oracle's logits (a test that cannot fail otherwise proves nothing), and
    multi_lora.json's shape check takes each one."""
    ids = [1, 60, 61, 62, 63]
    base = teacher_forced_logits(moe.model_dir, None, ids, [64])
    for name in moe.adapters:
        assert (teacher_forced_logits(*moe.oracles[name], ids, [64]) - base).abs().max() > 1e-2, name
    assert fitting_adapters(moe.adapters, moe.model_dir) == moe.adapters
