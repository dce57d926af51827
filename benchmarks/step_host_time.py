"""Host time per decode step outside the forward, at N running sequences (issue goal: at most 1 ms at 256).

    python benchmarks/step_host_time.py [--model-dir DIR] [--seqs 256] [--steps 30] [--adapters 8] [--profile]

Runs the real engine loop on the calling thread with N sequences decoding at once (the demo
model and its adapters unless --model-dir; greedy, ignore_eos, half of them with a stop string
so the stop check runs) and splits each step into the forward (``model.forward`` + ``logits``:
the part a GPU runs) and everything else the loop does (inbox, schedule, step tensors,
sampling, KV bookkeeping, token events). Detokenization, stop strings and outputs run on the
output processor's thread, as when served; its time per step is printed apart (``--inline``
runs it on the loop thread instead, as ``LLMEngine.step`` does). ``--profile`` prints the
top functions of the loop thread (cProfile).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def measure(model_dir: str, adapters: list[str], seqs: int, steps: int, prompt_tokens: int,
            profile: bool = False, inline: bool = False, logprobs: bool = False, eager: bool = False) -> dict:
    """Per-step milliseconds: whole step, forward, host (= whole - forward)."""
    from loraplex.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine
    from loraplex.engine.request import SamplingParams

    config = EngineConfig(model_dir=model_dir, max_num_seqs=seqs, max_num_batched_tokens=8192,
                          adapter_store=str(Path(adapters[0]).parent) if adapters else "",
                          max_loras=max(1, len(adapters)), enforce_eager=eager)
    engine = LLMEngine(config)
    model = engine.runner.model
    spent = dict.fromkeys(("forward", "runner", "schedule", "update", "events", "processor"), 0.0)

    import torch

    sync = torch.cuda.synchronize if engine.device.type == "cuda" else None  # the forward's time, not its launch

    def timed(fn, part):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if sync is not None and part == "forward":
                    sync()
                spent[part] += time.perf_counter() - t
        return wrapper

    model.forward, model.logits = timed(model.forward, "forward"), timed(model.logits, "forward")
    if engine.runner.graphs is not None:  # a decode step replays a graph: that is its forward
        engine.runner.graphs.run = timed(engine.runner.graphs.run, "forward")
    engine.runner.execute = timed(engine.runner.execute, "runner")
    engine.scheduler.schedule = timed(engine.scheduler.schedule, "schedule")
    engine.scheduler.update = timed(engine.scheduler.update, "update")
    engine._events = timed(engine._events, "events")
    engine.processor.process = timed(engine.processor.process, "processor")
    failed = []

    def check(outputs) -> None:
        failed.extend(out.error for out in outputs if out.error is not None)

    if not inline:
        engine.processor.start(check)
    names = [Path(a).name for a in adapters]
    text = "x" * (prompt_tokens - 1)
    for i in range(seqs):
        params = SamplingParams(max_tokens=steps + 10, temperature=0, ignore_eos=True,
                                stop=["never-seen stop"] if i % 2 else [], lora_name=names[i % len(names)] if names else None)
        request = engine.make_request(f"r{i}", f"{i:04d}{text[4:]}", params)
        request.wants_logprobs = logprobs  # as served: only when the client asks for them
        engine.add_request(request)
    def step() -> None:
        if inline:
            check(engine.step())
        else:
            engine.processor.submit(engine.step_events())
        if failed:
            raise RuntimeError(f"{len(failed)} requests failed: {failed[0]!r}")

    loop_mode = torch.inference_mode()  # as the engine's loop thread runs (LLMEngine._serve)
    loop_mode.__enter__()
    while len(engine.scheduler.running) < seqs or engine.scheduler.waiting \
            or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        step()  # prefill everything first
    step()
    spent.update(dict.fromkeys(spent, 0.0))
    profiler = cProfile.Profile() if profile else None
    hosts = []  # each step's host time: its wall time less its forward
    t = time.perf_counter()
    if profiler:
        profiler.enable()
    for _ in range(steps):
        begin, forward = time.perf_counter(), spent["forward"]
        step()
        hosts.append(time.perf_counter() - begin - (spent["forward"] - forward))
    if profiler:
        profiler.disable()
    wall = time.perf_counter() - t
    loop_mode.__exit__(None, None, None)
    engine.processor.stop()
    assert len(engine.scheduler.running) == seqs, "a sequence finished early"
    result = {f"{part}_ms": 1e3 * t / steps for part, t in spent.items()}
    result["runner_ms"] -= result["forward_ms"]  # the runner's own host work: step inputs, sampling
    result["step_ms"] = 1e3 * wall / steps
    result["host_ms"] = result["step_ms"] - result["forward_ms"]
    result["host_median_ms"] = 1e3 * statistics.median(hosts)
    result["decode_graphs"] = engine.runner.graphs is not None
    if profiler:
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(45)
    return result


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=None, help="LLaMA-family checkpoint (default: the offline demo model)")
    ap.add_argument("--adapters", type=int, default=2, help="demo adapters to spread the sequences over (0: base)")
    ap.add_argument("--seqs", type=int, default=256, help="running sequences (default 256)")
    ap.add_argument("--steps", type=int, default=30, help="decode steps timed (default 30)")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="prompt length of each sequence (default 64)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("BENCH_THREADS", "1")),
                    help="torch intra-op threads (default 1)")
    ap.add_argument("--profile", action="store_true", help="print the top host functions (cProfile)")
    ap.add_argument("--logprobs", action="store_true",
                    help="every request wants its tokens' logprobs (return_cumulative_logprob); default: none does")
    ap.add_argument("--eager", action="store_true", help="CUDA: no decode graphs (engine knob enforce_eager)")
    ap.add_argument("--inline", action="store_true",
                    help="detokenize on the loop thread (LLMEngine.step) instead of the output processor's thread")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from loraplex.models.builtin.demo import build_demo

    demo = build_demo()
    model_dir = args.model_dir or str(demo["model"])
    adapters = sorted(str(p) for p in Path(demo["adapters"]).iterdir() if p.is_dir())[: args.adapters]
    r = measure(model_dir, adapters, args.seqs, args.steps, args.prompt_tokens, args.profile, args.inline, args.logprobs,
                args.eager)
    where = "on the loop thread" if args.inline else "on its own thread"
    print(f"{args.seqs} sequences decoding ({len(adapters)} adapters), {args.steps} steps, "
          f"torch threads {torch.get_num_threads()}, output processor {where}"
          + (", decode steps replay CUDA graphs (their input copies count as forward)" if r["decode_graphs"] else ""))
    print(f"  per step: whole {r['step_ms']:.2f} ms = forward {r['forward_ms']:.2f} ms + host {r['host_ms']:.2f} ms "
          f"(median step: host {r['host_median_ms']:.2f} ms)")
    parts = ("runner", "schedule", "update", "events") + (("processor",) if args.inline else ())
    rest = r["host_ms"] - sum(r[f"{p}_ms"] for p in parts)
    print(f"  host: schedule {r['schedule_ms']:.2f}, runner inputs + sampling {r['runner_ms']:.2f}, "
          f"update (tokens, finish checks) {r['update_ms']:.2f}, token events {r['events_ms']:.2f}, "
          f"rest {rest:.2f} ms")
    print(f"  output processor (detokenize, stop strings, outputs) {r['processor_ms']:.2f} ms per step, "
          f"{where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
