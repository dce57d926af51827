"""benchmarks/structured_outputs.py at a tiny size on the demo model: it runs, and its figures have their shape."""

from __future__ import annotations

import json
import subprocess
import sys

from scripts import BENCHMARKS


def test_the_benchmark_runs_and_reports_both_runs_and_the_compiles(demo, tmp_path):
    out = tmp_path / "so.json"
    run = subprocess.run([sys.executable, str(BENCHMARKS / "structured_outputs.py"), "--model-dir", str(demo["model"]),
                          "--streams", "4", "--max-tokens", "8", "--repeats", "1", "--compiles", "1",
                          "--threads", "1", "--json", str(out)], check=True, timeout=300, stdout=subprocess.PIPE,
                         text=True)
    report = json.loads(out.read_text())
    assert set(report["runs"]) == {"free", "mixed"} and report["ratio"] > 0
    assert report["best"]["mixed"]["mask_ms_per_step"] > 0 == report["best"]["free"]["mask_ms_per_step"]
    assert report["best"]["mixed"]["match_cpu_ms_per_step"] > 0 == report["best"]["free"]["match_cpu_ms_per_step"]
    assert report["compile"]["samples"] == 4 and "x of free" in run.stdout
