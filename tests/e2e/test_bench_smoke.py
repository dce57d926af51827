"""benchmarks/serving.py --quick end to end: real loraplex-serve processes under real AIPerf load.

Checks the results' shape only (every configuration, the requests asked for, no errors,
positive throughput), never timings. Skipped where AIPerf is not installed (`make bench`
installs it into .cache/aiperf-venv).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from scripts import BENCHMARKS, load_benchmark

serving = load_benchmark("serving")


@pytest.mark.skipif(not serving.DEFAULT_AIPERF.exists(),
                    reason=f"aiperf is not installed at {serving.DEFAULT_AIPERF} (`make bench` installs it)")
def test_quick_run_measures_every_configuration(tmp_path):
    out = tmp_path / "serving.json"
    subprocess.run([sys.executable, str(BENCHMARKS / "serving.py"), "--quick", "--json", str(out),
                    "--artifacts", str(tmp_path / "artifacts")], check=True, timeout=600)
    report = json.loads(out.read_text())
    assert [r["config"] for r in report["results"]] == serving.QUICK_CONFIGS.split(",")
    for result in report["results"]:
        assert result["request_count"] == serving.QUICK_WORKLOAD.requests
        assert result["errors"] == 0
        assert result["output_tokens"] == result["output_tokens_asked"] > 0
        assert result["output_tokens_per_s"] > 0 and result["requests_per_s"] > 0
