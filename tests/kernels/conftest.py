"""Fixtures of the kernel tests: the CPU-shim runner with every family built once."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from loraplex.kernels import cpu_runner
from loraplex.kernels.instances import FAMILIES


@pytest.fixture(scope="session")
def cpu():
    """A CpuRunner whose kernel libraries are built (in parallel) before the first test uses it."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(cpu_runner.family_library, FAMILIES))
    return cpu_runner.CpuRunner()
