"""Tiny random Mixtral and Qwen3-MoE checkpoints, built from transformers' config classes with each family's real
quirks, and the expert adapters tenants bring, in both layouts (the oracle is transformers + peft).

transformers 5's save_pretrained writes experts per module (Mixtral's block_sparse_moe.experts.e.w1/w2/w3,
Qwen3-MoE's mlp.experts.e.gate_proj/up_proj/down_proj), as 4.x checkpoints on the Hub have them; ``fuse_experts``
rewrites a checkpoint in the fused layout (mlp.experts.gate_up_proj / down_proj) that transformers 5 holds in memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# name -> build_tiny_llama keywords: 4 experts, top-2; Qwen3-MoE with norm_topk_prob both ways, one mlp_only layer
# (its dense MLP is wider than an expert) and head_dim decoupled from hidden / heads
MOE_FAMILIES: dict[str, dict] = {
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, intermediate_size=48),
    "qwen3moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40,
                     intermediate_size=96, norm_topk_prob=True, mlp_only_layers=[1], head_dim=32),
    "qwen3moe-raw": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40,
                         intermediate_size=96, norm_topk_prob=False, decoder_sparse_step=1, head_dim=32),
}
SMALL = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}


def build_moe(root: Path, name: str, seed: int = 0) -> str:
    """The tiny checkpoint of MOE_FAMILIES[name] (per-expert layout), with random norms and a random router (HF
    zero-inits Qwen3-MoE's router, which would tie every expert)."""
    from safetensors.torch import load_file, save_file

    from loraplex.models.builtin.demo import build_tiny_llama

    model_dir = build_tiny_llama(root / name / "model", seed=seed, **{**SMALL, **MOE_FAMILIES[name]})
    weights = model_dir / "model.safetensors"
    tensors = load_file(str(weights))
    gen = torch.Generator().manual_seed(seed + 1)
    for key, t in tensors.items():
        if "norm" in key:
            tensors[key] = t + 0.3 * torch.randn(t.shape, generator=gen)
        elif key.endswith(".gate.weight"):  # the router
            tensors[key] = torch.randn(t.shape, generator=gen)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return str(model_dir)


def fuse_experts(model_dir: str, out_dir: Path) -> str:
    """model_dir's checkpoint with its experts in transformers 5's fused layout (a copy of the other files)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out_dir)
    config = json.loads((out_dir / "config.json").read_text())
    gate, up, down = EXPERT_NAMES[config["model_type"]]
    parent = "block_sparse_moe" if config["model_type"] == "mixtral" else "mlp"
    n = config.get("num_local_experts") or config.get("num_experts")
    tensors = load_file(str(out_dir / "model.safetensors"))
    fused = {}
    for key in list(tensors):
        if f".{parent}.experts.0.{gate}." in key:
            p = key.split(f"{parent}.experts.")[0]
            take = [{m: tensors.pop(f"{p}{parent}.experts.{e}.{m}.weight") for m in (gate, up, down)} for e in range(n)]
            fused[f"{p}mlp.experts.gate_up_proj"] = torch.stack([torch.cat([t[gate], t[up]]) for t in take])
            fused[f"{p}mlp.experts.down_proj"] = torch.stack([t[down] for t in take])
            fused[f"{p}mlp.gate.weight"] = tensors.pop(f"{p}{parent}.gate.weight")
    tensors.update(fused)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return str(out_dir)


def build_adapter(model_dir: str, out_dir: Path, r: int, alpha: float, seed: int, target_modules=(),
                  **lora_kwargs) -> str:
    """A peft adapter saved by peft itself (target_modules, a list or "all-linear", and/or target_parameters in
    lora_kwargs), with random A and B (B times 0.3)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                  init_lora_weights=False, **lora_kwargs))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.3)
    peft_model.save_pretrained(out_dir)
    return str(out_dir)


