"""Rotary position embeddings (default, linear and llama3 scaling), HF rotate-half layout, over all or the
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
    raise ValueError(f"rope scaling type {kind!r} is not supported (default, linear, llama3)")


class RotaryEmbedding:
    """Precomputed cos and signed sin tables [max_len, rotary_dim], which kernels.rotate_qk applies to q and k."""

    def __init__(self, settings: dict, head_dim: int, max_len: int, device, dtype):
        inv = inv_frequencies(settings, head_dim).to(device)
        freqs = torch.outer(torch.arange(max_len, device=device, dtype=torch.float32), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        half = head_dim // 2
        # rotate_half(x) * sin == roll(x, half) * sin with its first half negated: one op for the rotation
        self.signed_sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
