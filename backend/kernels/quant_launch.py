"""Launchers of the quantized linear layers (quant_linear.cu); same signatures as the reference.

Which kernel serves a call (impl="auto"): up to GEMV_MAX_ROWS rows of x (decode) the GEMV; more rows the
tensor-core GEMM (float16 / bfloat16 activations); from DEQUANT_MIN_ROWS rows, or float32 activations, W is
dequantized into a scratch in x's dtype (at most DEQUANT_CHUNK_BYTES at a time) and torch's GEMM (cuBLAS) runs
on it. With LORAPLEX_FP8_SCALED_MM=1, FP8 calls the GEMV does not serve go through torch._scaled_mm where it
serves them (scaled_mm_serves): activations quantized per row to e4m3 (W8A8), not exact against the
dequantized weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from loraplex.kernels import quant_args
from loraplex.kernels.instances import QUANT_GEMV_ROWS, QUANT_SCALE_TYPES, quant_format, quant_name
from loraplex.kernels.launch_args import aligned, ceil_div
from loraplex.kernels.runners import runner_for

# Must match the constants in quant_linear.cu (checked by tests).
GEMV_THREADS = 128
GEMV_ROWS = 8  # rows of W per GEMV block (kGemvRows)
TILE_M, TILE_N, TILE_K = 64, 64, 32
GEMM_THREADS = 128
DEQUANT_THREADS = 256

GEMV_MAX_ROWS = 8  # rows of x the GEMV serves in auto (decode); more take the GEMM
DEQUANT_MIN_ROWS = 512  # rows of x from which auto dequantizes W and runs torch's GEMM
DEQUANT_CHUNK_BYTES = 256 << 20  # the dequantized scratch at most (rows of W at a time)
MIN_SPLIT_INPUTS = 1024  # inputs per split-K slice, at least
MAX_SPLITS = 16
WAVES = 2  # split K until the grid has this many blocks per multiprocessor
IMPLS = ("auto", "gemv", "gemm", "dequant", "scaled_mm")
SCALED_MM_ENV = "LORAPLEX_FP8_SCALED_MM"
SCALED_MM_CAPABILITY = (8, 9)  # e4m3 tensor cores (Ada, Hopper)


def read_scaled_mm() -> bool:
    """LORAPLEX_FP8_SCALED_MM: 1 sends FP8 prefill GEMMs through torch._scaled_mm (default 0)."""
    value = os.environ.get(SCALED_MM_ENV) or "0"
    if value not in ("0", "1"):
        raise ValueError(f"{SCALED_MM_ENV}={value!r} is not 0 or 1")
    return value == "1"


SCALED_MM = read_scaled_mm()


@dataclass(frozen=True, slots=True)
class Weights:
    """A quantized W [n, k] as the kernels take it: the bytes, scales (and zeros), three layout ints."""

    kind: str  # C++ format (instances.quant_format)
    data: torch.Tensor  # uint8 [n, row_bytes]
    scales: torch.Tensor
    zeros: torch.Tensor  # uint8; the data again for FP8 (never read)
    params: tuple[int, int, int]  # Fp8: rows, inputs, cols per scale; Int4: group, groups, 0
    per_byte: int  # elements per byte
    run: int  # inputs that share one scale along k

    @property
    def n(self) -> int:
        return self.data.shape[0]

    def args(self) -> list:
        return [self.data, self.scales, self.zeros, np.int64(self.data.shape[1]), *map(np.int32, self.params)]


def fp8_linear(x, weight, scale, block=None, bias=None, *, runner=None, impl="auto", splits=None):
    """x [..., K] @ W.T + bias with W from FP8 weights (reference.fp8_linear). impl: auto (module docstring),
    gemv, gemm, dequant or scaled_mm; splits: split-K slices of the GEMV / GEMM (None: choose_splits)."""
    layout = quant_args.fp8_layout(x, weight, scale, block, bias)
    _check_impl(impl)
    x2 = x.reshape(-1, x.shape[-1])
    if impl == "scaled_mm" or (impl == "auto" and SCALED_MM and x2.shape[0] > GEMV_MAX_ROWS
                               and scaled_mm_serves(x2, weight, block)):
        return fp8_scaled_mm(x2, weight, scale, bias).reshape(*x.shape[:-1], weight.shape[0])
    w = Weights(quant_format("fp8"), weight.view(torch.uint8).contiguous(), scale.float().contiguous(),
                weight.view(torch.uint8), tuple(layout), 1, layout.inputs)
    return _linear(x, w, bias, runner, impl, splits)


def w4a16_linear(x, qweight, scales, zeros, group_size, bias=None, *, runner=None, impl="auto", splits=None):
    """x [..., K] @ W.T + bias with W from INT4 weights (reference.w4a16_linear). impl: auto, gemv, gemm or
    dequant; splits as in fp8_linear."""
    groups = quant_args.check_w4a16(x, qweight, scales, zeros, group_size, bias)
    _check_impl(impl)
    if impl == "scaled_mm":
        raise ValueError("w4a16_linear: impl scaled_mm serves FP8 weights only")
    if (x.dtype, scales.dtype) not in QUANT_SCALE_TYPES:
        scales = scales.float()  # exact; instantiated for every activation dtype
    w = Weights(quant_format("int4", scales.dtype), qweight.contiguous(), scales.contiguous(), zeros.contiguous(),
                (int(group_size), groups, 0), 2, int(group_size))
    return _linear(x, w, bias, runner, impl, splits)


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl {impl!r} is not one of {', '.join(IMPLS)}")


def choose_impl(rows: int, dtype: torch.dtype) -> str:
    """The kernel auto picks for rows of x in dtype: gemv, gemm or dequant."""
    if rows <= GEMV_MAX_ROWS:
        return "gemv"
    if dtype == torch.float32 or rows >= DEQUANT_MIN_ROWS:
        return "dequant"
    return "gemm"


def choose_splits(blocks: int, k: int, sm_count: int) -> int:
    """Split-K slices: 1 unless the grid of blocks fills under WAVES blocks per multiprocessor and K holds two
    slices of MIN_SPLIT_INPUTS; then enough to reach it, at most MAX_SPLITS."""
    most = k // MIN_SPLIT_INPUTS
    if blocks >= WAVES * sm_count or most < 2:
        return 1
    return max(1, min(most, MAX_SPLITS, ceil_div(WAVES * sm_count, max(blocks, 1))))


def _linear(x, w: Weights, bias, runner, impl, splits):
    k, n = x.shape[-1], w.n
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    bias32 = None if bias is None else bias.float().contiguous()
    if m == 0 or n == 0 or k == 0:
        y = torch.zeros(m, n, dtype=torch.float32, device=x.device) + (0 if bias32 is None else bias32)
        return y.to(x.dtype).reshape(*x.shape[:-1], n)
    runner = runner or runner_for(x)
    impl = choose_impl(m, x.dtype) if impl == "auto" else impl
    if impl == "gemm" and x.dtype == torch.float32:
        raise ValueError("the quantized GEMM takes float16 or bfloat16 activations (float32: gemv or dequant)")
    if impl == "dequant":
        y = _dequant_matmul(x2, w, bias32, runner)
    else:
        y = (_gemv if impl == "gemv" else _gemm)(x2, w, bias32, runner, splits)
    return y.reshape(*x.shape[:-1], n)


def _bias_args(bias32, x):
    return [x if bias32 is None else bias32, np.int32(bias32 is not None)]


def _finish(out, partial, bias32, dtype):
    """The kernel's output, or the split-K partial sums added in order, the bias, rounded once to dtype."""
    if partial is None:
        return out
    y = partial.sum(0)
    if bias32 is not None:
        y += bias32
    return y.to(dtype)


