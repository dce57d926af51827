"""What the .cu kernels can serve: per-op preconditions taken from the sources and launchers.

Each op has rules; a rule returns None when the kernel serves the shapes, else (what does
not fit, what the kernel needs). ``reason`` turns the first failing rule into the one log
line of that op; ``decisions`` answers for every op at once (model start-up).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from loraplex.kernels.instances import C_TYPES, HEAD_DIMS

PREFILL = "paged_attention_prefill"
DECODE = "paged_attention_decode"
QUANT = "quant"  # fp8_linear, w4a16_linear: called only for quantized weights, so not in OPS (check_model)
OPS = ("lora", "write_kv", "copy_blocks", DECODE, PREFILL)
MMA_CAPABILITY = (8, 0)  # quant_linear.cu's GEMM: mma.sync m16n8k16 in float16 and bfloat16
BF16_CAPABILITY = (8, 0)  # dtypes.h converts to bfloat16 with cvt.rn.bf16.f32 (PTX, sm_80+)
COPY_UNIT_BYTES = 2  # cache_ops.cu moves rows in units of 2, 4 or 16 bytes


class KernelShapes(NamedTuple):
    """What the preconditions look at: element type, heads, and the CUDA device's compute capability."""

    dtype: torch.dtype
    head_dim: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    capability: tuple[int, int] | None = None  # None: the CPU shim (no architecture limits)


def _either(values) -> str:
    """'a, b or c'."""
    words = [str(v) for v in values]
    return ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else words[0]


def _dtype(s: KernelShapes):
    if s.dtype not in C_TYPES:
        return f"dtype {str(s.dtype).removeprefix('torch.')}", _either(str(d).removeprefix("torch.") for d in C_TYPES)
    if s.dtype == torch.bfloat16 and s.capability is not None and tuple(s.capability) < BF16_CAPABILITY:
        major, minor = s.capability
        return f"bfloat16 on compute capability {major}.{minor}", "compute capability 8.0 or newer"
    return None


def _mma(s: KernelShapes):
    if s.capability is None or tuple(s.capability) >= MMA_CAPABILITY:
        return None
    major, minor = s.capability
    return f"compute capability {major}.{minor}", "compute capability 8.0 or newer"


def _head_dim(s: KernelShapes):
    return None if s.head_dim in HEAD_DIMS else (f"head_dim {s.head_dim}", _either(HEAD_DIMS))


def _grouping(s: KernelShapes):
    if s.num_kv_heads > 0 and s.num_heads % s.num_kv_heads == 0:
        return None
    return f"{s.num_heads} query heads over {s.num_kv_heads} KV heads", "a whole number of query heads per KV head"


def _copy_rows(s: KernelShapes):
    row = s.num_kv_heads * s.head_dim * s.dtype.itemsize
    return None if row % COPY_UNIT_BYTES == 0 else (f"KV rows of {row} bytes", f"a multiple of {COPY_UNIT_BYTES} bytes")


# Head dims in HEAD_DIMS give rows of a multiple of 16 bytes in every dtype of C_TYPES, so
# the decode kernel's 16-byte loads (DecodeLayout's static_assert) need no rule of their own.
RULES = {
    "lora": (_dtype,),
    "write_kv": (_copy_rows,),
    "copy_blocks": (_copy_rows,),
    DECODE: (_dtype, _head_dim, _grouping),
    PREFILL: (_dtype, _head_dim, _grouping),
    QUANT: (_dtype, _mma),
}


@functools.lru_cache(maxsize=None)
def reason(op: str, shapes: KernelShapes) -> str | None:
    """Why op's kernel cannot serve shapes (its log line), or None when it can."""
    for rule in RULES[op]:
        failed = rule(shapes)
        if failed:
            value, needs = failed
            return f"{op}: {value} is not supported by the CUDA kernel (needs {needs}); using the torch path"
    return None


def decisions(shapes: KernelShapes, ops=OPS) -> dict[str, str | None]:
    """Per op: None when its kernel serves shapes, else why not."""
    return {op: reason(op, shapes) for op in ops}
