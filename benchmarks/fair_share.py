"""Microbenchmark: scheduler cost per step with fair share off / VTC, for 1, 10 and 1000 tenants.

    python benchmarks/fair_share.py [--seqs 256] [--waiting 4096] [--steps 300] [--tenants 1,10,1000] [--repeats 3]

No model: the real Scheduler and KVCacheManager with a stand-in runner that samples one
token per row. The waiting queue is kept at ``--waiting`` requests spread round-robin over
the tenants (short requests, so every step admits some), ``--seqs`` run at once. Each row
prints the mean CPU time of schedule() + update() per step (the best of ``--repeats``
runs: other processes on a small machine add noise, never remove it) and the admissions per
step; the ``limit 2`` rows give every tenant max_concurrent_requests = 2 (with 1 or 10
tenants that caps the running batch at 2 or 20 sequences; with 1000, most are blocked).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from loraplex.config import EngineConfig
from loraplex.kv_cache import KVCacheManager, namespace_key
from loraplex.worker.model_runner import RunnerOutput
from loraplex.engine.request import Request, SamplingParams, Sequence
from loraplex.sched.scheduler import Scheduler
from loraplex.tenancy.tenants import Tenant


def bench(fair_share: str, tenants: int, seqs: int, waiting: int, steps: int, limit: int = 0) -> tuple[float, float]:
    """Mean ms per step (schedule + update) and admissions per step."""
    config = EngineConfig(block_size=16, max_num_seqs=seqs, max_num_batched_tokens=8192, fair_share=fair_share)
    kv = KVCacheManager(16 * seqs + 64, 16, enable_prefix_caching=False)
    sched = Scheduler(config, kv, None, {2}, 100_000)
    ids, names = itertools.count(), itertools.cycle([f"tenant-{i}" for i in range(tenants)])
    limits = {}

    def add() -> None:
        n = next(ids)
        name = next(names)
        if name not in limits:
            limits[name] = Tenant(name, b"", max_concurrent_requests=limit)
        params = SamplingParams(max_tokens=8 + n % 25, ignore_eos=True)
        prompt = [3 + (n + i) % 90 for i in range(16)]
        req = Request(f"r{n}", "", prompt, params, name, limits=limits[name] if limit else None)
        seq = Sequence(n, req, 0, list(prompt), len(prompt))
        seq.namespace = namespace_key(name, None)
        sched.add(seq)

    for _ in range(waiting):
        add()
    spent, admitted = 0.0, 0
    for step in range(steps + 20):
        while len(sched.waiting) < waiting:
            add()
        t = time.process_time()  # this process's CPU time: time other processes take the core is not counted
        batch = sched.schedule()
        rows = len(batch.seqs) + len(batch.forks)
        result = RunnerOutput([5] * rows, [-1.0] * rows, [None] * rows)
        sched.update(batch, result)
        if step >= 20:  # warm up first
            spent += time.process_time() - t
            admitted += len(batch.admitted)
    return 1e3 * spent / steps, admitted / steps


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=256, help="max_num_seqs (default 256)")
    ap.add_argument("--waiting", type=int, default=4096, help="requests kept waiting (default 4096)")
    ap.add_argument("--steps", type=int, default=300, help="steps timed (default 300)")
    ap.add_argument("--tenants", default="1,10,1000", help="tenant counts (default 1,10,1000)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per row, the best reported (default 3)")
    args = ap.parse_args(argv)
    print(f"{args.seqs} running, {args.waiting} waiting, {args.steps} steps; schedule() + update() per step")
    print(f"  {'tenants':>8}  {'fair_share':<10} {'ms/step':>8} {'admitted/step':>14}")
    for tenants in (int(t) for t in args.tenants.split(",")):
        for fair_share, limit in (("off", 0), ("vtc", 0), ("off", 2), ("vtc", 2)):
            label = fair_share + (f" limit {limit}" if limit else "")
            ms, admitted = min(bench(fair_share, tenants, args.seqs, args.waiting, args.steps, limit)
                               for _ in range(args.repeats))
            print(f"  {tenants:>8}  {label:<10} {ms:>8.3f} {admitted:>14.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
