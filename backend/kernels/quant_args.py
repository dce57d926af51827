"""The quantized linear layers' arguments: checked (ValueError naming the argument) and their scale layouts as the
kernels index them. Only shapes and dtypes are read, never values (no host sync: calls may be captured in a graph).

FP8 (`fp8_linear`): weight float8_e4m3fn [N, K]; scale (any float dtype) [1] per tensor or [N] / [N, 1] per output
channel when block is None, else [ceil(N / bn), ceil(K / bk)] with block (bn, bk);
W[n, k] = float(weight[n, k]) * scale[n // bn, k // bk].

INT4 W4A16 (`w4a16_linear`): qweight uint8 [N, ceil(K / 2)], q[n, k] in byte k // 2, the low nibble for even k
(an odd K leaves the last high nibble unused); scales (float16, bfloat16 or float32) [N, ceil(K / G)]; zeros uint8
[N, ceil(K / G)] (0..15; GPTQ's symmetric zero is 8); G = group_size >= 1 (G >= K: one group per row);
W[n, k] = (q[n, k] - zeros[n, k // G]) * scales[n, k // G]. K is x's last dimension.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class Fp8Layout(NamedTuple):
    """How a kernel finds W[n, k]'s scale: scale[(n // rows) * cols + k // inputs] of the flat fp32 scale."""

    rows: int  # output rows sharing one scale
    inputs: int  # inputs sharing one scale
    cols: int  # scales per row of the scale grid


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_x(x: torch.Tensor, in_features: int, what: str) -> None:
    if x.dtype not in FLOATS:
        raise ValueError(f"{what}: x must be float32, float16 or bfloat16, not {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != in_features:
        raise ValueError(f"{what}: x's last dimension {tuple(x.shape)[-1:]} is not the weight's {in_features} inputs")


def _check_bias(bias, out_features: int, what: str) -> None:
    if bias is None:
        return
    if bias.dtype not in FLOATS or tuple(bias.shape) != (out_features,):
        raise ValueError(f"{what}: bias must be a float tensor [{out_features}], not {bias.dtype} "
                         f"{list(bias.shape)}")


def _positive_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{what} must be a positive whole number, not {value!r}")
    return int(value)


def fp8_layout(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block=None, bias=None) -> Fp8Layout:
    """fp8_linear's arguments checked; the scale layout of weight [N, K]."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"fp8_linear: weight must be float8_e4m3fn [N, K], not {weight.dtype} {list(weight.shape)}")
    n, k = weight.shape
    _check_x(x, k, "fp8_linear")
    _check_bias(bias, n, "fp8_linear")
    if not scale.is_floating_point() or scale.dtype.itemsize == 1:
        raise ValueError(f"fp8_linear: scale must be a float16/bfloat16/float32 tensor, not {scale.dtype}")
    shape = tuple(scale.shape)
    if block is None:
        if scale.numel() == 1:
            return Fp8Layout(max(n, 1), max(k, 1), 1)
        if shape in ((n,), (n, 1)):
            return Fp8Layout(1, max(k, 1), 1)
        raise ValueError(f"fp8_linear: scale {list(shape)} of weight [{n}, {k}] without a block: needs [1] per "
                         f"tensor or [{n}] per output channel")
    if len(block) != 2:
        raise ValueError(f"fp8_linear: block must be (rows, inputs), not {block!r}")
    bn, bk = (_positive_int(b, "fp8_linear: block") for b in block)
    want = (ceil_div(n, bn), ceil_div(k, bk))
    if shape != want:
        raise ValueError(f"fp8_linear: block scale {list(shape)} of weight [{n}, {k}] in blocks [{bn}, {bk}]: "
                         f"needs {list(want)}")
    return Fp8Layout(bn, bk, want[1])


def check_w4a16(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size,
                bias=None) -> int:
    """w4a16_linear's arguments checked; the number of groups per row, ceil(K / G)."""
    k = x.shape[-1] if x.dim() else 0
    group = _positive_int(group_size, "w4a16_linear: group_size")
    groups = ceil_div(k, group)
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] != ceil_div(k, 2):
        raise ValueError(f"w4a16_linear: qweight must be uint8 [N, {ceil_div(k, 2)}] (two 4-bit values a byte for "
                         f"x's {k} inputs), not {qweight.dtype} {list(qweight.shape)}")
    n = qweight.shape[0]
    _check_x(x, k, "w4a16_linear")
    _check_bias(bias, n, "w4a16_linear")
    if scales.dtype not in FLOATS or tuple(scales.shape) != (n, groups):
        raise ValueError(f"w4a16_linear: scales must be float16/bfloat16/float32 [{n}, {groups}] (groups of "
                         f"{group}), not {scales.dtype} {list(scales.shape)}")
    if zeros.dtype != torch.uint8 or tuple(zeros.shape) != (n, groups):
        raise ValueError(f"w4a16_linear: zeros must be uint8 [{n}, {groups}] (groups of {group}), not "
                         f"{zeros.dtype} {list(zeros.shape)}")
    return groups
