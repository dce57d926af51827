"""Expert LoRA adapters on Mixtral and Qwen3-MoE (decision 066): both layouts parsed into the same per-expert pairs,
peft's ParamWrapper delta reproduced, what is not served refused by name, and the expert stacks of LoraSlots."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save as save_safetensors
from transformers import LlamaConfig, MixtralConfig, Qwen3MoeConfig

from loraplex.exceptions import AdapterError
from loraplex.lora.adapter import check_safetensors_header, max_adapter_tensors, parse_peft_adapter
from loraplex.lora.moe_layout import expert_layout
from loraplex.lora.shapes import MODULES, module_shapes
from loraplex.lora.slots import LoraSlots

H, I_MIX, I_QWEN, E = 32, 24, 16, 4
P = "base_model.model.model.layers"


def mixtral(**kw):
    return MixtralConfig(**{**dict(hidden_size=H, intermediate_size=I_MIX, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, num_local_experts=E, num_experts_per_tok=2, vocab_size=64,
                                   architectures=["MixtralForCausalLM"]), **kw})


def qwen(**kw):
    return Qwen3MoeConfig(**{**dict(hidden_size=H, intermediate_size=48, moe_intermediate_size=I_QWEN, head_dim=8,
                                    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts=E,
                                    num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=True, vocab_size=64,
                                    architectures=["Qwen3MoeForCausalLM"]), **kw})


def parse(config: dict, tensors: dict, hf_config, max_rank: int = 16):
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config}
    return parse_peft_adapter(json.dumps(config).encode(), save_safetensors(tensors), "t", hf_config, max_rank)


def per_expert_tensors(hf_config, r=4, experts=range(E), layers=None, seed=0, ranks=None) -> dict:
    """A transformers 4.x adapter's tensors on every expert's three modules (ranks: expert -> rank)."""
    gen = torch.Generator().manual_seed(seed)
    layout = expert_layout(hf_config)
    out = {}
    for layer in layers if layers is not None else layout.layers:
        for e in experts:
            for leaf, module in layout.leaves.items():
                fin, fout = layout.shapes()[module]
                rank = (ranks or {}).get(e, r)
                name = f"{P}.{layer}.{layout.parent}.experts.{e}.{leaf}"
                out[f"{name}.lora_A.weight"] = torch.randn(rank, fin, generator=gen)
                out[f"{name}.lora_B.weight"] = torch.randn(fout, rank, generator=gen)
    return out


def test_layouts_of_each_family():
    mix = expert_layout(mixtral())
    assert (mix.layers, mix.renormalize, mix.parent, mix.top_k) == ((0, 1), True, "block_sparse_moe", 2)
    assert mix.leaves == {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    assert mix.shapes() == {"gate_proj": (H, I_MIX), "up_proj": (H, I_MIX), "down_proj": (I_MIX, H)}
    q = expert_layout(qwen())
    assert (q.layers, q.renormalize, q.parent, q.intermediate) == ((0, 2), True, "mlp", I_QWEN)
    assert expert_layout(qwen(norm_topk_prob=False, mlp_only_layers=[], decoder_sparse_step=2)).layers == (1,)
    assert expert_layout(qwen(norm_topk_prob=False)).renormalize is False
    assert expert_layout(LlamaConfig()) is None
    # config.json's fields as transformers 5 saves them (num_local_experts), read without transformers
    saved = json.loads(qwen().to_json_string())
    assert expert_layout(SimpleNamespace(**saved)) == q
    with pytest.raises(ValueError, match="num_experts_per_tok 5"):
        expert_layout(mixtral(num_experts_per_tok=5))


def test_mixtral_per_expert_modules_w1_gate_w3_up_w2_down():
    cfg = mixtral()
    tensors = per_expert_tensors(cfg)
    adapter = parse({"target_modules": ["w1", "w2", "w3"]}, tensors, cfg)
    assert set(adapter.experts) == {(layer, m) for layer in (0, 1) for m in ("gate_proj", "up_proj", "down_proj")}
    assert adapter.weights == {} and adapter.rank == 4
    for (layer, module), groups in adapter.experts.items():
        (group,) = groups
        assert group.experts == tuple(range(E)) and group.scale == 2.0
        leaf = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[module]
        for i, e in enumerate(group.experts):
            name = f"{P}.{layer}.block_sparse_moe.experts.{e}.{leaf}"
            assert torch.equal(group.a[i], tensors[f"{name}.lora_A.weight"])
            assert torch.equal(group.b[i], tensors[f"{name}.lora_B.weight"])


def test_per_expert_subset_by_regex_with_rank_pattern_holds_only_its_file():
    """A regex naming two experts, one at another rank: only those experts, unpadded (no E x amplification)."""
    cfg = qwen()
    tensors = per_expert_tensors(cfg, experts=(0, 2), ranks={2: 2})
    adapter = parse({"target_modules": r".*\.experts\.(0|2)\.(gate_proj|up_proj|down_proj)",
                     "rank_pattern": {r"experts\.2\.\w+": 2}, "alpha_pattern": {r"experts\.2\.\w+": 8}}, tensors, cfg)
    groups = adapter.experts[(2, "up_proj")]
    assert [(g.experts, g.rank, g.scale) for g in groups] == [((0,), 4, 2.0), ((2,), 2, 4.0)]
    assert adapter.nbytes() == sum(t.nbytes for t in tensors.values())
    assert not any(layer == 1 for layer, _ in adapter.experts)  # the mlp_only layer has no experts


def _peft_adapter(tmp_path, hf_config, **lora):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config).float().eval()
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora))
    peft_model.save_pretrained(tmp_path)
    config = (tmp_path / "adapter_config.json").read_bytes()
    weights = (tmp_path / "adapter_model.safetensors").read_bytes()
    return peft_model, parse_peft_adapter(config, weights, "t", hf_config, 16)


@pytest.mark.parametrize("make", [mixtral, qwen])
def test_target_parameters_give_peft_param_wrapper_deltas(tmp_path, make):
    """Each expert's s * B_e @ A_e equals peft's ParamWrapper.get_delta_weight: gate_up_proj's rows [gate; up] and
    down_proj, from the nested wrappers' interleaved A [E*r, in] and B [out, r*E]."""
    cfg = make()
    peft_model, adapter = _peft_adapter(tmp_path, cfg, r=4, lora_alpha=8, target_modules=["q_proj"],
                                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    layout = expert_layout(cfg)
    for layer in layout.layers:
        outer = peft_model.base_model.model.model.layers[layer].mlp.experts  # down_proj's wrapper, around gate_up's
        want = {"down_proj": outer.get_delta_weight("default")}
        gate_up = outer.base_layer.get_delta_weight("default")
        want["gate_proj"], want["up_proj"] = gate_up[:, :layout.intermediate], gate_up[:, layout.intermediate:]
        for module, delta in want.items():
            (group,) = adapter.experts[(layer, module)]
            got = group.scale * torch.bmm(group.b, group.a)
            torch.testing.assert_close(got, delta, rtol=1e-5, atol=1e-6, msg=f"layer {layer} {module}")
    assert (0, "q_proj") in adapter.weights


def test_expert_target_modules_trained_under_transformers_5_are_peft_s_rank_2r_gate_up(tmp_path):
    """peft on transformers 5 turns target_modules w1/w3/w2 into target_parameters, gate_up_proj at rank 2r."""
    _, adapter = _peft_adapter(tmp_path, mixtral(), r=4, lora_alpha=8, target_modules=["w1", "w2", "w3"])
    assert [g.rank for g in adapter.experts[(0, "gate_proj")]] == [8]
    assert [g.rank for g in adapter.experts[(0, "down_proj")]] == [4]


def _fused(layer, depth, a_shape, b_shape):
    p = f"{P}.{layer}.mlp.experts." + "base_layer." * depth
    return {f"{p}lora_A.weight": torch.randn(a_shape), f"{p}lora_B.weight": torch.randn(b_shape)}


def _router(layer, parent="block_sparse_moe", r=4):
    return {f"{P}.{layer}.{parent}.gate.lora_A.weight": torch.randn(r, H),
            f"{P}.{layer}.{parent}.gate.lora_B.weight": torch.randn(E, r)}


def test_router_lora_in_both_layouts(tmp_path):
    """peft's all-linear on transformers 5 adapts the router by target_parameters gate.weight: its delta is the
    ParamWrapper's; transformers 4.x's router module (Mixtral's block_sparse_moe.gate) reads the same way."""
    cfg = mixtral()
    peft_model, adapter = _peft_adapter(tmp_path, cfg, r=4, lora_alpha=8, target_modules="all-linear")
    for layer in (0, 1):
        (group,) = adapter.experts[(layer, "router")]
        want = peft_model.base_model.model.model.layers[layer].mlp.gate.get_delta_weight("default")
        torch.testing.assert_close(group.scale * group.b[0] @ group.a[0], want, rtol=1e-5, atol=1e-6)
    assert {m for _, m in adapter.experts} == {"gate_proj", "up_proj", "down_proj", "router"}
    old = parse({"target_modules": ["gate", "w1", "w2", "w3"], "rank_pattern": {"gate": 2}},
                {**per_expert_tensors(cfg), **_router(0, r=2), **_router(1, r=2)}, cfg)
    assert [(g.experts, g.rank, g.scale) for g in old.experts[(1, "router")]] == [((0,), 2, 4.0)]


REFUSALS = {
    "router tensors the config does not target": (mixtral, {"target_modules": ["w1", "w2", "w3"]},
                                                   lambda c: {**per_expert_tensors(c), **_router(0), **_router(1)},
                                                   "does not target"),
    "a targeted router without tensors": (mixtral, {"target_parameters": ["gate.weight"]}, lambda c: _router(0),
                                          "router of layer 1 but"),
    "DoRA on the router": (qwen, {"target_modules": ["gate"], "use_dora": True},
                           lambda c: {**_router(0, "mlp"), **_router(2, "mlp")}, "DoRA"),
    "DoRA on experts": (mixtral, {"target_modules": ["w1", "w2", "w3"], "use_dora": True}, per_expert_tensors, "DoRA"),
    "target_parameters on a dense model": (lambda: LlamaConfig(hidden_size=H, num_hidden_layers=2,
                                                               num_attention_heads=4, intermediate_size=48),
                                           {"target_parameters": ["mlp.experts.down_proj"]}, lambda c: {}, "MoE"),
    "target_parameters beyond the experts": (qwen, {"target_parameters": ["q_proj.weight"]}, lambda c: {},
                                             "selects none of the experts' gate_up_proj and down_proj"),
    "an expert the model lacks": (mixtral, {"target_modules": ["w1", "w2", "w3"]},
                                  lambda c: per_expert_tensors(c, experts=(E,)), f"expert {E}"),
    "experts of a dense layer": (qwen, {"target_modules": r".*\.experts\.\d+\.\w+"},
                                 lambda c: per_expert_tensors(c, layers=(1,)), "has none"),
    "a fused A of the wrong shape": (qwen, {"target_parameters": ["mlp.experts.down_proj"]},
                                     lambda c: {**_fused(0, 0, (4 * E + 1, I_QWEN), (H, 4 * E)),
                                                **_fused(2, 0, (4 * E, I_QWEN), (H, 4 * E))}, "has shape"),
    "a wrapper the config does not target": (qwen, {"target_parameters": ["mlp.experts.down_proj"]},
                                             lambda c: {**_fused(0, 1, (4 * E, H), (2 * I_QWEN, 4 * E)),
                                                        **_fused(0, 0, (4 * E, I_QWEN), (H, 4 * E))},
                                             "do not select"),
    "a targeted expert without tensors": (mixtral, {"target_modules": ["w1", "w2", "w3"]},
                                          lambda c: per_expert_tensors(c, experts=(0, 1, 2)), "experts.3.w2 but"),
    "a rank above the server's": (mixtral, {"target_modules": ["w1", "w2", "w3"], "r": 32}, lambda c:
                                  per_expert_tensors(c, r=32), "above the server's max_lora_rank 16"),
    "both layouts": (qwen, {"target_parameters": ["down_proj"], "target_modules": r".*\.experts\.\d+\.\w+"},
                     lambda c: {**per_expert_tensors(c), **_fused(0, 0, (4 * E, I_QWEN), (H, 4 * E))}, "mixes"),
    "shared experts": (qwen, {"target_modules": ["q_proj"]},
                       lambda c: {f"{P}.0.mlp.shared_expert.up_proj.lora_A.weight": torch.randn(4, H)}, "shared"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_is_not_served_is_refused_by_name(case):
    make, config, tensors, match = REFUSALS[case]
    cfg = make()
    with pytest.raises(AdapterError, match=match):
        parse(config, tensors(cfg), cfg)


def test_tensor_and_byte_bounds_count_every_expert():
    from loraplex.lora.store import max_weights_bytes

    many = qwen(num_experts=64)  # experts' pairs outweigh the dense ones: the bound must count them
    full = per_expert_tensors(many, r=16, experts=range(64))
    assert len(save_safetensors({k: t.double() for k, t in full.items()})) <= max_weights_bytes(many, 16)
    cfg = qwen()
    dense = 2 * 3 * len(MODULES)
    assert max_adapter_tensors(cfg) - max_adapter_tensors(qwen(num_experts=0)) == 2 * 2 * (E * 3 + 1)  # 2 MoE layers
    assert max_adapter_tensors(cfg) > dense
    header = {f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
              for i in range(max_adapter_tensors(cfg) + 1)}
    raw = json.dumps(header).encode()
    data = len(raw).to_bytes(8, "little") + raw + bytes(4 * len(header))
    with pytest.raises(AdapterError, match="tensors"):
        check_safetensors_header(data, max_adapter_tensors(cfg))


def test_slots_hold_expert_stacks_that_load_clear_and_reuse():
    cfg = qwen()
    layout = expert_layout(cfg)
    slots = LoraSlots(3, module_shapes(cfg), 2, 8, torch.float32, "cpu", experts=layout)
    assert "gate_proj" not in slots.a[0] and "gate_proj" in slots.a[1]  # the dense MLP only where it exists
    assert slots.xa[0]["up_proj"].shape == (2, E, 8, H) and slots.xb[2]["down_proj"].shape == (2, E, H, 8)
    assert slots.xa[1] == {}
    attention = sum((i + o) for m, (i, o) in module_shapes(cfg).items() if m not in ("gate_proj", "up_proj", "down_proj"))
    mlp = sum(i + o for m, (i, o) in module_shapes(cfg).items() if m in ("gate_proj", "up_proj", "down_proj"))
    weights = 2 * 8 * 4 * (3 * attention + mlp + 2 * (E * (2 * (H + I_QWEN) + (I_QWEN + H)) + H + E))
    assert slots.memory_bytes() == weights + 2 * (3 * 7 * 2 * 4) + 2 * (3 * 3 * 2 * E * 4) + 2 * (3 * 2 * 4)

    some = parse({"target_modules": r".*\.experts\.(1|3)\.(gate_proj|up_proj|down_proj)"},
                 per_expert_tensors(cfg, experts=(1, 3), seed=1), cfg)
    slots.load(1, some)
    assert slots.holds_experts(0) and slots.holds_experts(2) and not slots.holds_experts(1)
    (group,) = some.experts[(2, "down_proj")]
    assert torch.equal(slots.xa[2]["down_proj"][1, [1, 3], :4], group.a)
    assert torch.equal(slots.xb[2]["down_proj"][1, [1, 3], :, :4], group.b)
    assert not slots.xa[2]["down_proj"][1, [0, 2]].any() and not slots.xa[2]["down_proj"][0].any()
    assert slots.expert_stacks[2]["down_proj"][2].tolist() == [0] * E + [0, 4, 0, 4]  # rank of slot 1's experts
    all_experts = parse({"target_modules": ["gate_proj", "up_proj", "down_proj"], "r": 2},
                        {**per_expert_tensors(cfg, r=2, seed=2),
                         **{f"{P}.1.mlp.{m}.lora_{x}.weight": torch.randn(*(s if x == "A" else s[::-1]))
                            for m, (i, o) in module_shapes(cfg).items() if m.endswith(("gate_proj", "up_proj", "down_proj"))
                            for x, s in (("A", (2, i)), ("B", (2, o)))}}, cfg)
    slots.load(1, all_experts)  # the same slot: nothing of the first adapter is left
    assert not slots.xa[2]["down_proj"][1, :, 2:].any() and not slots.xb[0]["gate_proj"][1, :, :, 2:].any()
    assert slots.expert_stacks[0]["gate_proj"][2].tolist() == [0] * E + [2] * E
    slots.clear(1)
    assert not slots.holds_experts(0) and not any(t.any() for layer in slots.xa + slots.xb for t in layer.values())
    assert not slots._xranks.any() and not slots._xscales.any()
    dense_slots = LoraSlots(3, module_shapes(cfg), 2, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="no expert stacks"):
        dense_slots.load(0, some)
