"""Kernel source files and their text with local headers inlined."""

from __future__ import annotations

import functools
import re
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
CHECKOUT = PACKAGE_DIR.parents[1]  # backend/kernels -> the source checkout, when this is one


def _kernel_dir() -> Path:
    """The CUDA sources (.cu, .h): <checkout>/kernels in a source checkout, the wheel's loraplex/kernels/cuda."""
    checkout = CHECKOUT / "kernels"
    return checkout if (CHECKOUT / "pyproject.toml").is_file() and checkout.is_dir() else PACKAGE_DIR / "cuda"


KERNEL_DIR = _kernel_dir()
SHIM_HEADER = PACKAGE_DIR / "cpu_shim" / "cuda_cpu_shim.h"

_LOCAL_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.M)


@functools.lru_cache(maxsize=None)
def expanded_source(filename: str) -> str:
    """Text of a kernel source with its local #include "..." headers inlined (once each)."""
    return _expand(KERNEL_DIR / filename, set())


def _expand(path: Path, seen: set[Path]) -> str:
    seen.add(path)
    text = path.read_text()
    parts, pos = [], 0
    for match in _LOCAL_INCLUDE.finditer(text):
        header = (path.parent / match.group(1)).resolve()
        parts.append(text[pos : match.start()])
        if header not in seen:
            line = text.count("\n", 0, match.end()) + 2
            parts.append(f'#line 1 "{header.name}"\n{_expand(header, seen)}\n#line {line} "{path.name}"')
        pos = match.end()
    parts.append(text[pos:])
    return "".join(parts)

