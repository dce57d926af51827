"""Rotary position embeddings (default, linear, llama3 and longrope scaling), HF rotate-half layout, over all or the
first ``rotary_dim`` dimensions of a head (partial rotary)."""

from __future__ import annotations

import math

import torch


def inv_frequencies(settings: dict, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] for one layer's rope settings (models.family.rope_settings)."""
    theta = float(settings.get("rope_theta", 10000.0))
    kind = settings.get("rope_type", settings.get("type", "default")) or "default"
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # as HF
    if kind == "default":
        return inv.float()
    if kind == "linear":
        return (inv / settings["factor"]).float()
    if kind == "llama3":
        factor, low, high = settings["factor"], settings["low_freq_factor"], settings["high_freq_factor"]
        old_len = settings["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled).float()
    if kind == "longrope":  # Phi-3/4: per-frequency factors; the short ones within the pretraining length
        factors = torch.tensor(settings["short_factor"], dtype=torch.float32)
        if factors.shape != inv.shape:
            raise ValueError(f"longrope short_factor has {factors.numel()} entries, the rotary dims need {inv.numel()}")
        return 1.0 / (factors * theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    raise ValueError(f"rope scaling type {kind!r} is not supported (default, linear, llama3, longrope)")


def attention_scaling(settings: dict, max_position_embeddings: int) -> float:
    """The factor HF multiplies cos and sin by: longrope's attention_factor (given, or from the length ratio), else 1."""
    if (settings.get("rope_type") or settings.get("type")) != "longrope":
        return 1.0
    if settings.get("attention_factor") is not None:
        return float(settings["attention_factor"])
    original = settings["original_max_position_embeddings"]
    factor = settings.get("factor") or max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def check_length(settings: dict, max_len: int) -> None:
    """Refuse lengths whose rotary frequencies we do not serve: longrope past its pretraining length (transformers
    switches every position to the long factors once a sequence passes it, which a cache cannot follow)."""
    if (settings.get("rope_type") or settings.get("type")) == "longrope":
        original = int(settings["original_max_position_embeddings"])
        if max_len > original:
            raise ValueError(f"longrope past its original_max_position_embeddings ({original}) is not served; "
                             f"set max_model_len <= {original} (ENGINE_CONFIG '{{\"max_model_len\": {original}}}')")


class RotaryEmbedding:
    """Precomputed cos and signed sin tables [max_len, rotary_dim], which kernels.rotate_qk applies to q and k."""

    def __init__(self, settings: dict, head_dim: int, max_len: int, device, dtype, scaling: float = 1.0):
        check_length(settings, max_len)
        inv = inv_frequencies(settings, head_dim).to(device)
        freqs = torch.outer(torch.arange(max_len, device=device, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, sin = (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)
        half = head_dim // 2
        # rotate_half(x) * sin == roll(x, half) * sin with its first half negated: one op for the rotation
        self.signed_sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
