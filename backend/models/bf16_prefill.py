"""The CPU prefill's projections in bf16 (``prefill_dtype``; decision 074): a step's prompt rows, when it has at
least MIN_ROWS of them, multiply a bf16 copy of each packed projection through oneDNN (AMX tiles where the CPU
has them, kernels.bf16_linear), op by op; every other row, and every decode step, keeps the packed fp32/fp16 GEMM
(the step's other rows in the same op-by-op forward, a decode step in the one-call decode forward)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from loraplex import kernels
from loraplex.kernels import cpu_native

# A step runs its prompt rows in bf16 from this many on: below it a step with decodes beside its prompt is faster in
# the one-call decode forward, all in fp32 (decision 074).
MIN_ROWS = 128
MODES = ("float32", "bfloat16")


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_bf16_units() -> str | None:
    """The bf16 matrix units torch's oneDNN would use here: "amx" (AMX-BF16 tiles), "avx512_bf16", or None."""
    if not torch.backends.mkldnn.is_available():
        return None
    flags = _cpu_flags()
    if {"amx_bf16", "amx_tile"} <= flags or (not flags and torch.cpu._is_amx_tile_supported()):
        return "amx"
    if "avx512_bf16" in flags or (not flags and torch.cpu._is_avx512_bf16_supported()):
        return "avx512_bf16"
    return None


def _bf16_kind(packed) -> bool:
    """Whether a packed projection is one whose stored values a bf16 copy can take (fp32 or fp16 panels)."""
    return isinstance(packed, cpu_native.Panels) and packed.kind in (torch.float32, torch.float16)


def enabled(mode: str, device, dtype: torch.dtype, packed: list[dict] | None) -> bool:
    """Whether a model's prefill projections run in bf16 under prefill_dtype ``mode``: bfloat16 on a CPU with bf16
    units, an fp32 engine and the native fp32/fp16 panels (else ValueError naming what is missing), float32 never."""
    if mode not in MODES:
        raise ValueError(f"prefill_dtype must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "float32":
        return False
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        raise ValueError("prefill_dtype bfloat16 is a CPU option with dtype float32 (on CUDA, dtype sets the GEMMs')")
    if cpu_bf16_units() is None:
        raise ValueError("prefill_dtype bfloat16: this CPU has no bf16 units (AMX-BF16 or AVX-512 BF16) that torch's "
                         "oneDNN can use; set prefill_dtype float32")
    if packed is None or not all(_bf16_kind(p) for layer in packed for p in layer.values()):
        raise ValueError("prefill_dtype bfloat16 needs the native packed GEMM's fp32 or fp16 panels "
                         "(LORAPLEX_KERNELS=auto, a C compiler, weights not quantized)")
    return True


def _unpacked(p: cpu_native.Panels) -> torch.Tensor:
    """The weight [N, K] a panel packing holds, in fp32 (panels are [N / NB, K, NB])."""
    num, k, width = p.panels.shape
    return p.panels.float().transpose(1, 2).reshape(num * width, k)[: p.out_features]


def bf16_copies(packed: list[dict]) -> list[dict]:
    """Per layer: packed name -> (its weight's stored values rounded to bf16 [N, K], its fp32 bias or None)."""
    return [{name: (_unpacked(p).to(torch.bfloat16).contiguous(),
                    None if p.bias is None else p.bias[: p.out_features].clone())
             for name, p in layer.items()} for layer in packed]


@dataclass(frozen=True, slots=True)
class PrefillRows:
    """A step's rows that run in bf16 (a slice where they are one run, else int64 indices) and the others
    (int64 indices; None when every row is a prompt row)."""

    bf16: slice | torch.Tensor
    fp32: torch.Tensor | None


def prefill_rows(prompt_rows: torch.Tensor | None) -> PrefillRows | None:
    """The rows of a step whose projections run in bf16, from its prompt-row mask (bool [T]; None: a decode step),
    or None when it has fewer than MIN_ROWS prompt rows."""
    if prompt_rows is None:
        return None
    rows = prompt_rows.nonzero().squeeze(1)
    n = len(rows)
    if n < MIN_ROWS:
        return None
    if n == len(prompt_rows):
        return PrefillRows(slice(None), None)
    first, last = int(rows[0]), int(rows[-1])
    run = slice(first, last + 1) if last - first + 1 == n else rows
    return PrefillRows(run, (~prompt_rows).nonzero().squeeze(1))


def linear(x: torch.Tensor, packed, copy: tuple, rows: PrefillRows) -> torch.Tensor:
    """x @ W.T + b [T, N] fp32: rows.bf16 through the bf16 copy, rows.fp32 through the packed GEMM."""
    weight, bias = copy
    if rows.fp32 is None:
        return kernels.bf16_linear(x, weight, bias)
    y = x.new_empty(x.shape[0], packed.out_features)
    if isinstance(rows.bf16, slice):
        kernels.bf16_linear(x[rows.bf16], weight, bias, out=y[rows.bf16])
    else:
        y.index_copy_(0, rows.bf16, kernels.bf16_linear(x.index_select(0, rows.bf16), weight, bias))
    y.index_copy_(0, rows.fp32, kernels.packed_linear(x.index_select(0, rows.fp32), packed))
    return y
