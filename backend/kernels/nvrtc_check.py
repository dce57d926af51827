"""Compile kernel sources with NVRTC alone (no GPU, no driver): the CI compile check."""

from __future__ import annotations

import ctypes
import functools
import re
from dataclasses import dataclass
from pathlib import Path

from loraplex.kernels.cuda_runner import NVRTC_OPTIONS
from loraplex.kernels.instances import FAMILIES
from loraplex.kernels.sources import expanded_source

ARCHS = ("sm_80", "sm_90")
_LIB = re.compile(r"^libnvrtc\.so\.(\d+)$")


@dataclass(frozen=True, slots=True)
class CompileResult:
    """Outcome of one NVRTC compilation."""

    ok: bool
    log: str
    lowered: dict[str, str]


def wheel_nvrtc_libraries() -> list[Path]:
    """libnvrtc.so.<major> files shipped by installed nvidia-* pip wheels, newest first."""
    try:
        import nvidia
    except ImportError:
        return []
    found = []
    for root in getattr(nvidia, "__path__", []):
        for path in Path(root).glob("**/lib/libnvrtc.so.*"):
            match = _LIB.match(path.name)
            if match:
                found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found, reverse=True)]


@functools.lru_cache(maxsize=None)
def load_nvrtc():
    """CuPy's NVRTC binding, with the wheel's libnvrtc preloaded so CuPy can find it."""
    for path in wheel_nvrtc_libraries():
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    from cupy_backends.cuda.libs import nvrtc

    nvrtc.getVersion()  # raises here if no libnvrtc can be loaded
    return nvrtc


def compile_source(source: str, names: tuple[str, ...], arch: str, filename: str = "kernel.cu") -> CompileResult:
    """Compile source for arch (e.g. sm_90) to a cubin, instantiating every name expression."""
    nvrtc = load_nvrtc()
    prog = nvrtc.createProgram(source, filename, [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *NVRTC_OPTIONS])
        except nvrtc.NVRTCError as err:
            return CompileResult(False, f"{err}\n{nvrtc.getProgramLog(prog)}", {})
        lowered = {name: nvrtc.getLoweredName(prog, name) for name in names}
        nvrtc.getCUBIN(prog)
        return CompileResult(True, nvrtc.getProgramLog(prog), lowered)
    finally:
        nvrtc.destroyProgram(prog)


def compile_family(family: str, arch: str) -> CompileResult:
    """Compile one kernel family's source with all its instantiations for arch."""
    fam = FAMILIES[family]
    return compile_source(expanded_source(fam.source), fam.names, arch, fam.source)
