"""What continuous batching buys: the same workload under `batching=continuous` and `static`.

    python benchmarks/batching.py [--model-dir DIR] [--requests 64] [--max-num-seqs 16] [--threads 1]

Requests with mixed output lengths (greedy, ignore_eos) all arrive at once; the engine is
stepped on this thread. Static batching admits only into an empty batch and keeps a
batch's shape until its longest request ends (ended rows are padding), so short requests
wait for the longest one of their batch. Printed per mode: steps, wall time,
generated tokens/s, and request latency (time to the final token) mean / p50 / p90; the
ratios are measured in this one run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.request import SamplingParams


def workload(n: int, seed: int = 0) -> list[tuple[str, int]]:
    """(prompt, max_tokens) pairs: short and long outputs mixed, as chat traffic is."""
    rng = random.Random(seed)
    return [(f"request {i}: " + "x" * rng.randint(8, 64), rng.choice([8, 16, 32, 64, 128])) for i in range(n)]


def run(model_dir: str, mode: str, jobs, max_num_seqs: int) -> dict:
    """Serve the whole workload once; returns the figures."""
    engine = LLMEngine(EngineConfig(model_dir=model_dir, batching=mode, max_num_seqs=max_num_seqs,
                                    enable_prefix_caching=False))
    start = time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(jobs):
        params = SamplingParams.from_dict({"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        engine.add_request(engine.make_request(str(i), prompt, params))
    done, tokens = {}, 0
    while engine.has_work():
        for out in engine.step():
            tokens += len(out.token_ids)
            if out.finished:
                done[out.request_id] = time.perf_counter() - start
    wall = time.perf_counter() - start
    latency = sorted(done.values())
    return {"mode": mode, "steps": engine.num_steps, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "mean_s": statistics.mean(latency), "p50_s": latency[len(latency) // 2],
            "p90_s": latency[int(len(latency) * 0.9)]}


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=None, help="LLaMA-family checkpoint (default: the offline demo model)")
    ap.add_argument("--requests", type=int, default=64, help="requests in the workload (default 64)")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="batch size cap (default 16)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    model_dir = args.model_dir
    if model_dir is None:
        from loraplex.models.builtin.demo import build_demo

        model_dir = str(build_demo()["model"])
    jobs = workload(args.requests)
    print(f"model {model_dir}; {len(jobs)} requests, max_tokens in {{8..128}}, max_num_seqs {args.max_num_seqs}")
    rows = [run(model_dir, mode, jobs, args.max_num_seqs) for mode in ("static", "continuous")]
    print(f"{'mode':<12}{'steps':>7}{'wall s':>9}{'tok/s':>9}{'mean s':>9}{'p50 s':>8}{'p90 s':>8}")
    for r in rows:
        print(f"{r['mode']:<12}{r['steps']:>7}{r['wall_s']:>9.2f}{r['tok_s']:>9.0f}{r['mean_s']:>9.2f}"
              f"{r['p50_s']:>8.2f}{r['p90_s']:>8.2f}")
    static, cont = rows
    print(f"continuous vs static: {cont['tok_s'] / static['tok_s']:.2f}x tokens/s, "
          f"{static['steps'] / cont['steps']:.2f}x fewer steps, mean latency {static['mean_s'] / cont['mean_s']:.2f}x lower")
    return 0


if __name__ == "__main__":
    sys.exit(main())
