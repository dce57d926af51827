"""Which projections of a LLaMA-family layer a LoRA adapter may target, and their shapes."""

from __future__ import annotations

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Parent module of each projection inside a decoder layer (HF LLaMA / Mistral / Qwen2 naming).
PARENTS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def head_dim(hf_config) -> int:
    """Per-head dimension: `head_dim` when the config sets it, else hidden_size // heads."""
    value = getattr(hf_config, "head_dim", None)
    if value:
        return int(value)
    return int(hf_config.hidden_size) // int(hf_config.num_attention_heads)


def module_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each targetable projection for a LLaMA-family config."""
    hidden = int(hf_config.hidden_size)
    inter = int(hf_config.intermediate_size)
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    d = head_dim(hf_config)
    return {
        "q_proj": (hidden, heads * d),
        "k_proj": (hidden, kv_heads * d),
        "v_proj": (hidden, kv_heads * d),
        "o_proj": (heads * d, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def module_path(layer: int, module: str) -> str:
    """Full HF module name of a projection, e.g. 'model.layers.0.self_attn.q_proj'."""
    return f"model.layers.{layer}.{PARENTS[module]}.{module}"


def normalize_target(name: str) -> str:
    """Short projection name ('q_proj') from a short or full module name; ValueError if unknown."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"module name must be a non-empty string, got {name!r}")
    parts = name.split(".")
    short = parts[-1]
    if short not in MODULES:
        raise ValueError(
            f"unknown LoRA target module {name!r}: supported modules are {', '.join(MODULES)}"
        )
    if len(parts) > 1 and parts[-2] != PARENTS[short]:
        raise ValueError(
            f"unknown LoRA target module {name!r}: {short} lives under "
            f"'{PARENTS[short]}', not '{parts[-2]}'"
        )
    return short
