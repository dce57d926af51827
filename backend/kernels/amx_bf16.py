"""The prefill GEMM on AMX-BF16 tiles (`amx_bf16.c`; decision 074) over the native GEMM's fp32 or fp16 panels: fp32
in and out, x and W each split into bf16 parts whose products sum in fp32 (two parts: 16 significant bits of each,
an fp16 weight whole; one part: plain bf16).

Built once per machine with the C compiler (as cpu_native), called through ctypes. Where the compiler or the CPU
has no AMX-BF16, or Linux does not grant the tile state, ``available()`` is False and nothing here is called.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
from pathlib import Path

import torch

from loraplex.kernels.cpu_native import _machine
from loraplex.kernels.cpu_runner import build_once

log = logging.getLogger("loraplex.kernels")
SOURCE = Path(__file__).with_name("amx_bf16.c")
C_FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=gnu11", "-shared", "-fPIC")
_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
SIGNATURES = {
    "lp_bf16_amx": ([], _C),
    "lp_bf16_gemm": ([_P, _I, _P, _C, _I, _P, _P, _I, _I, _I, _I, _C, _C], _C),
}


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded library, or None (logged once) when it cannot be built here."""
    cc = os.environ.get("CC", "cc")
    try:
        if shutil.which(cc) is None:
            raise RuntimeError(f"no C compiler ({cc!r} is not on PATH; set CC)")
        path = build_once("amx_bf16", [cc, *C_FLAGS, SOURCE.read_text(), _machine()],
                          lambda _tmp, out: [cc, *C_FLAGS, str(SOURCE), "-o", str(out)], cc, SOURCE.name)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError) as exc:
        log.warning("the AMX-BF16 prefill GEMM is unavailable: %s", exc)
        return None
    for name, (args, result) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return lib


def available() -> bool:
    """Whether the tiles run here: the library built with AMX-BF16 and Linux granting this process the tile state."""
    lib = library()
    return lib is not None and lib.lp_bf16_amx() == 1


def serves(packed) -> bool:
    """Whether packed (a cpu_native.Panels) is one the tiles read: fp32 or fp16 panels of a width they divide."""
    return (packed.kind in (torch.float32, torch.float16) and packed.panels.dim() == 3
            and packed.panels.shape[2] % 32 == 0)


def linear(x: torch.Tensor, packed, parts: int, threads: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 @ W.T + bias -> [M, N] fp32 on the tiles, W the fp32 or fp16 panels of packed (a
    cpu_native.Panels that serves() takes), x and W each in parts bf16 parts (1 or 2); into `out` (fp32 [M, N],
    rows contiguous) when given."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    if out is None:
        out = torch.empty((m, packed.out_features), dtype=torch.float32)
    bias = None if packed.bias is None else packed.bias.data_ptr()
    rc = library().lp_bf16_gemm(x.data_ptr(), x.stride(0), packed.panels.data_ptr(), int(packed.half),
                                packed.panels.shape[2], bias, out.data_ptr(), out.stride(0), m, packed.out_features, k,
                                parts, threads)
    if rc != 0:
        raise RuntimeError("the AMX-BF16 GEMM could not run (tiles not granted, parts not 1 or 2, or no memory)")
    return out
