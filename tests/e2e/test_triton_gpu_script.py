"""benchmarks/triton_gpu.py (the GPU session's Triton stage, decision 058) on the CPU at a tiny size: the real
loraplex-serve exact against peft over generate_stream, a concurrency run with every token back, the ratio."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_triton_stage_script_runs_exact_on_the_cpu(tmp_path):
    out = tmp_path / "triton_gpu.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "triton_gpu.py"), "--device", "cpu", "--hidden", "128",
         "--intermediate", "344", "--layers", "2", "--heads", "4", "--requests", "12", "--max-tokens", "8",
         "--check-tokens", "6", "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["exact"] == {"matched": 24, "requests": 24}
    assert report["served"]["failed"] == 0 and report["served"]["tokens"] == 12 * 8
    assert report["in_process"]["tokens"] == 12 * 8 and report["served_over_in_process"] > 0
