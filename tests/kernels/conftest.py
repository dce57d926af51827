"""Fixtures of the kernel tests: the CPU-shim runner with every family built once."""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from loraplex.kernels import cpu_runner
from loraplex.kernels.instances import FAMILIES

sys.path.insert(0, str(Path(__file__).parent))  # kernel_cases, under any pytest import mode


@pytest.fixture(scope="session")
def cpu():
    """A CpuRunner whose kernel libraries are built (in parallel) before the first test uses it."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(cpu_runner.family_library, FAMILIES))
    return cpu_runner.CpuRunner()
