"""max_expert_lora_rank (decision 070): the expert LoRA stacks sized or turned off. With them off, an adapter on the
experts or the router is refused by name before it is read into memory or takes a slot, and attention LoRA on a
MoE model still equals peft; ``auto`` resolves to the figures of the decision record."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from exactness import assert_matches_oracle, run_greedy_logprobs
from moe_models import ATTENTION, build_adapter, build_moe, per_expert_adapter
from safetensors.torch import save as save_safetensors
from transformers import Qwen3MoeConfig

from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.request import SamplingParams
from loraplex.exceptions import AdapterError
from loraplex.lora import adapter as adapter_module
from loraplex.lora.adapter import parse_peft_adapter
from loraplex.lora.expert_rank import expert_stack_bytes, resolve_expert_rank
from loraplex.lora.moe_layout import expert_layout
from loraplex.lora.shapes import module_shapes
from loraplex.lora.slots import LoraSlots

P = "base_model.model.model.layers"
MIXTRAL_8X7B = SimpleNamespace(model_type="mixtral", num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                               num_local_experts=8, num_experts_per_tok=2)
QWEN3_30B_A3B = SimpleNamespace(model_type="qwen3_moe", num_hidden_layers=48, hidden_size=2048,
                                moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                                decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)


def qwen() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(hidden_size=32, intermediate_size=48, moe_intermediate_size=16, head_dim=8,
                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                          num_experts_per_tok=2, mlp_only_layers=[1], vocab_size=64)


def pairs(names: list[str], r: int, fin: int, fout: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {t: x for n in names for t, x in ((f"{n}.lora_A.weight", torch.randn(r, fin, generator=gen)),
                                             (f"{n}.lora_B.weight", torch.randn(fout, r, generator=gen)))}


def parse(config: dict, tensors: dict, hf_config, max_expert_rank):
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config}
    return parse_peft_adapter(json.dumps(config).encode(), save_safetensors(tensors), "t", hf_config, 16,
                              max_expert_rank=max_expert_rank)


def test_knob_values_and_env_override(monkeypatch):
    assert EngineConfig().max_expert_lora_rank == "auto"
    for ok in ("auto", 0, 8, 64):
        EngineConfig(max_expert_lora_rank=ok)
    for bad in (-1, 65, "on", True, 8.0):
        with pytest.raises(ValueError, match="max_expert_lora_rank must be auto or an integer from 0"):
            EngineConfig(max_expert_lora_rank=bad)
    monkeypatch.setenv("LORAPLEX_ENGINE_CONFIG", json.dumps({"max_expert_lora_rank": 0}))
    assert EngineConfig().with_env_overrides().max_expert_lora_rank == 0


def test_auto_rank_and_bytes_of_the_decision_record():
    """auto at 8 slots of max_lora_rank 64 (the defaults): Mixtral-8x7B 32, Qwen3-30B-A3B 8; vLLM's defaults (one
    slot of rank 16) fit as they are; tiny models keep max_lora_rank; a dense model has no stacks."""
    mixtral, qwen3 = expert_layout(MIXTRAL_8X7B), expert_layout(QWEN3_30B_A3B)
    assert resolve_expert_rank("auto", mixtral, 8, 64) == 32
    assert resolve_expert_rank("auto", qwen3, 8, 64) == 8
    assert resolve_expert_rank("auto", qwen3, 1, 16) == 16
    assert resolve_expert_rank("auto", qwen3, 8, 48) == 8  # lowered through powers of two
    assert resolve_expert_rank("auto", expert_layout(qwen()), 8, 64) == 64
    assert resolve_expert_rank(16, qwen3, 8, 64) == 16 and resolve_expert_rank(0, qwen3, 8, 64) == 0
    assert resolve_expert_rank("auto", None, 8, 64) == 0
    gib = 2 ** 30  # fp16 stacks
    assert expert_stack_bytes(qwen3, 48, 8, 64, 2) / gib == pytest.approx(49.6, abs=0.05)
    assert expert_stack_bytes(qwen3, 48, 8, 16, 2) / gib == pytest.approx(12.4, abs=0.05)
    assert expert_stack_bytes(qwen3, 48, 8, 8, 2) / gib == pytest.approx(6.2, abs=0.05)
    assert expert_stack_bytes(mixtral, 32, 8, 64, 2) / gib == pytest.approx(13.6, abs=0.05)
    assert expert_stack_bytes(mixtral, 32, 8, 32, 2) / gib == pytest.approx(6.8, abs=0.05)


def test_slots_memory_with_and_without_expert_stacks():
    cfg = qwen()
    layout = expert_layout(cfg)

    def slots(rank):
        return LoraSlots(3, module_shapes(cfg), 2, 8, torch.float32, "cpu", experts=layout, expert_rank=rank)

    full, half, none = slots(None), slots(4), slots(0)
    assert none.xa == [{}, {}, {}] and none.max_expert_rank == 0 and full.max_expert_rank == 8
    assert none.a[0].keys() == none.a[1].keys() - {"gate_proj", "up_proj", "down_proj"}  # sparse layers: no MLP stacks
    assert full.memory_bytes() - none.memory_bytes() == expert_stack_bytes(layout, 3, 2, 8, 4) > 0
    assert half.memory_bytes() - none.memory_bytes() == expert_stack_bytes(layout, 3, 2, 4, 4)
    assert full.xa[0]["gate_proj"].shape == (2, 4, 8, 32) and half.xa[0]["gate_proj"].shape == (2, 4, 4, 32)
    rank8 = parse({"r": 8, "target_modules": r".*\.experts\.1\.gate_proj"},
                  pairs([f"{P}.{i}.mlp.experts.1.gate_proj" for i in (0, 2)], 8, 32, 16), cfg, None)
    full.load(0, rank8)
    for small in (half, none):  # the slots refuse what the parser would have refused
        with pytest.raises(ValueError, match="max_expert_rank"):
            small.load(0, rank8)


@pytest.mark.parametrize("what", ["per-expert", "router", "fused", "target_parameters"])
def test_expert_and_router_adapters_refused_before_reading_tensors(what, monkeypatch):
    cfg = qwen()
    attention = pairs([f"{P}.0.self_attn.q_proj"], 4, 32, 32)
    config, tensors = {
        "per-expert": ({"target_modules": ["q_proj", "gate_proj"]},
                       {**attention, **pairs([f"{P}.0.mlp.experts.1.gate_proj"], 4, 32, 16)}),
        "router": ({"target_modules": ["gate"]}, pairs([f"{P}.2.mlp.gate"], 4, 32, 4)),
        "fused": ({"target_modules": [], "target_parameters": ["down_proj"]}, pairs([f"{P}.0.mlp.experts"], 16, 16, 32)),
        "target_parameters": ({"target_modules": ["q_proj"], "target_parameters": ["mlp.experts.down_proj"]}, attention),
    }[what]

    def unread(*_):
        raise AssertionError("tensors were read")

    monkeypatch.setattr(adapter_module, "load_safetensors", unread)
    with pytest.raises(AdapterError, match=r"adapter 't': .* adapts the MoE experts or router, .*max_expert_lora_rank "
                                           r"is 0\): use an adapter without expert or router LoRA"):
        parse(config, tensors, cfg, 0)


def test_expert_rank_above_the_knob_refused_by_name_and_attention_served_without_stacks():
    cfg = qwen()
    config = {"target_modules": r".*\.experts\.1\.gate_proj"}
    experts = pairs([f"{P}.{i}.mlp.experts.1.gate_proj" for i in (0, 2)], 4, 32, 16)
    with pytest.raises(AdapterError, match="gate_proj has rank 4, above the server's max_expert_lora_rank 2"):
        parse(config, experts, cfg, 2)
    assert parse(config, experts, cfg, 4).experts
    attention = parse({"target_modules": ["q_proj"]}, pairs([f"{P}.{i}.self_attn.q_proj" for i in range(3)], 4, 32, 32),
                      cfg, 0)
    assert attention.experts == {} and len(attention.weights) == 3


def test_engine_without_expert_stacks_serves_attention_lora_and_refuses_expert_adapters(tmp_path):
    """max_expert_lora_rank 0 on a tiny Qwen3-MoE: base and an attention adapter in one batch equal transformers +
    peft; a request for an expert adapter fails alone, naming the knob, and its adapter takes no slot."""
    model_dir = build_moe(tmp_path, "qwen3moe")
    adapters = {"attn": build_adapter(model_dir, tmp_path / "attn", 8, 16, 11, ATTENTION),
                "per-expert": per_expert_adapter(model_dir, tmp_path / "per-expert", 4, 8, 14)}
    engine = LLMEngine(EngineConfig(model_dir=model_dir, device="cpu", dtype="float32", max_model_len=64,
                                    num_kv_blocks=32, block_size=4, max_loras=2, max_lora_rank=8,
                                    max_expert_lora_rank=0, multi_lora=adapters))
    assert engine.expert_lora_bytes == 0 and engine.lora_slots.xa == [{}] * 3
    params = SamplingParams.from_dict({"temperature": 0, "max_tokens": 4, "lora_name": "per-expert"})
    engine.add_request(engine.make_request("expert", "abab 1, 2", params, "t"))
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert len(outs) == 1 and outs[0].finished and isinstance(outs[0].error, AdapterError)
    assert "max_expert_lora_rank is 0" in str(outs[0].error) and "'per-expert'" in str(outs[0].error)
    batch = {"base": ("The quick brown fox", None), "attn": ("The quick brown fox", "attn")}
    requests, tokens, logprobs = run_greedy_logprobs(engine, batch, 4)
    assert_matches_oracle(lambda a: (model_dir, adapters[a] if a else None), batch, requests, tokens, logprobs,
                          "qwen3moe without expert stacks")
    assert engine.adapters.resident_names() == ["attn"] and engine.adapters.pinned_count() == 0


def test_an_upload_is_checked_at_the_expert_rank_that_will_serve_it(tmp_path):
    """The store refuses an expert adapter the server holds no stacks for, or one above its expert rank, at upload
    (not stored, then refused on every request); attention LoRA uploads as before."""
    from loraplex.exceptions import AdapterStoreError
    from loraplex.lora.store import AdapterStore
    from loraplex.tenancy.tenants import Tenant

    cfg, store, tenant = qwen(), AdapterStore(tmp_path / "store"), Tenant("t", b"")
    expert = pairs([f"{P}.0.mlp.experts.{e}.gate_proj" for e in range(4)], 4, 32, 16)
    text = json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["gate_proj"],
                       "layers_to_transform": [0]})
    with pytest.raises(AdapterStoreError, match=r"max_expert_lora_rank is 0"):
        store.upload(tenant, "experts", text, save_safetensors(expert), cfg, 16, max_expert_rank=0)
    with pytest.raises(AdapterStoreError, match=r"above the server's max_expert_lora_rank 2"):
        store.upload(tenant, "experts", text, save_safetensors(expert), cfg, 16, max_expert_rank=2)
    assert store.lookup("t", "experts") is None
    attention = pairs([f"{P}.0.self_attn.q_proj"], 4, 32, 32)
    text = json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
                       "layers_to_transform": [0]})
    store.upload(tenant, "attention", text, save_safetensors(attention), cfg, 16, max_expert_rank=0)
    assert store.lookup("t", "attention") is not None
