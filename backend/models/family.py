"""What sets a checkpoint's family apart from Llama, read once from its HF config (decision 068).

The decoder in llama.py is one house for every family; each quirk below is a field, and the
forward pass branches on fields, never on family names. Every family keeps the packed or fused
projections; those whose layers the native one-call decode computes (Llama, Mistral and Qwen2 with
or without windows, Phi-3 with whole-head rotary) keep it too; the rest decode on the per-op path,
whose ops cover each quirk.
"""

from __future__ import annotations

from dataclasses import dataclass

# architectures -> the family's name in messages and the README's table
FAMILIES = {
    "LlamaForCausalLM": "Llama",
    "MistralForCausalLM": "Mistral",
    "Qwen2ForCausalLM": "Qwen2",
    "Qwen3ForCausalLM": "Qwen3",
    "Gemma2ForCausalLM": "Gemma 2",
    "Gemma3ForCausalLM": "Gemma 3 (text)",
    "Phi3ForCausalLM": "Phi-3 / Phi-4",
    "MixtralForCausalLM": "Mixtral",
    "Qwen3MoeForCausalLM": "Qwen3-MoE",
}
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
MOE = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")
# checkpoint projections that hold several of ours, end to end along the output (Phi-3's)
CHECKPOINT_FUSED = {"Phi3ForCausalLM": {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                                        "gate_up_proj": ("gate_proj", "up_proj")}}
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True, slots=True)
class Family:
    """One checkpoint's quirks (Llama's values are the defaults)."""

    architecture: str
    qk_norm: bool = False  # RMSNorm per head on q and k before RoPE (Qwen3, Gemma 3)
    norm_offset: bool = False  # norms scale by (1 + w) (Gemma): folded into the weights at load
    embed_scale: float | None = None  # the embedding lookup times sqrt(hidden) (Gemma)
    activation: str = "silu"  # the gated MLP's: "silu" or "gelu_tanh" (Gemma's GeGLU)
    sandwich_norms: bool = False  # norms after attention and before and after the MLP (Gemma 2/3)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    attn_scale: float = 1.0  # the attention's score scale (head_dim ** -0.5, or query_pre_attn_scalar's)
    layer_windows: tuple[int | None, ...] = ()  # each layer's sliding window (None: full attention)
    layer_rope: tuple[str, ...] = ()  # each layer's rotary table: "default" or its layer type (Gemma 3)
    head_dim: int = 0
    rotary_dim: int = 0  # dimensions of each head RoPE turns (Phi-3's partial_rotary_factor)
    moe: bool = False  # the MLP is a routed mixture of experts (models/moe.py)

    @property
    def one_call_decode(self) -> bool:
        """Whether the native one-call decode forward computes this family's layers: Llama's, with per-layer
        windows and soft-capped attention (the embedding's scale and the final cap lie outside the call)."""
        return (not (self.qk_norm or self.sandwich_norms or self.moe) and self.activation == "silu"
                and self.rotary_dim == self.head_dim and len(set(self.layer_rope)) <= 1)


def supported() -> str:
    """The supported architectures, as a refusal lists them."""
    return ", ".join(f"{arch} ({name})" for arch, name in FAMILIES.items())


def rope_settings(config, layer_type: str) -> dict:
    """The rotary settings of one layer type (Gemma 3 keeps one dict per layer type, the rest one dict)."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type in params and isinstance(params[layer_type], dict):
        return dict(params[layer_type])
    if params:
        return dict(params)
    settings = dict(getattr(config, "rope_scaling", None) or {})
    settings.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return settings


def layer_windows(config) -> tuple[int | None, ...]:
    """Each layer's sliding window: per ``layer_types`` where the config has them (Qwen2/3 with
    use_sliding_window, Gemma), else ``sliding_window`` on every layer (Mistral, Phi-3, Mixtral)."""
    window = getattr(config, "sliding_window", None) or None
    layers = int(config.num_hidden_layers)
    types = getattr(config, "layer_types", None)
    if types is not None:
        return tuple(window if t == "sliding_attention" else None for t in types[:layers])
    return (window,) * layers


def family_of(config, head_dim: int) -> Family:
    """The Family of a config whose architecture load_hf_config accepted."""
    arch = next(a for a in config.architectures if a in FAMILIES)
    layers = int(config.num_hidden_layers)
    types = getattr(config, "layer_types", None) or ["full_attention"] * layers
    per_type_rope = any(isinstance(v, dict) for v in (getattr(config, "rope_parameters", None) or {}).values())
    partial = float(rope_settings(config, types[0]).get("partial_rotary_factor",
                                                        getattr(config, "partial_rotary_factor", 1.0)) or 1.0)
    gemma = arch in GEMMA
    scalar = getattr(config, "query_pre_attn_scalar", None) if gemma else None
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    return Family(
        architecture=arch,
        qk_norm=arch in QK_NORM,
        norm_offset=gemma,
        embed_scale=float(config.hidden_size) ** 0.5 if gemma else None,
        activation=ACTIVATIONS.get(act, act),
        sandwich_norms=gemma,
        attn_softcap=getattr(config, "attn_logit_softcapping", None) if gemma else None,
        final_softcap=getattr(config, "final_logit_softcapping", None) if gemma else None,
        attn_scale=float(scalar if scalar else head_dim) ** -0.5,
        layer_windows=layer_windows(config),
        layer_rope=tuple(t if per_type_rope else "default" for t in types[:layers]),
        head_dim=head_dim,
        rotary_dim=int(head_dim * partial),
        moe=arch in MOE,
    )


def default_max_len(config) -> int:
    """max_model_len when none is set: max_position_embeddings, or longrope's pretraining length (past it the
    rotary frequencies change, which we refuse: models.rope.check_length)."""
    settings = rope_settings(config, (getattr(config, "layer_types", None) or ["full_attention"])[0])
    if (settings.get("rope_type") or settings.get("type")) == "longrope":
        return min(int(settings["original_max_position_embeddings"]), int(config.max_position_embeddings))
    return int(config.max_position_embeddings)
