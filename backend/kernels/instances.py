"""The template instantiations of every kernel family: the launchers pick from these lists."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

C_TYPES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
VEC_WIDTH = {"float": 4, "__half": 8, "__nv_bfloat16": 8}  # elements per 16-byte load
HEAD_DIMS = (32, 64, 128, 256)
QUERIES_PER_BLOCK = (1, 2, 4, 8)
COPY_UNITS = {2: "unsigned short", 4: "unsigned int", 16: "lp_u128"}
INDEX_TYPES = {torch.int32: "int", torch.int64: "long long"}
QUANT_GEMV_ROWS = (1, 8)  # rows of x per GEMV block: 1, or up to 8 (fewer skip their work)
# (activation dtype, INT4 scale dtype) pairs instantiated; other scale dtypes are read as float32
QUANT_SCALE_TYPES = tuple((dt, s) for dt in (torch.float16, torch.bfloat16) for s in C_TYPES) + (
    (torch.float32, torch.float32),)
BGMV_TILES = (4, 1)  # tokens per block of the BGMV kernels: 4 the default; gpu_kernels.py measures 1 beside it


@dataclass(frozen=True, slots=True)
class Family:
    """One .cu source and the name expressions instantiated from it."""

    name: str
    source: str
    names: tuple[str, ...]


def c_type(dtype: torch.dtype) -> str:
    """C++ element type of a torch floating dtype."""
    try:
        return C_TYPES[dtype]
    except KeyError:
        raise TypeError(f"unsupported kernel dtype {dtype}") from None


def lora_name(kernel: str, dtype: torch.dtype, vec: int, tile: int | None = None) -> str:
    """Name expression of a LoRA kernel (shrink_bgmv, shrink_sgmv, expand_bgmv, expand_sgmv, the fused
    *_bgmv_group, the split-K shrink_bgmv_split); the BGMV kernels (group ones too) also take their tile
    (tokens per block, one of BGMV_TILES)."""
    return f"{kernel}<{c_type(dtype)}, {vec}{'' if tile is None else f', {tile}'}>"


def decode_name(dtype: torch.dtype, head_dim: int, queries_per_block: int) -> str:
    """Name expression of the paged decode kernel."""
    return f"paged_decode<{c_type(dtype)}, {head_dim}, {queries_per_block}>"


def decode_reduce_name(dtype: torch.dtype, head_dim: int) -> str:
    """Name expression of the split-merge kernel of paged decode."""
    return f"paged_decode_reduce<{c_type(dtype)}, {head_dim}>"


def prefill_name(dtype: torch.dtype, head_dim: int) -> str:
    """Name expression of the tiled paged prefill kernel."""
    return f"paged_prefill<{c_type(dtype)}, {head_dim}>"


def cache_name(kernel: str, unit_bytes: int, index_dtype: torch.dtype) -> str:
    """Name expression of write_kv / copy_blocks moving units of unit_bytes."""
    return f"{kernel}<{COPY_UNITS[unit_bytes]}, {INDEX_TYPES[index_dtype]}>"


def quant_format(method: str, scale_dtype: torch.dtype | None = None) -> str:
    """C++ weight format of quant_linear.cu: Fp8Weights, or Int4Weights<scale type>."""
    return "Fp8Weights" if method == "fp8" else f"Int4Weights<{c_type(scale_dtype)}>"


def quant_name(kernel: str, dtype: torch.dtype, fmt: str, rows: int | None = None) -> str:
    """Name expression of a quantized-linear kernel (quant_gemv with its rows of x per block, quant_gemm,
    quant_dequant) for activations of dtype and the weight format fmt (quant_format)."""
    return f"{kernel}<{c_type(dtype)}, {fmt}{'' if rows is None else f', {rows}'}>"


def _lora() -> tuple[str, ...]:
    kernels = ("shrink_bgmv", "shrink_sgmv", "expand_bgmv", "expand_sgmv", "shrink_bgmv_group", "expand_bgmv_group",
               "shrink_bgmv_split")
    return tuple(
        lora_name(k, dt, vec, tile)
        for k, dt in itertools.product(kernels, C_TYPES)
        for vec in (1, VEC_WIDTH[C_TYPES[dt]])
        for tile in (BGMV_TILES if k.endswith(("bgmv", "group")) else (None,))
    )


def _decode() -> tuple[str, ...]:
    main = [decode_name(dt, d, g) for dt, d, g in itertools.product(C_TYPES, HEAD_DIMS, QUERIES_PER_BLOCK)]
    return tuple(main + [decode_reduce_name(dt, d) for dt, d in itertools.product(C_TYPES, HEAD_DIMS)])


def _prefill() -> tuple[str, ...]:
    return tuple(prefill_name(dt, d) for dt, d in itertools.product(C_TYPES, HEAD_DIMS))


def _quant() -> tuple[str, ...]:
    fp8 = [(dt, quant_format("fp8")) for dt in C_TYPES]
    int4 = [(dt, quant_format("int4", s)) for dt, s in QUANT_SCALE_TYPES]
    names = [quant_name("quant_gemv", dt, fmt, rows) for dt, fmt in fp8 + int4 for rows in QUANT_GEMV_ROWS]
    names += [quant_name("quant_gemm", dt, fmt) for dt, fmt in fp8 + int4 if dt != torch.float32]
    return tuple(names + [quant_name("quant_dequant", dt, fmt) for dt, fmt in fp8 + int4])


def _cache() -> tuple[str, ...]:
    return tuple(
        cache_name(k, u, ix)
        for k, u, ix in itertools.product(("write_kv", "copy_blocks"), COPY_UNITS, INDEX_TYPES)
    )


FAMILIES = {
    f.name: f
    for f in (
        Family("lora", "lora.cu", _lora()),
        Family("decode", "paged_attention_decode.cu", _decode()),
        Family("prefill", "paged_attention_prefill.cu", _prefill()),
        Family("cache", "cache_ops.cu", _cache()),
        Family("quant", "quant_linear.cu", _quant()),
    )
}