def _split_plan(k: int, splits: int, unit: int) -> tuple[int, int]:
    """(inputs per slice, a multiple of unit; slices)."""
    chunk = ceil_div(ceil_div(k, max(splits, 1)), unit) * unit
    return chunk, ceil_div(k, chunk)


def _outputs(m, n, splits, dtype, device):
    out = torch.empty(m, n, dtype=dtype, device=device)
    partial = torch.empty(splits, m, n, dtype=torch.float32, device=device) if splits > 1 else None
    return out, partial


def run_shift(run: int, k: int) -> int | None:
    """log2 of the inputs sharing one scale along k as the vectorized loads index them (31 when one run covers
    K); None when it is not a power of two (the byte-by-byte path serves)."""
    if run >= k:
        return 31
    return run.bit_length() - 1 if run & (run - 1) == 0 else None


def vectorized(x2, w: Weights, per_load: int) -> tuple[bool, int]:
    """(whether loads of per_load inputs serve: rows of whole loads, aligned, each load within one scale, runs
    a power of two or all of K; the run shift)."""
    k = x2.shape[1]
    shift = run_shift(w.run, k)
    ok = shift is not None and k % per_load == 0 and (w.run % per_load == 0 or w.run >= k) and aligned(x2, w.data)
    return ok, shift if ok else 0


