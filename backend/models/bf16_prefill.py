"""The CPU prefill's projections on AMX-BF16 tiles (``prefill_dtype``; decision 074): a step's prompt rows, when it
has at least MIN_ROWS of them, multiply the packed fp32/fp16 panels through kernels.bf16_linear, op by op, x and W
each split into bf16 parts (bf16x3: two, three products, 16 significant bits of each; bfloat16: one). Every other
row, and every decode step, keeps the packed GEMM (the step's other rows in the same op-by-op forward, a decode step
in the one-call decode forward)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex import kernels

# A step runs its prompt rows on the tiles from this many on: below it a step with decodes beside its prompt is
# faster in the one-call decode forward, all on the packed GEMM (decision 074).
MIN_ROWS = 128
PARTS = {"float32": 0, "bf16x3": 2, "bfloat16": 1}  # prefill_dtype -> bf16 parts of x and W (0: the packed GEMM)


def tiles_available() -> bool:
    """Whether kernels.bf16_linear runs here (AMX-BF16 in this CPU and compiler, the tiles granted by Linux)."""
    return kernels.bf16_tiles()


def parts(mode: str, device, dtype: torch.dtype, packed: list[dict] | None) -> int:
    """bf16 parts of a model's prefill GEMMs under prefill_dtype ``mode`` (0: the packed GEMM, float32's); ValueError
    naming what is missing where bf16x3 or bfloat16 cannot run: a CPU fp32 engine, AMX-BF16 tiles, the native
    fp32/fp16 panels."""
    if mode not in PARTS:
        raise ValueError(f"prefill_dtype must be one of {', '.join(PARTS)}, not {mode!r}")
    if not PARTS[mode]:
        return 0
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        raise ValueError(f"prefill_dtype {mode} is a CPU option with dtype float32 (on CUDA, dtype sets the GEMMs')")
    if not tiles_available():
        raise ValueError(f"prefill_dtype {mode} needs AMX-BF16 tiles, which this CPU (or its compiler or kernel) "
                         "does not give; set prefill_dtype float32")
    if packed is None or not all(kernels.bf16_tiles(p) for layer in packed for p in layer.values()):
        raise ValueError(f"prefill_dtype {mode} needs the native packed GEMM's fp32 or fp16 panels "
                         "(LORAPLEX_KERNELS=auto, a C compiler, weights not quantized)")
    return PARTS[mode]


@dataclass(frozen=True, slots=True)
class PrefillRows:
    """A step's rows that run on the tiles (a slice where they are one run, else int64 indices) and the others
    (int64 indices; None when every row is a prompt row)."""

    tiles: slice | torch.Tensor
    packed: torch.Tensor | None


def prefill_rows(prompt_rows: torch.Tensor | None) -> PrefillRows | None:
    """The rows of a step whose projections run on the tiles, from its prompt-row mask (bool [T]; None: a decode
    step), or None when it has fewer than MIN_ROWS prompt rows."""
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


def linear(x: torch.Tensor, packed, num_parts: int, rows: PrefillRows) -> torch.Tensor:
    """x @ W.T + b [T, N] fp32: rows.tiles on the tiles in num_parts parts, rows.packed through the packed GEMM."""
    if rows.packed is None:
        return kernels.bf16_linear(x, packed, num_parts)
    y = x.new_empty(x.shape[0], packed.out_features)
    if isinstance(rows.tiles, slice):
        kernels.bf16_linear(x[rows.tiles], packed, num_parts, out=y[rows.tiles])
    else:
        y.index_copy_(0, rows.tiles, kernels.bf16_linear(x.index_select(0, rows.tiles), packed, num_parts))
    y.index_copy_(0, rows.packed, kernels.packed_linear(x.index_select(0, rows.packed), packed))
    return y
