"""What multi-LoRA costs on the served path: W1 through Triton over its 8 adapters against the same
requests on the base model, on one server, with an independent gRPC client.

    python benchmarks/multi_lora_overhead.py [--rounds 3] [--quick] [--json PATH]

One `loraplex-serve` (make serve's defaults) serves W1's random model with its 8 adapters in the
adapter store. After a warm-up request per adapter and one unmeasured W1 run of each kind, the rounds alternate: all 48 W1 requests at
once over the adapters (round-robin), then the same 48 on the base model, then again. The client
is `clients/load.py`'s `run_streams` (one `tritonclient.grpc` stream per request, not AIPerf).
Each run's figure is useful output tokens / wall time from the first send to the last final
response (prefill included); the ratio is each adapter run over the mean of the base runs
around it, and the median ratio is the result. The same requests then run in-process
(`LLMEngine` stepped on this thread, the server's thread counts), split into prefill and decode
step time, which says where the remaining cost is.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import serving


def served_run(url: str, requests: list[tuple[str, int]], adapters: list[str]) -> dict:
    """All requests at once through Triton (round-robin over adapters; none: the base model)."""
    from clients.load import StreamJob, run_streams

    jobs = [StreamJob(prompt, {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                               **({"lora_name": adapters[i % len(adapters)]} if adapters else {})})
            for i, (prompt, max_tokens) in enumerate(requests)]
    started = time.perf_counter()
    outcomes = run_streams(url, jobs)
    seconds = time.perf_counter() - started
    errors = [o.error for o in outcomes if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed, the first: {errors[0]}")
    tokens = sum(o.num_output_tokens for o in outcomes)
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}


def in_process_runs(model_dir: Path, adapters_dir: Path, adapters: list[str], requests, rounds: int,
                    threads: tuple[int, int]) -> list[dict]:
    """The same requests in-process, the server's thread counts: tok/s and prefill / decode step seconds."""
    import torch

    from loraplex.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine
    from loraplex.engine.request import SamplingParams

    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), native_threads=threads[1],
                                    multi_lora={a: str(adapters_dir / a) for a in adapters}))
    torch.set_num_threads(threads[0])
    execute, split = engine.runner.execute, {}

    def timed_execute(batch, *args, **kwargs):
        started = time.perf_counter()
        result = execute(batch, *args, **kwargs)
        kind = "prefill_s" if any(n > 1 for n in batch.num_new_tokens) else "decode_s"
        split[kind] = split.get(kind, 0.0) + time.perf_counter() - started
        return result

    engine.runner.execute = timed_execute

    def run(names: list[str], tag: str) -> dict:
        split.clear()
        started = time.perf_counter()
        for i, (prompt, max_tokens) in enumerate(requests):
            params = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                      **({"lora_name": names[i % len(names)]} if names else {})}
            engine.add_request(engine.make_request(f"{tag}-{i}", prompt, SamplingParams.from_dict(params)))
        tokens = 0
        while engine.has_work():
            tokens += sum(len(o.token_ids) for o in engine.step() if o.token_ids)
        seconds = time.perf_counter() - started
        return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, **split}

    run(adapters, "warm"), run([], "warm-base")
    return [{"run": label, **run(names, f"{label}-{k}")}
            for k in range(rounds) for label, names in (("adapters", adapters), ("base", []))]


def ratios(runs: list[dict]) -> list[float]:
    """Each adapters run over the mean of the base runs beside it (the one before and the one after)."""
    out = []
    for i, r in enumerate(runs):
        if r["run"] == "adapters":
            base = [runs[j]["tok_s"] for j in (i - 1, i + 1) if 0 <= j < len(runs) and runs[j]["run"] == "base"]
            out.append(r["tok_s"] / statistics.mean(base))
    return out


def table(title: str, runs: list[dict]) -> str:
    lines = [title, "| run | tok/s | wall s | prefill s | decode s |", "|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['run']} | {r['tok_s']:.1f} | {r['seconds']:.2f} | "
                     f"{r.get('prefill_s', float('nan')):.2f} | {r.get('decode_s', float('nan')):.2f} |")
    rs = ratios(runs)
    lines.append(f"adapters / base: {', '.join(f'{x:.3f}' for x in rs)}; median **{statistics.median(rs):.3f}**")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="adapter runs (each between base runs)")
    ap.add_argument("--quick", action="store_true", help="W1's steps at a tiny size (no figures)")
    ap.add_argument("--engine-config", default="{}", help="the server's engine config (JSON)")
    ap.add_argument("--no-in-process", action="store_true", help="skip the in-process split")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    from loraplex.launch.serve import seed_adapter_store

    w1 = serving.QUICK_W1_WORKLOAD if args.quick else serving.W1_WORKLOAD
    model_dir, adapters_dir = serving.w1_assets(w1)
    adapters = sorted(p.name for p in adapters_dir.iterdir() if p.is_dir())
    requests = serving.w1_requests(w1)
    engine_config = json.loads(args.engine_config)
    threads = serving.server_threads(engine_config)
    print(f"multi_lora_overhead.py: W1: {w1.summary}; server threads (torch, native) {threads}", flush=True)
    with tempfile.TemporaryDirectory(prefix="loraplex-overhead-") as tmp:
        with serving.Launcher(["--model-dir", str(model_dir)], engine_config, Path(tmp) / "store",
                              Path(tmp) / "serve.log") as server:
            seed_adapter_store(Path(tmp) / "store", adapters_dir)
            server.start(300)
            serving.warm_up(server.http_url, [*adapters, serving.BASE_MODEL])
            url = f"127.0.0.1:{server.grpc_port}"
            served_run(url, requests, adapters), served_run(url, requests, [])  # first full batches: not measured
            served = [{"run": "base", **served_run(url, requests, [])}]
            for _ in range(args.rounds):
                served.append({"run": "adapters", **served_run(url, requests, adapters)})
                served.append({"run": "base", **served_run(url, requests, [])})
    report = {"workload": dataclasses.asdict(w1), "threads": threads, "served": served}
    print(table("\nThrough Triton (tritonclient gRPC streams, all requests at once):", served))
    if not args.no_in_process:
        report["in_process"] = in_process_runs(model_dir, adapters_dir, adapters, requests, args.rounds, threads)
        print(table("\nIn-process (LLMEngine stepped here, the server's threads):", report["in_process"]))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
