"""Run a kernel family's own .cu source on the CPU: g++ with the CUDA shim, cached, ctypes."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from .instances import FAMILIES
from .sources import KERNEL_DIR, SHIM_HEADER, expanded_source

CXX_FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fno-strict-aliasing")
_ERR_BYTES = 512


def cache_dir() -> Path:
    """Folder for built CPU kernel libraries ($LORAPLEX_KERNEL_CACHE or .cache/kernels_cpu)."""
    env = os.environ.get("LORAPLEX_KERNEL_CACHE")
    return Path(env) if env else KERNEL_DIR.parent / ".cache" / "kernels_cpu"


def glue_source(family: str) -> str:
    """C++ that includes the family's .cu and exports one C entry point per instantiation."""
    fam = FAMILIES[family]
    lines = [f'#include "{fam.source}"']
    lines += [f"LP_CPU_ENTRY(lp_entry_{i}, {name})" for i, name in enumerate(fam.names)]
    return "\n".join(lines) + "\n"


def build(family: str) -> Path:
    """Build (or reuse) the shared library of a family; keyed by a hash of all its inputs."""
    fam = FAMILIES[family]
    cxx = os.environ.get("CXX", "g++")
    glue = glue_source(family)
    key = hashlib.sha256(
        "\0".join([cxx, *CXX_FLAGS, SHIM_HEADER.read_text(), expanded_source(fam.source), glue]).encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"{family}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        glue_path = Path(tmp) / f"{family}_glue.cpp"
        glue_path.write_text(glue)
        out = Path(tmp) / target.name
        cmd = [cxx, *CXX_FLAGS, "-include", str(SHIM_HEADER), f"-I{KERNEL_DIR}", str(glue_path), "-o", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"g++ failed for kernel family {family}:\n{proc.stderr}")
        os.replace(out, target)
    return target


@functools.lru_cache(maxsize=None)
def _library(family: str) -> tuple[ctypes.CDLL, dict[str, object]]:
    lib = ctypes.CDLL(str(build(family)))
    entries = {}
    for i, name in enumerate(FAMILIES[family].names):
        fn = getattr(lib, f"lp_entry_{i}")
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_int]
        fn.restype = ctypes.c_int
        entries[name] = fn
    return lib, entries


def _c_value(arg):
    if isinstance(arg, torch.Tensor):
        if arg.device.type != "cpu":
            raise ValueError("the CPU runner takes CPU tensors only")
        return ctypes.c_void_p(arg.data_ptr())
    if isinstance(arg, np.int32):
        return ctypes.c_int32(int(arg))
    if isinstance(arg, np.int64):
        return ctypes.c_int64(int(arg))
    if isinstance(arg, np.float32):
        return ctypes.c_float(float(arg))
    raise TypeError(f"unsupported kernel argument {type(arg).__name__}")


class CpuRunner:
    """Launches kernels on the CPU through the shim (tests, debugging)."""

    def sm_count(self, device: torch.device) -> int:
        """Parallel units, for launch heuristics."""
        return os.cpu_count() or 1

    def launch(self, family: str, name: str, grid, block, args) -> None:
        """Run name from family over grid x block with args (tensors, np.int32/int64/float32)."""
        fn = _library(family)[1][name]
        dims = (ctypes.c_uint * 6)(*_dim3(grid), *_dim3(block))
        values = [_c_value(a) for a in args]
        params = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        err = ctypes.create_string_buffer(_ERR_BYTES)
        if fn(dims, params, err, _ERR_BYTES) != 0:
            raise RuntimeError(f"{name}: {err.value.decode(errors='replace')}")


def _dim3(d) -> tuple[int, int, int]:
    d = tuple(d)
    return (d + (1, 1, 1))[:3]
