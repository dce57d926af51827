"""Microbenchmark: KV allocator operations per second, and scheduler time per step at N running sequences.

    python benchmarks/scheduler_micro.py [--model-dir DIR] [--seqs 256] [--steps 40] [--threads 1]

Part 1 times KVCacheManager operations alone (no model). Part 2 runs the real engine
(the demo model unless --model-dir) with N sequences decoding at once and splits each
step into the scheduler's share (schedule + update, which includes incremental
detokenization and stop checks) and the model runner's (tensors, forward, sampling),
so the scheduler's cost is reported as a share of the model's step time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from loraplex.kv_cache import KVCacheManager, namespace_key

NS = namespace_key("bench", None)


def _report(label: str, n: int, seconds: float) -> None:
    print(f"  {label:<44}{n / seconds:>12,.0f} /s   ({1e6 * seconds / n:7.2f} us each)")


def bench_allocator(num_blocks: int = 65_536, block_size: int = 16, prompt_len: int = 512, rounds: int = 2_000) -> None:
    """Print operations per second of the allocator's hot paths."""
    kv = KVCacheManager(num_blocks, block_size)
    prompt = list(range(prompt_len))
    print(f"allocator: {num_blocks} blocks of {block_size} tokens; prompts of {prompt_len} tokens "
          f"({prompt_len // block_size} blocks)")

    t = time.perf_counter()
    for i in range(rounds):  # miss: new prompt (namespace differs each time), allocate all, free
        kv.allocate(i, 0, prompt_len)
        kv.free(i)
    _report(f"allocate {prompt_len} tokens + free (miss)", rounds, time.perf_counter() - t)

    kv.allocate("warm", 0, prompt_len)
    kv.cache_full_blocks("warm", prompt, prompt_len, NS)
    t = time.perf_counter()
    for _ in range(rounds):
        kv.find_cached_prefix(prompt, NS)
    _report(f"find_cached_prefix, {prompt_len // block_size - 1} blocks hit", rounds, time.perf_counter() - t)

    t = time.perf_counter()
    for i in range(rounds):  # hit: take the cached blocks, compute the last one, free
        blocks, covered = kv.find_cached_prefix(prompt, NS)
        kv.allocate(("hit", i), covered, prompt_len - covered, blocks)
        kv.free(("hit", i))
    _report("find + allocate on a hit + free", rounds, time.perf_counter() - t)

    kv.allocate("reg", 0, prompt_len)
    t = time.perf_counter()
    n = 200
    for i in range(n):  # hash and register every full block of a fresh prompt
        kv._hashes["reg"] = []
        kv.cache_full_blocks("reg", prompt, prompt_len, namespace_key(f"t{i}", None))
    _report(f"cache_full_blocks, {prompt_len // block_size} blocks hashed", n, time.perf_counter() - t)
    kv.free("reg")

    seqs = 256
    for s in range(seqs):
        kv.allocate(("dec", s), 0, 100)
    appends = 0
    t = time.perf_counter()
    for step in range(200):  # decode: one slot per sequence per step
        for s in range(seqs):
            kv.allocate(("dec", s), 100 + step, 1)
            appends += 1
    _report("decode append (1 token, 256 seqs)", appends, time.perf_counter() - t)
    for s in range(seqs):
        kv.free(("dec", s))

    t = time.perf_counter()
    for i in range(rounds):  # n = 2: fork a 100-token sequence; both write: one copy-on-write
        kv.allocate(("p", i), 0, 100)
        kv.fork(("p", i), ("c", i))
        kv.allocate(("p", i), 100, 1)
        kv.allocate(("c", i), 100, 1)
        kv.take_copy_pairs()
        kv.free(("p", i))
        kv.free(("c", i))
    _report("fork + 2 appends (1 COW) + 2 frees", rounds, time.perf_counter() - t)
    kv.check_invariants()


def bench_engine(model_dir: str, seqs: int, steps: int, prompt_tokens: int) -> None:
    """Run the engine with `seqs` decoding sequences; print per-step time of the scheduler vs the model."""
    from loraplex.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine
    from loraplex.engine.request import SamplingParams

    engine = LLMEngine(EngineConfig(model_dir=model_dir, max_num_seqs=seqs, max_num_batched_tokens=8192))
    timers = {"schedule": 0.0, "model": 0.0, "update": 0.0}

    def timed(name, fn):
        def wrapper(*args):
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                timers[name] += time.perf_counter() - t
        return wrapper

    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    engine.scheduler.update = timed("update", engine.scheduler.update)
    engine.runner.execute = timed("model", engine.runner.execute)
    params = SamplingParams(max_tokens=steps + 10, temperature=0, ignore_eos=True)
    text = "x" * (prompt_tokens - 1)
    for i in range(seqs):
        engine.add_request(engine.make_request(f"r{i}", f"{i:04d}{text[4:]}", params))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) \
            or engine.scheduler.waiting or len(engine.scheduler.running) < seqs:
        engine.step()  # prefill everything first
    for k in timers:
        timers[k] = 0.0
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - t
    assert len(engine.scheduler.running) == seqs
    sched = timers["schedule"] + timers["update"]
    print(f"engine: {model_dir}\n  {seqs} running sequences decoding, context ~{prompt_tokens}, {steps} steps, "
          f"torch threads {__import__('torch').get_num_threads()}")
    per = {k: 1e3 * v / steps for k, v in timers.items()}
    print(f"  per step: schedule {per['schedule']:.2f} ms + update {per['update']:.2f} ms "
          f"(incl. detokenize) = scheduler {1e3 * sched / steps:.2f} ms; model {per['model']:.2f} ms; "
          f"whole step {1e3 * wall / steps:.2f} ms")
    print(f"  scheduler share of the model's step time: {100 * sched / timers['model']:.1f}%  "
          f"(schedule alone: {100 * timers['schedule'] / timers['model']:.1f}%)")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=None, help="LLaMA-family checkpoint (default: the offline demo model)")
    ap.add_argument("--seqs", type=int, default=256, help="running sequences (default 256)")
    ap.add_argument("--steps", type=int, default=40, help="decode steps timed (default 40)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt length of each sequence (default 128)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", "1")),
                    help="torch intra-op threads (default 1)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    bench_allocator()
    model_dir = args.model_dir
    if model_dir is None:
        from loraplex.models.builtin.demo import build_demo

        model_dir = str(build_demo()["model"])
    bench_engine(model_dir, args.seqs, args.steps, args.prompt_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