def _gemv(x2, w: Weights, bias32, runner, splits):
    m, k = x2.shape
    rows = QUANT_GEMV_ROWS[0] if m == 1 else QUANT_GEMV_ROWS[-1]
    per_load = 16 * w.per_byte
    vec, shift = vectorized(x2, w, per_load)
    blocks = ceil_div(w.n, GEMV_ROWS) * ceil_div(m, rows)
    if splits is None:
        splits = choose_splits(blocks, k, runner.sm_count(x2.device))
    split_k, splits = _split_plan(k, splits, 32 * per_load if vec else 64)
    out, partial = _outputs(m, w.n, splits, x2.dtype, x2.device)
    args = [out, partial if partial is not None else out, x2, *_bias_args(bias32, x2), *w.args(), np.int32(m),
            np.int32(w.n), np.int32(k), np.int32(split_k), np.int32(vec), np.int32(shift)]
    grid = (ceil_div(w.n, GEMV_ROWS), ceil_div(m, rows), splits)
    runner.launch("quant", quant_name("quant_gemv", x2.dtype, w.kind, rows), grid, (GEMV_THREADS, 1, 1), args)
    return _finish(out, partial, bias32, x2.dtype)


def _gemm(x2, w: Weights, bias32, runner, splits):
    m, k = x2.shape
    blocks = ceil_div(w.n, TILE_N) * ceil_div(m, TILE_M)
    if splits is None:
        splits = choose_splits(blocks, k, runner.sm_count(x2.device))
    split_k, splits = _split_plan(k, splits, TILE_K)
    vec, shift = vectorized(x2, w, TILE_K // 2)
    out, partial = _outputs(m, w.n, splits, x2.dtype, x2.device)
    args = [out, partial if partial is not None else out, x2, *_bias_args(bias32, x2), *w.args(), np.int32(m),
            np.int32(w.n), np.int32(k), np.int32(split_k), np.int32(vec), np.int32(shift)]
    grid = (ceil_div(w.n, TILE_N), ceil_div(m, TILE_M), splits)
    runner.launch("quant", quant_name("quant_gemm", x2.dtype, w.kind), grid, (GEMM_THREADS, 1, 1), args)
    return _finish(out, partial, bias32, x2.dtype)


def dequantize(w: Weights, dtype: torch.dtype, k: int, first: int = 0, count: int | None = None, *, runner=None):
    """Rows [first, first + count) of W dequantized into dtype [count, k] (each weight as the kernels round it)."""
    count = w.n - first if count is None else count
    dst = torch.empty(count, k, dtype=dtype, device=w.data.device)
    if count and k:
        args = [dst, *w.args(), np.int32(first), np.int32(k)]
        (runner or runner_for(dst)).launch("quant", quant_name("quant_dequant", dtype, w.kind),
                                           (count, ceil_div(k, DEQUANT_THREADS), 1), (DEQUANT_THREADS, 1, 1), args)
    return dst


def _dequant_matmul(x2, w: Weights, bias32, runner):
    m, k = x2.shape
    step = max(1, DEQUANT_CHUNK_BYTES // (k * x2.element_size()))
    if step >= w.n:
        y = F.linear(x2, dequantize(w, x2.dtype, k, runner=runner))
    else:
        y = torch.empty(m, w.n, dtype=x2.dtype, device=x2.device)
        for first in range(0, w.n, step):
            count = min(step, w.n - first)
            y[:, first:first + count] = F.linear(x2, dequantize(w, x2.dtype, k, first, count, runner=runner))
    return y if bias32 is None else (y.float() + bias32).to(x2.dtype)


def scaled_mm_serves(x2, weight, block) -> bool:
    """Whether torch._scaled_mm serves an FP8 call on x2's device: CUDA compute capability 8.9+, per-tensor or
    per-channel scales, float16/bfloat16 activations, K and N multiples of 16."""
    if not x2.is_cuda or block is not None or x2.dtype not in (torch.float16, torch.bfloat16):
        return False
    n, k = weight.shape
    return torch.cuda.get_device_capability(x2.device) >= SCALED_MM_CAPABILITY and k % 16 == 0 and n % 16 == 0


def fp8_scaled_mm(x2, weight, scale, bias=None):
    """x2 [M, K] @ W.T + bias through torch._scaled_mm: each row of x2 quantized to e4m3 with its own scale
    (max |x| / 448), per-channel weight scales (a per-tensor one expanded), bfloat16 out; then x2's dtype."""
    n = weight.shape[0]
    xf = x2.float()
    x_scale = (xf.abs().amax(dim=1, keepdim=True) / quant_args.FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    xq = (xf / x_scale).clamp(-quant_args.FP8_MAX, quant_args.FP8_MAX).to(torch.float8_e4m3fn)
    w_scale = scale.float().reshape(1, -1).expand(1, n).contiguous()
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16)
    if bias is not None:
        y = (y.float() + bias.float()).to(torch.bfloat16)
    return y.to(x2.dtype)
