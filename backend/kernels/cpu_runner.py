"""Run a kernel source on the CPU: g++ with the CUDA shim, cached by content, launched via ctypes."""

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

from loraplex.kernels.instances import FAMILIES
from loraplex.kernels.sources import CHECKOUT, KERNEL_DIR, SHIM_HEADER

CXX_FLAGS = ("-O2", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fno-strict-aliasing")
_ERR_BYTES = 512


def cache_dir() -> Path:
    """Where built CPU kernel libraries go: $LORAPLEX_KERNEL_CACHE, else <checkout>/.cache/kernels_cpu
    in a source checkout, else ~/.cache/loraplex/kernels_cpu."""
    env = os.environ.get("LORAPLEX_KERNEL_CACHE")
    if env:
        return Path(env)
    if (CHECKOUT / "pyproject.toml").exists():
        return CHECKOUT / ".cache" / "kernels_cpu"
    return Path.home() / ".cache" / "loraplex" / "kernels_cpu"


def glue_source(source: Path, names: tuple[str, ...]) -> str:
    """C++ that includes a .cu source and exports one C entry point per name expression."""
    lines = [f'#include "{source.name}"']
    lines += [f"LP_CPU_ENTRY(lp_entry_{i}, {name})" for i, name in enumerate(names)]
    return "\n".join(lines) + "\n"


def build_once(stem: str, key_parts: list[str], command, compiler: str, source_name: str) -> Path:
    """The library <stem>-<hash of key_parts>.so in the kernel cache, built once: command(tmp, out) is the compile
    command (it may write what it needs into the temporary folder tmp); the library is moved into place whole,
    so a concurrent builder never loads a half-written one."""
    key = hashlib.sha256("\0".join(key_parts).encode()).hexdigest()[:16]
    target = cache_dir() / f"{stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run(command(Path(tmp), out), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed for {source_name}:\n{proc.stderr[-2000:]}")
        os.replace(out, target)
    return target


def build_source(source: Path, names: tuple[str, ...], tag: str | None = None) -> Path:
    """Build (or reuse) the shared library of source with names; keyed by a hash of all inputs."""
    source = Path(source).resolve()
    cxx = os.environ.get("CXX", "g++")
    glue = glue_source(source, names)
    include_dirs = (str(source.parent), str(KERNEL_DIR))
    texts = [SHIM_HEADER.read_text(), *(p.read_text() for p in _local_files(source)), glue]

    def command(tmp: Path, out: Path) -> list[str]:
        glue_path = tmp / f"{source.stem}_glue.cpp"
        glue_path.write_text(glue)
        return [cxx, *CXX_FLAGS, "-include", str(SHIM_HEADER), *(f"-I{d}" for d in include_dirs), str(glue_path),
                "-o", str(out)]

    return build_once(tag or source.stem, [cxx, *CXX_FLAGS, *include_dirs, *texts], command, cxx, source.name)


def _local_files(source: Path) -> list[Path]:
    """source and the local headers beside it or in the kernel folder (conservative cache key)."""
    headers = sorted(set(source.parent.glob("*.h")) | set(KERNEL_DIR.glob("*.h")))
    return [source, *headers]


class CpuLibrary:
    """A built kernel library: launch an instantiation by its name expression."""

    def __init__(self, path: Path, names: tuple[str, ...]):
        self._lib = ctypes.CDLL(str(path))
        self._entries = {}
        for i, name in enumerate(names):
            fn = getattr(self._lib, f"lp_entry_{i}")
            fn.argtypes = [
                ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_int
            ]
            fn.restype = ctypes.c_int
            self._entries[name] = fn

    def launch(self, name: str, grid, block, args) -> None:
        """Run name over grid x block with args (tensors, np.int32/int64/float32); raise on error."""
        fn = self._entries[name]
        dims = (ctypes.c_uint * 6)(*_dim3(grid), *_dim3(block))
        values = [_c_value(a) for a in args]
        params = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        err = ctypes.create_string_buffer(_ERR_BYTES)
        if fn(dims, params, err, _ERR_BYTES) != 0:
            raise RuntimeError(f"{name}: {err.value.decode(errors='replace')}")


@functools.lru_cache(maxsize=None)
def family_library(family: str) -> CpuLibrary:
    """The CPU library of one kernel family (built on first use)."""
    fam = FAMILIES[family]
    return CpuLibrary(build_source(KERNEL_DIR / fam.source, fam.names, tag=family), fam.names)


class CpuRunner:
    """Launches kernel families on the CPU through the shim (tests, debugging)."""

    def sm_count(self, device: torch.device) -> int:
        """Parallel units, for launch heuristics."""
        return os.cpu_count() or 1

    def launch(self, family: str, name: str, grid, block, args) -> None:
        """Run name from family over grid x block with args."""
        family_library(family).launch(name, grid, block, args)


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


def _dim3(d) -> tuple[int, int, int]:
    return (tuple(d) + (1, 1, 1))[:3]
