"""The native ops under the served threading (OMP_WAIT_POLICY=PASSIVE, threads from usable_cpus, a core
taken by a spinner): the same bits at any thread count, equal to the reference (decision 056)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loraplex.kernels import cpu_native

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
import loraplex.kernels as kernels
from kernel_cases import assert_close, randn
from loraplex.kernels import cpu_native
from loraplex.launch.cpus import usable_cpus
gen = torch.Generator().manual_seed(3)
n, k = 4 * cpu_native.library().lp_gemm_panel_width() + 3, 576
weight, bias = randn(n, k, dtype=torch.float32, gen=gen), randn(n, dtype=torch.float32, gen=gen)
packed = kernels.linear_pack(weight, bias, half=True)
outs = []
for threads in sorted({1, 2, usable_cpus()}):
    cpu_native.set_threads(threads)
    for rows in (1, 7, 48):
        x = randn(rows, k, dtype=torch.float32, gen=torch.Generator().manual_seed(rows))
        got = kernels.packed_linear(x, packed)
        assert_close(got, torch.addmm(bias.double(), x.double(), weight.half().double().T).float(), torch.float32)
        outs.append((threads, rows, got))
for t, rows, got in outs:
    same = [g for t2, r2, g in outs if r2 == rows]
    assert all(torch.equal(got, g) for g in same), (t, rows)
print("OK", len(outs))
"""


def test_native_gemm_is_exact_and_thread_count_invariant_with_passive_waits_beside_a_spinner():
    if cpu_native.library() is None or not cpu_native.panels_native():
        pytest.skip("no native GEMM on this CPU")
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        out = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT / "tests" / "support")], env=env,
                             capture_output=True, text=True, timeout=300)
    finally:
        spinner.kill()
        spinner.wait()
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().startswith("OK")
