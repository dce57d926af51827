"""The costs routing_sim.py simulates, measured on the engine in-process: writes benchmarks/data/routing_costs.json.

    python benchmarks/routing_costs.py [--model smollm2|tiny] [--quick] [--out PATH]

One `LLMEngine` (the engine a replica runs, stepped on this thread; adapter reads on the
preloader's worker thread as served) over a store of many_adapters.py's adapters (SmolLM2,
q_proj and v_proj, ranks 8/16/32/64 mixed, hard-linked onto 8 weight files: a cold read is a
page-cache read plus validation). Three figures:

- **step seconds by batch size and distinct adapters**: B requests decoding at once over A
  adapters (A = 0: the base model), each request's prompt prefilled first; the median of the
  whole `engine.step()` (scheduling, forward, sampling) over the decode steps that follow;
- **prefill seconds per token**: the least-squares slope of the prefill steps' seconds over
  their new tokens, less the decode step of the same batch;
- **slot-load and disk-read seconds by rank**: `AdapterManager.read` (read and validate a
  folder: what the preloader runs) and `AdapterManager.acquire` of a host-resident adapter into
  a free device slot (the copy a step makes), timed per adapter, median per rank.

The engine's shape (max_loras, max_cpu_loras, max_num_seqs, token budget, KV blocks) goes in
the file too: the simulator's replicas default to it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

DEFAULT_OUT = ROOT / "benchmarks" / "data" / "routing_costs.json"
BATCHES = (1, 2, 4, 8, 16, 32, 64)
ADAPTER_COUNTS = (0, 1, 2, 4, 8)
QUICK_BATCHES, QUICK_ADAPTER_COUNTS = (1, 4), (0, 2)
STORE_COUNT = 96  # adapter folders: enough that the load phase reads each once


def rank_of(folder: Path) -> int:
    return int(json.loads((folder / "adapter_config.json").read_text())["r"])


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class StepTimer:
    """Wraps engine.step: each step's wall seconds with its batch's shape (seqs, new tokens, distinct adapters)."""

    def __init__(self, engine):
        self.engine, self.batches, self.records = engine, [], []
        execute = engine.runner.execute

        def recording(batch, *args, **kwargs):
            self.batches.append((len(batch.seqs), sum(batch.num_new_tokens), max(batch.num_new_tokens, default=0),
                                 len({s.request.adapter_key for s in batch.seqs if s.request.adapter_key})))
            return execute(batch, *args, **kwargs)

        engine.runner.execute = recording

    def step(self) -> None:
        self.batches.clear()
        started = time.perf_counter()
        self.engine.step()
        seconds = time.perf_counter() - started
        if self.batches:
            seqs, tokens, longest, adapters = self.batches[-1]
            self.records.append({"seqs": seqs, "tokens": tokens, "prefill": longest > 1, "adapters": adapters,
                                 "seconds": seconds})


def grid_cell(engine, timer: StepTimer, names: list[str], batch: int, adapters: int, prompt_tokens: int,
              decode_steps: int, tag: str) -> dict:
    """B requests over A adapters: prefill them, then time `decode_steps` decode steps (median)."""
    from loraplex.engine.request import SamplingParams

    text = "x" * max(1, prompt_tokens - 4)
    for i in range(batch):
        params = SamplingParams(max_tokens=decode_steps + 3, temperature=0, ignore_eos=True,
                                lora_name=names[i % adapters] if adapters else None)
        engine.add_request(engine.make_request(f"{tag}-{i}", f"{i:04d}{text}", params))
    sched = engine.scheduler
    first = len(timer.records)
    while (len(sched.running) < batch or sched.waiting
           or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running)):
        timer.step()
    prefill = [r for r in timer.records[first:] if r["prefill"]]
    timer.step()  # the first decode step after the prefills: not counted
    start = len(timer.records)
    for _ in range(decode_steps):
        timer.step()
    decode = [r["seconds"] for r in timer.records[start:] if not r["prefill"] and r["seqs"] == batch]
    while engine.has_work():
        timer.step()
    return {"batch": batch, "adapters": adapters, "seconds": statistics.median(decode), "samples": len(decode),
            "prefill_steps": [{k: r[k] for k in ("seqs", "tokens", "adapters", "seconds")} for r in prefill]}


def prefill_slope(cells: list[dict]) -> float:
    """Seconds per prefill token: least squares of (prefill step seconds - that batch's decode step) on new tokens."""
    decode = {(c["batch"], c["adapters"]): c["seconds"] for c in cells}
    xs, ys = [], []
    for cell in cells:
        for step in cell["prefill_steps"]:
            base = decode.get((step["seqs"], cell["adapters"]), cell["seconds"])
            xs.append(step["tokens"] - step["seqs"])
            ys.append(step["seconds"] - base)
    if not xs or not any(xs):
        return 0.0
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var if var else mean_y / mean_x
    return max(slope, 0.0)


def load_phase(engine, store: Path, names: list[str]) -> tuple[dict, dict]:
    """Per rank: median seconds of AdapterManager.read (disk read + validation) and acquire into a free slot."""
    import torch

    manager = engine.adapters
    reads: dict[int, list[float]] = {}
    loads: dict[int, list[float]] = {}
    for name in names:
        manager.register(name, store / name)  # what admission does for a store adapter
        folder = manager.needs_read(name)
        if folder is None:
            continue  # already in host memory: no read to time
        rank = rank_of(store / name)
        started = time.perf_counter()
        preloaded = manager.read(name, folder)
        reads.setdefault(rank, []).append(time.perf_counter() - started)
        manager.adopt(name, preloaded)
        if manager.is_resident(name):
            continue
        started = time.perf_counter()
        slot = manager.acquire(name)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()  # the copy into the slot, not its launch
        seconds = time.perf_counter() - started
        if slot is None:
            continue
        manager.release(name)
        loads.setdefault(rank, []).append(seconds)
    return ({str(r): statistics.median(v) for r, v in sorted(reads.items())},
            {str(r): statistics.median(v) for r, v in sorted(loads.items())})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2",
                    help="built-in model the engine serves (default %(default)s)")
    ap.add_argument("--quick", action="store_true", help="two batch sizes and two adapter counts (a smoke run)")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="prompt length of each request (default %(default)s)")
    ap.add_argument("--decode-steps", type=int, default=6, help="decode steps timed per cell (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="passes over the cells; a cell's figure is the median "
                    "of its rounds (default %(default)s)")
    ap.add_argument("--engine-config", default="{}", help="engine knobs over the defaults (JSON)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="the JSON written (default %(default)s)")
    args = ap.parse_args(argv)

    import torch

    from loraplex.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine
    from loraplex.launch.serve import builtin_model
    from loraplex.launch.tritonserver import cache_dir
    from many_adapters import adapter_name, build_store

    checkpoint = builtin_model(args.model)[0]
    cache = cache_dir() / "many_adapters"  # many_adapters.py's own store for SmolLM2
    store = build_store(checkpoint, cache if args.model == "smollm2" else cache / args.model, count=STORE_COUNT)
    # One thread each: on a shared CPU a parallel loop waits for its slowest thread's time slice.
    knobs = {"max_num_seqs": max(BATCHES), "cpu_threads": 1, "native_threads": 1, **json.loads(args.engine_config)}
    config = EngineConfig(model_dir=str(checkpoint), adapter_store=str(store), **knobs)
    engine = LLMEngine(config)
    timer = StepTimer(engine)
    names = [adapter_name(i) for i in range(STORE_COUNT)]
    batches, counts = (QUICK_BATCHES, QUICK_ADAPTER_COUNTS) if args.quick else (BATCHES, ADAPTER_COUNTS)
    started = time.monotonic()
    inference = torch.inference_mode()
    inference.__enter__()
    grid_cell(engine, timer, names, 1, 1, args.prompt_tokens, 2, "warm")  # first forward: allocations, not timed
    shapes = [(b, a) for b in batches for a in counts if a <= min(b, config.max_loras)]
    runs: dict[tuple[int, int], list[dict]] = {}
    for round_ in range(args.rounds):  # the rounds alternate over the cells: a slow minute hits every cell a little
        for batch, adapters in shapes if round_ % 2 == 0 else reversed(shapes):
            runs.setdefault((batch, adapters), []).append(grid_cell(
                engine, timer, names, batch, adapters, args.prompt_tokens, args.decode_steps,
                f"r{round_}-b{batch}-a{adapters}"))
            print(f"routing_costs.py: round {round_}, batch {batch:3d}, {adapters} adapters: "
                  f"{1e3 * runs[(batch, adapters)][-1]['seconds']:.1f} ms per decode step", flush=True)
    cells = [{"batch": b, "adapters": a, "seconds": statistics.median(r["seconds"] for r in runs[(b, a)]),
              "samples": sum(r["samples"] for r in runs[(b, a)]),
              "prefill_steps": [s for r in runs[(b, a)] for s in r["prefill_steps"]]} for b, a in shapes]
    reads, loads = load_phase(engine, store, names[config.max_loras:])
    inference.__exit__(None, None, None)
    out = {
        "measured": {"command": "python benchmarks/routing_costs.py " + " ".join(argv or sys.argv[1:]),
                     "commit": commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, "
                                f"device {engine.device.type}", "model": args.model,
                     "dtype": str(engine.dtype),
                     "adapters": "many_adapters.py's store: q_proj+v_proj, ranks 8/16/32/64, hard-linked "
                                 "(disk reads are page-cache reads plus validation)",
                     "prompt_tokens": args.prompt_tokens, "seconds": round(time.monotonic() - started, 1)},
        "engine": {"max_loras": config.max_loras, "max_cpu_loras": config.max_cpu_loras,
                   "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
                   "block_size": config.block_size, "kv_blocks": engine.kv_manager.num_blocks},
        "step_seconds": [{k: c[k] for k in ("batch", "adapters", "seconds", "samples")} for c in cells],
        "prefill_seconds_per_token": prefill_slope(cells),
        "disk_read_seconds": reads,
        "slot_load_seconds": loads,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"routing_costs.py: prefill {1e3 * out['prefill_seconds_per_token']:.3f} ms/token; disk read "
          f"{ {r: round(1e3 * s, 1) for r, s in reads.items()} } ms; slot load "
          f"{ {r: round(1e3 * s, 1) for r, s in loads.items()} } ms by rank; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
