"""Quantizing a full-precision weight W [N, K] at load into a canonical form (the `quantization` knob: int8, fp8,
int4). Deterministic: the same weight always gives the same form (DoRA's norms quantize a re-read weight again)."""

from __future__ import annotations

import torch

from loraplex.models.quant.forms import FP8_MAX, Fp8Weight, Int4Weight, Int8Weight, pack_int4

INT4_GROUP_SIZE = 128


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Per output channel, symmetric: scale = max|w| / 127 (1 for an all-zero row), q = round(w / scale)."""
    w = w.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q, scale)


def quantize_fp8(w: torch.Tensor) -> Fp8Weight:
    """Per output channel: scale = max|w| / 448 (1 for an all-zero row), weight = e4m3(w / scale)."""
    w = w.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Fp8Weight(q, scale)


def int4_group_size(k: int, group_size: int = INT4_GROUP_SIZE) -> int:
    """The group size int4 quantizes K inputs with: group_size, else the largest of 64 and 32 that divides K, else
    K (one group per row); ValueError for an odd K (two values a byte)."""
    if k % 2:
        raise ValueError(f"int4 packs two inputs a byte: an input size of {k} is odd")
    return next((g for g in (group_size, 64, 32) if g <= group_size and k % g == 0), k)


def quantize_int4(w: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> Int4Weight:
    """Groups of int4_group_size(K) inputs, asymmetric: scale = (max - min) / 15 rounded to fp16 (max, min over the
    group and 0), zero = round(-min / scale) in 0..15, q = clamp(round(w / scale) + zero, 0, 15)."""
    n, k = w.shape
    g = int4_group_size(k, group_size)
    groups = w.float().view(n, k // g, g)
    hi = groups.amax(dim=-1).clamp(min=0)
    lo = groups.amin(dim=-1).clamp(max=0)
    scales = ((hi - lo) / 15.0).half()
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero group: any scale
    s = scales.float()
    zeros = torch.round(-lo / s).clamp_(0, 15)
    q = (torch.round(groups / s[..., None]) + zeros[..., None]).clamp_(0, 15)
    return Int4Weight(pack_int4(q.view(n, k)), scales, zeros.to(torch.uint8), g)


QUANTIZERS = {"int8": quantize_int8, "fp8": quantize_fp8, "int4": quantize_int4}


def quantize(w: torch.Tensor, method: str):
    """W in the canonical form of method (int8, fp8 or int4)."""
    return QUANTIZERS[method](w)
