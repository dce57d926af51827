"""What serving through Triton costs: the same requests in-process and through `loraplex-serve`.

    python benchmarks/triton_overhead.py [--model smollm2|tiny] [--streams 1,16] [--max-tokens 64]

For each stream count N, N greedy `ignore_eos` requests of `--max-tokens` tokens each
(the same prompts, round-robin over `--adapters`) run twice: in-process, on an
``LLMEngine`` stepped on this thread (``engine.generate``), and through Triton, as N
concurrent HTTP `generate_stream` clients of one `loraplex-serve`. Both use the same
engine knobs and, by default, torch threads (the server's choice: engine knob
`cpu_threads`). Output tokens/s is the tokens generated over the wall
time from the first request to the last token; the ratio Triton / in-process is measured
within one run (issue 11's goal 3: at least 0.90), the two sides alternated: `--repeats`
Triton runs, each between two in-process runs (in, Triton, in, ..., Triton, in). Reported:
the ratio of the best of each, and each Triton run against the mean of the in-process runs
on either side of it (a steady drift of the machine's speed cancels out) with their median.
This machine's speed drifts by up to 30% within ten seconds, more than what serving through
Triton costs, so the bracketed median is the figure to read. The server is started once,
before the in-process engine is built, and stopped at the end; `--server-env K=V` sets
environment variables of the server (e.g. OMP_WAIT_POLICY=PASSIVE) to compare launch settings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from serving import BASE_MODEL, Launcher, model_and_adapters, server_threads, warm_up  # noqa: E402

QUESTIONS = [
    "Write a short story about a lighthouse keeper.", "Explain how a bicycle gear works.",
    "Describe the water cycle to a child.", "What makes a good cup of tea?",
]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"], help="built-in model (default: smollm2)")
    ap.add_argument("--model-dir", help="any HF checkpoint folder instead of a built-in model")
    ap.add_argument("--adapters", default=BASE_MODEL,
                    help=f"comma-separated adapter names, round-robin over requests ('{BASE_MODEL}' = none)")
    ap.add_argument("--streams", default="1,16", help="comma-separated concurrent request counts")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (greedy, ignore_eos)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="Triton runs, each between two in-process runs (in-process, Triton, in-process, ...)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads in-process (default: what the server picks, engine knob cpu_threads = 0)")
    ap.add_argument("--server-env", action="append", default=[], metavar="K=V",
                    help="an environment variable of the server only (repeatable), e.g. OMP_NUM_THREADS=2")
    ap.add_argument("--engine-config", default="{}", help="engine knobs (JSON) for both")
    ap.add_argument("--json", dest="json_path", type=Path)
    return ap.parse_args(argv)


def prompts_for(model: str, count: int) -> list[str]:
    """Chat-formatted questions for SmolLM2; plain text for other checkpoints."""
    if model == "smollm2":
        from loraplex.models.builtin.smollm2 import chat_text

        return [chat_text(QUESTIONS[i % len(QUESTIONS)]) for i in range(count)]
    return [f"{i}: {QUESTIONS[i % len(QUESTIONS)]}" for i in range(count)]


def parameters(max_tokens: int, adapter: str) -> dict:
    values = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if adapter != BASE_MODEL:
        values["lora_name"] = adapter
    return values


def stream_one(url: str, prompt: str, params: dict, tokens: list, index: int) -> None:
    """One generate_stream request; counts the tokens the server says each event carries."""
    body = json.dumps({"text_input": prompt, "stream": True, "parameters": {**params, "return_num_output_tokens": True}})
    request = urllib.request.Request(f"{url}/v2/models/lora_llm/generate_stream", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    count = 0
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if line.startswith(b"data:"):
                event = json.loads(line[5:])
                if "error" in event:
                    raise RuntimeError(event["error"])
                count += int(event["num_output_tokens"])
    tokens[index] = count


def concurrently(target, args_list: list[tuple]) -> float:
    """Seconds for target(*args) of every entry, each on its own thread, all started together."""
    threads = [threading.Thread(target=target, args=args) for args in args_list]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start


def through_triton(url: str, prompts: list[str], adapters: list[str], max_tokens: int) -> float:
    """tok/s of len(prompts) concurrent streams."""
    tokens = [0] * len(prompts)
    elapsed = concurrently(stream_one, [(url, p, parameters(max_tokens, adapters[i % len(adapters)]), tokens, i)
                                        for i, p in enumerate(prompts)])
    if sum(tokens) != max_tokens * len(prompts):
        raise RuntimeError(f"Triton streamed {sum(tokens)} tokens, expected {max_tokens * len(prompts)}")
    return sum(tokens) / elapsed


def in_process(engine, prompts: list[str], adapters: list[str], max_tokens: int, tag: str) -> float:
    """tok/s of the same requests stepped on this thread."""
    from loraplex.engine.request import SamplingParams

    requests = [engine.make_request(f"{tag}-{i}", p, SamplingParams.from_dict(parameters(max_tokens, adapters[i % len(adapters)])))
                for i, p in enumerate(prompts)]
    start = time.perf_counter()
    outputs = engine.generate(requests)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.token_ids) for outs in outputs.values() for o in outs)
    if produced != max_tokens * len(prompts):
        raise RuntimeError(f"in-process run generated {produced} tokens, expected {max_tokens * len(prompts)}")
    return produced / elapsed


def bracketed_ratios(in_process_runs: list[float], triton_runs: list[float]) -> list[float]:
    """Triton run k against the mean of the in-process runs k and k + 1, which ran just before and after it."""
    return [t / ((a + b) / 2) for t, a, b in zip(triton_runs, in_process_runs, in_process_runs[1:])]


def start_server(model_flags: list[str], engine_config: dict, work: Path, server_env: dict) -> Launcher:
    """`loraplex-serve` on free ports, with server_env added to the environment it starts with."""
    return Launcher(model_flags, engine_config, work / "store", work / "serve.log", server_env).start(ready_timeout=300)


def main(argv=None) -> int:
    args = parse_args(argv)
    streams = [int(s) for s in args.streams.split(",")]
    adapters = args.adapters.split(",")
    if args.model_dir and adapters != [BASE_MODEL]:
        raise SystemExit("triton_overhead.py: --adapters needs a built-in model (--model)")
    model_flags, checkpoint, _ = model_and_adapters(argparse.Namespace(model_dir=args.model_dir, model=args.model,
                                                                       adapters=args.adapters))
    engine_config = json.loads(args.engine_config)
    server_env = dict(kv.split("=", 1) for kv in args.server_env)

    import torch

    from loraplex.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine
    from loraplex.launch.serve import builtin_model

    with tempfile.TemporaryDirectory(prefix="triton_overhead-") as work:
        launcher = start_server(model_flags, engine_config, Path(work), server_env)
        try:
            warm_up(launcher.http_url, sorted(set(adapters)))
            torch_threads, native_threads = server_threads(engine_config, server_env)
            torch.set_num_threads(args.threads or torch_threads)
            multi_lora = {}
            if not args.model_dir:
                adapters_dir = builtin_model(args.model)[1]
                multi_lora = {n: str(adapters_dir / n) for n in adapters if n != BASE_MODEL}
            engine = LLMEngine(EngineConfig.from_dict({"model_dir": str(checkpoint), "multi_lora": multi_lora,
                                                       "native_threads": native_threads, **engine_config}))
            in_process(engine, prompts_for(args.model, 1), adapters, 4, "warm")
            rows = []
            for n in streams:
                prompts = prompts_for(args.model, n)
                ours, triton = [in_process(engine, prompts, adapters, args.max_tokens, f"n{n}-0")], []
                for k in range(1, args.repeats + 1):
                    triton.append(through_triton(launcher.http_url, prompts, adapters, args.max_tokens))
                    ours.append(in_process(engine, prompts, adapters, args.max_tokens, f"n{n}-{k}"))
                ratios = bracketed_ratios(ours, triton)
                rows.append({"streams": n, "in_process_tok_s": max(ours), "triton_tok_s": max(triton),
                             "ratio": max(triton) / max(ours), "in_process_runs": ours, "triton_runs": triton,
                             "bracketed_ratios": ratios, "median_bracketed_ratio": statistics.median(ratios)})
                print(f"streams {n:>3}, {torch.get_num_threads()} torch and {native_threads} native threads on both "
                      f"sides: in-process {max(ours):7.1f} tok/s, through Triton {max(triton):7.1f} tok/s (best of "
                      f"each), Triton / in-process {max(triton) / max(ours):.2f}; each Triton run against the "
                      f"in-process runs around it {' '.join(f'{r:.2f}' for r in ratios)}, "
                      f"median {statistics.median(ratios):.2f}", flush=True)
        finally:
            launcher.stop()
    if args.json_path:
        args.json_path.write_text(json.dumps({"args": vars(args) | {"json_path": str(args.json_path)},
                                              "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
