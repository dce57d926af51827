"""Which projections of a decoder layer a LoRA adapter may target, and their shapes."""

from __future__ import annotations

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Parent module of each projection inside a decoder layer (HF naming; qkv_proj and gate_up_proj are Phi-3's
# fused checkpoint projections, which adapters target as they are and the loader splits into ours).
PARENTS = {
    "qkv_proj": "self_attn",
    "gate_up_proj": "mlp",
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
    """(in_features, out_features) of each targetable projection for a config of any supported family."""
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


def checkpoint_modules(hf_config) -> dict[str, tuple[str, ...]]:
    """The projections an adapter for this checkpoint names (as its modules are called) -> the MODULES each
    holds, end to end along its output: Phi-3's qkv_proj and gate_up_proj hold several, the rest one."""
    from loraplex.models.family import CHECKPOINT_FUSED

    fused = next((f for a, f in CHECKPOINT_FUSED.items() if a in (getattr(hf_config, "architectures", None) or [])),
                 {})
    held = {m for parts in fused.values() for m in parts}
    names = {m: (m,) for m in MODULES if m not in held}
    names.update(fused)
    return dict(sorted(names.items(), key=lambda item: MODULES.index(item[1][0])))


def module_path(layer: int, module: str) -> str:
    """Full HF module name of a projection, e.g. 'model.layers.0.self_attn.q_proj'."""
    return f"model.layers.{layer}.{PARENTS[module]}.{module}"


def normalize_target(name: str, modules=MODULES) -> str:
    """Short projection name ('q_proj') from a short or full module name, one of modules; ValueError if unknown."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"module name must be a non-empty string, got {name!r}")
    parts = name.split(".")
    short = parts[-1]
    if short not in modules:
        raise ValueError(
            f"unknown LoRA target module {name!r}: supported modules are {', '.join(modules)}"
        )
    if len(parts) > 1 and parts[-2] != PARENTS[short]:
        raise ValueError(
            f"unknown LoRA target module {name!r}: {short} lives under "
            f"'{PARENTS[short]}', not '{parts[-2]}'"
        )
    return short
