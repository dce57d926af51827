"""Every kernel source compiles with NVRTC for sm_80 and sm_90, every instantiation included."""

from __future__ import annotations

import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from loraplex.kernels import nvrtc_check
from loraplex.kernels.instances import FAMILIES
from loraplex.kernels.sources import expanded_source

SELFTEST = Path(__file__).with_name("shim_selftest.cu")
SELFTEST_NAMES = (
    "reverse_in_block", "shuffles", "atomics", "indices", "math",
    "convert<float>", "convert<__half>", "convert<__nv_bfloat16>",
)
CASES = list(itertools.product(FAMILIES, nvrtc_check.ARCHS))


@pytest.fixture(scope="module")
def results():
    """NVRTC results of every (family, arch), compiled in parallel (NVRTC releases the GIL)."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        done = pool.map(lambda case: nvrtc_check.compile_family(*case), CASES)
        return dict(zip(CASES, done))


@pytest.mark.parametrize("family,arch", CASES, ids=[f"{f}-{a}" for f, a in CASES])
def test_family_compiles_without_warnings(results, family, arch):
    result = results[(family, arch)]
    assert result.ok, f"NVRTC failed for {family} on {arch}:\n{result.log}"
    assert "warning" not in result.log, result.log
    assert set(result.lowered) == set(FAMILIES[family].names)
    assert all(name.startswith("_Z") for name in result.lowered.values())


def test_broken_source_fails_with_log():
    result = nvrtc_check.compile_source("__global__ void k(int* p) { p[0] = undefined_name; }", (), "sm_80")
    assert not result.ok
    assert "undefined_name" in result.log


def test_expanded_source_inlines_headers_once():
    text = expanded_source("paged_attention_decode.cu")
    assert '#include "dtypes.h"' not in text
    assert text.count("struct alignas(2) __half") == 1
    assert '#line 1 "dtypes.h"' in text


def test_shim_selftest_kernels_are_valid_cuda():
    src = SELFTEST.read_text().replace('#include "dtypes.h"', expanded_source("dtypes.h"))
    result = nvrtc_check.compile_source(src, SELFTEST_NAMES + ("divergent_barrier", "partial_mask"), "sm_80")
    assert result.ok, result.log