def per_expert_adapter(model_dir: str, out_dir: Path, r: int, alpha: float, seed: int,
                       experts: tuple[int, ...] | None = None, rank_pattern: dict | None = None) -> str:
    """An adapter on each expert's modules as transformers 4.x's peft saves them (Mixtral's w1/w3/w2 under
    block_sparse_moe, Qwen3-MoE's gate_proj/up_proj/down_proj under mlp), with q_proj and v_proj; experts: the
    experts it adapts (None: all and the router, a target_modules list; else a regex naming them)."""
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text())
    family = config["model_type"]
    parent = "block_sparse_moe" if family == "mixtral" else "mlp"
    n = config.get("num_local_experts") or config.get("num_experts")
    h = config["hidden_size"]
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    heads, kv, d = config["num_attention_heads"], config["num_key_value_heads"], config.get("head_dim") or h // 4
    dense = set(config.get("mlp_only_layers") or [])
    gen = torch.Generator().manual_seed(seed)
    rank_pattern = rank_pattern or {}
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for m, (fin, fout) in {"q_proj": (h, heads * d), "v_proj": (h, kv * d)}.items():
            _pair(tensors, f"model.layers.{layer}.self_attn.{m}", r, fin, fout, gen)
        if experts is None and layer not in dense:  # the router (Linear in transformers 4.x)
            _pair(tensors, f"model.layers.{layer}.{parent}.gate", r, h, n, gen)
        if layer in dense:  # its dense MLP: transformers 4.x's peft targets it by the same names
            if experts is None:
                for m, (fin, fout) in {"gate_proj": (h, config["intermediate_size"]),
                                       "up_proj": (h, config["intermediate_size"]),
                                       "down_proj": (config["intermediate_size"], h)}.items():
                    _pair(tensors, f"model.layers.{layer}.mlp.{m}", r, fin, fout, gen)
            continue
        for e in (experts if experts is not None else range(n)):
            for m in EXPERT_NAMES[family]:
                name = f"model.layers.{layer}.{parent}.experts.{e}.{m}"
                rank = next((v for k, v in rank_pattern.items() if name.endswith(k)), r)
                fin, fout = (inter, h) if m in ("w2", "down_proj") else (h, inter)
                _pair(tensors, name, rank, fin, fout, gen)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    if experts is None:
        targets = ["q_proj", "v_proj", "gate", *EXPERT_NAMES[family]]
    else:
        targets = (rf".*\.(q_proj|v_proj)|.*\.experts\.({'|'.join(map(str, experts))})\."
                   rf"({'|'.join(EXPERT_NAMES[family])})")
    (out_dir / "adapter_config.json").write_text(json.dumps(dict(
        peft_type="LORA", r=r, lora_alpha=alpha, target_modules=targets, rank_pattern=rank_pattern,
        base_model_name_or_path=model_dir, bias="none", task_type="CAUSAL_LM")))
    return str(out_dir)


def _pair(tensors: dict, module: str, r: int, fin: int, fout: int, gen) -> None:
    tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(r, fin, generator=gen) * fin ** -0.5
    tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(fout, r, generator=gen) * 0.3 * r ** -0.5


def merged_model(model_dir: str, adapter_dir: str, out_dir: Path) -> str:
    """The oracle of a per-expert adapter: the base checkpoint with each module's delta s * B @ A merged into its
    weight (every expert's into that expert's), saved as a model of its own."""
    import shutil

    from safetensors.torch import load_file, save_file

    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    adapter = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    shutil.copytree(model_dir, out_dir)
    tensors = load_file(str(out_dir / "model.safetensors"))
    for key, a in adapter.items():
        if ".lora_A." not in key:
            continue
        module = key.removeprefix("base_model.model.").split(".lora_A.")[0]
        b = adapter[key.replace(".lora_A.", ".lora_B.")]
        r = a.shape[0]
        alpha = config["lora_alpha"]
        tensors[f"{module}.weight"] = tensors[f"{module}.weight"] + (alpha / r) * (b @ a)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return str(out_dir)
