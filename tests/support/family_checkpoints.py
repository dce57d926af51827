"""Tiny random checkpoints of each dense family we serve, built from transformers' own config classes with the
family's real quirks, and the peft adapters a tenant trains on them (the oracle is transformers + peft)."""

from __future__ import annotations

from pathlib import Path

WINDOW = 8  # sliding windows this short make prompts of 3x the window cheap

# name -> build_tiny_llama keywords. Small shapes (2-4 layers, hidden 64) keep each build and oracle run quick;
# head_dim is decoupled from hidden / heads where the family allows it.
DENSE_FAMILIES: dict[str, dict] = {
    # q/k RMSNorm per head, head_dim 32 != 64 / 4, tied embeddings
    "qwen3": dict(model_type="qwen3", head_dim=32, tie_word_embeddings=True),
    # (1 + w) norms, sandwich norms, the scaled embedding, GeGLU, query_pre_attn_scalar, soft-capping (caps
    # small enough to matter on random weights), interleaved local and global layers, head_dim 256
    "gemma2": dict(model_type="gemma2", head_dim=256, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                   final_logit_softcapping=3.0, sliding_window=WINDOW, tie_word_embeddings=True),
    # Gemma 3: q/k norms, a local rotary base on sliding layers and a linear-scaled global one, windows of WINDOW
    "gemma3": dict(model_type="gemma3_text", head_dim=32, query_pre_attn_scalar=32, sliding_window=WINDOW,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                       "rope_theta": 1000000.0}},
                   tie_word_embeddings=True),
    # fused qkv_proj / gate_up_proj in the checkpoint, partial rotary (Phi-4-mini's 0.75 of each head)
    "phi3": dict(model_type="phi3", rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                     "partial_rotary_factor": 0.75}, pad_token_id=None),
    # Phi-3.5/4-mini's longrope: per-frequency short factors and the attention factor of a 4x length ratio
    "phi3-longrope": dict(model_type="phi3", max_position_embeddings=1024, original_max_position_embeddings=256,
                          pad_token_id=None,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                           "short_factor": [1.0, 1.1, 1.3, 1.7, 2.3, 3.1],
                                           "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
                                           "original_max_position_embeddings": 256}),
    # sliding windows on every layer (Mistral) and on the layers past max_window_layers (Qwen2)
    "mistral-window": dict(model_type="mistral", sliding_window=WINDOW),
    "qwen2-window": dict(model_type="qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
}
SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256)

# The projections a peft adapter names on each family (Phi-3 trains its fused ones as they are)
ATTENTION = {"phi3": ["qkv_proj", "o_proj"], "phi3-longrope": ["qkv_proj", "o_proj"]}
ALL_LINEAR = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
              "phi3-longrope": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}
DEFAULT_ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
DEFAULT_ALL = DEFAULT_ATTENTION + ["gate_proj", "up_proj", "down_proj"]

# name -> (targets by kind, rank, alpha, extra LoraConfig keywords)
ADAPTERS = {
    "attn": ("attention", 8, 16, {}),
    "all": ("all", 16, 16, {}),
    "rslora": ("all", 8, 4, {"use_rslora": True}),
    "dora": ("attention", 4, 8, {"use_dora": True}),
}


def build_family(root: Path, name: str, adapters: bool = True) -> tuple[str, dict[str, str]]:
    """The tiny checkpoint of DENSE_FAMILIES[name] with random norm weights (HF inits them to one constant,
    which would hide a misread norm) and its ADAPTERS: (model dir, adapter name -> folder)."""
    import torch
    from safetensors.torch import load_file, save_file

    from loraplex.models.builtin.demo import build_peft_adapter, build_tiny_llama

    spec = {**SMALL, **DENSE_FAMILIES[name]}
    model_dir = build_tiny_llama(root / name / "model", **spec)
    weights = model_dir / "model.safetensors"
    tensors = load_file(str(weights))
    gen = torch.Generator().manual_seed(1)
    for key, t in tensors.items():
        if "norm" in key:
            tensors[key] = t + 0.3 * torch.randn(t.shape, generator=gen)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    folders = {}
    for i, (adapter, (kind, r, alpha, extra)) in enumerate(ADAPTERS.items() if adapters else ()):
        targets = (ATTENTION.get(name, DEFAULT_ATTENTION) if kind == "attention"
                   else ALL_LINEAR.get(name, DEFAULT_ALL))
        folders[adapter] = str(build_peft_adapter(model_dir, root / name / adapter, r, alpha, targets, seed=10 + i,
                                                   b_scale=0.3, **extra))
    return str(model_dir), folders
