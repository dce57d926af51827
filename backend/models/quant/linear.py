"""Running a linear layer whose weight may be quantized: y = x @ W.T + b for a plain tensor (F.linear), a canonical
form (its kernel, or the torch reference), a fused group of forms that do not concatenate, or a packed CPU layer.

The references compute x @ dequantize(W).T + b in fp32 and return x's dtype: what the kernels' references compute
(README.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplex import kernels
from loraplex.models.quant.forms import FORMS, Fp8Weight, Int4Weight, Int8Weight, can_cat, cat, dequantize


@dataclass(frozen=True, slots=True)
class Parts:
    """Projections fused by their callers (q/k/v, gate/up) whose quantized forms do not concatenate: each runs
    alone and the outputs are concatenated."""

    parts: tuple

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]


@dataclass(frozen=True, slots=True)
class Packed:
    """A CPU linear layer packed for quant.packed_linear where kernels.linear_pack has no packing for it: a
    form (run by its kernel or reference), Parts, or an fp32 tensor without the native GEMM."""

    weight: object
    bias: torch.Tensor | None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]


def reference_linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequantize(w).T + bias, in fp32, returned in x's dtype."""
    y = F.linear(x.float(), dequantize(w).to(x.device), None if bias is None else bias.float())
    return y.to(x.dtype)


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T + bias for a plain weight, a canonical form or Parts."""
    if isinstance(w, torch.Tensor):
        return F.linear(x, w, bias)
    if isinstance(w, Parts):
        sizes = [p.shape[0] for p in w.parts]
        biases = [None] * len(sizes) if bias is None else bias.split(sizes)
        return torch.cat([linear(x, p, b) for p, b in zip(w.parts, biases)], dim=-1)
    if isinstance(w, Fp8Weight):  # the kernel where the device runs one, else (dispatch) the torch reference
        return kernels.fp8_linear(x, w.weight, w.scale, w.block, bias)
    if isinstance(w, Int4Weight):
        xs = x if w.perm is None else x.index_select(-1, w.perm)
        return kernels.w4a16_linear(xs, w.qweight, w.scales, w.zeros, w.group_size, bias)
    return reference_linear(x, w, bias)


def fuse(weights: list):
    """Projections that read one input as one weight: a concatenated tensor or form, else Parts."""
    if all(isinstance(w, torch.Tensor) for w in weights):
        return torch.cat(weights)
    if all(isinstance(w, FORMS) for w in weights) and can_cat(weights):
        return cat(weights)
    return Parts(tuple(weights))


def pack(weight, bias: torch.Tensor | None = None, panels: bool = True):
    """A CPU fp32 model's linear layer for packed_linear: int8 forms through kernels.linear_pack_int8 (the native
    int8 GEMM where built); plain tensors as fp32 panels where panels (the native GEMM); anything else Packed."""
    if isinstance(weight, Int8Weight):
        return kernels.linear_pack_int8(weight.qweight, weight.scale, bias)
    if isinstance(weight, torch.Tensor) and panels:
        return kernels.linear_pack(weight, bias, half=False)
    return Packed(weight, bias)


def packed_linear(x: torch.Tensor, packed, out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T + b in fp32 for a layer from pack (or kernels.linear_pack): into out when given."""
    if not isinstance(packed, Packed):
        return kernels.packed_linear(x, packed, out)
    y = linear(x, packed.weight, packed.bias)
    if out is None:
        return y
    out.copy_(y)
    return out
