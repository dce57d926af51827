"""Triton end to end on one device: the real `loraplex-serve` (tritonserver, the Python-backend stub,
decoupled response senders, the engine) exact against transformers + peft, then a concurrency run
compared with the same engine in-process.

    python benchmarks/triton_gpu.py [--device cuda|cpu] [--hidden 2048 --layers 8 ...] [--json PATH]

1. A random LLaMA (byte tokenizer) and two random rank-16 PEFT adapters, built here (no download).
2. `loraplex-serve --model-dir` on it, in fp32 on --device, the adapters in its store.
3. Exactness: 8 prompts x (base, lora00, lora01), sent at once over HTTP `generate_stream`
   (server-sent events; token ids from `return_logprobs`), each equal to peft's greedy tokens.
4. Concurrency: --requests requests at once (round-robin base / adapters, --max-tokens each,
   ignore_eos) over `generate_stream`; useful tokens / wall time. Every stream must end without
   an error, with all its tokens.
5. The same requests in-process (`LLMEngine` stepped here, same config): the ratio served / in-process.
Needs no tritonclient (urllib only), so it runs where only torch, transformers and peft are
installed (the GPU machine, decision 058). Exit status 1 on a mismatch or a lost request.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support"), str(ROOT / "benchmarks")]

import peers  # noqa: E402
import serving  # noqa: E402

PROMPTS = ["The quick brown fox", "Triton serves many adapters", "hello world, hello", "0 1 2 3 4 5 6",
           "a b c d e f g h", "LoRA on the GPU", "one base model, many tenants", "streams of tokens"]


def stream(http_url: str, prompt: str, params: dict, timeout: float = 600.0) -> dict:
    """One request over generate_stream: token ids (from logprobs), events, error."""
    body = json.dumps({"text_input": prompt, "stream": True, "exclude_input_in_output": True, "return_logprobs": True,
                       "parameters": {**params, "logprobs": 0}}).encode()
    request = urllib.request.Request(f"{http_url}/v2/models/lora_llm/generate_stream", data=body,
                                     headers={"Content-Type": "application/json"})
    out = {"ids": [], "events": 0, "error": None}
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                out["events"] += 1
                if "error" in event:
                    out["error"] = event["error"]
                    continue
                out["ids"] += [int(next(iter(e))) for e in json.loads(event.get("logprobs") or "null") or []]
    except Exception as exc:  # noqa: BLE001 (reported, counted as a failure)
        out["error"] = repr(exc)
    return out


def all_at_once(http_url: str, jobs: list[tuple[str, dict]]) -> tuple[list[dict], float]:
    """Every job on its own thread and stream; (outcomes in job order, wall seconds)."""
    started = time.perf_counter()
    with ThreadPoolExecutor(len(jobs)) as pool:
        outcomes = list(pool.map(lambda job: stream(http_url, *job), jobs))
    return outcomes, time.perf_counter() - started


def concurrency_jobs(names: list[str | None], requests: int, max_tokens: int) -> list[tuple[str, dict]]:
    return [(f"{PROMPTS[i % len(PROMPTS)]} #{i}",
             {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
              **({"lora_name": names[i % len(names)]} if names[i % len(names)] else {})})
            for i in range(requests)]


def in_process(model_dir: str, adapters: dict[str, str], engine_config: dict, jobs) -> dict:
    """The concurrency jobs through LLMEngine on this thread: tokens and wall seconds."""
    from loraplex.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine
    from loraplex.engine.request import SamplingParams

    engine = LLMEngine(EngineConfig.from_dict({**engine_config, "model_dir": model_dir, "multi_lora": adapters}))

    def run(tag: str) -> tuple[int, float]:
        started = time.perf_counter()
        for i, (prompt, params) in enumerate(jobs):
            engine.add_request(engine.make_request(f"{tag}-{i}", prompt, SamplingParams.from_dict(params)))
        tokens = 0
        while engine.has_work():
            tokens += sum(len(o.token_ids) for o in engine.step() if o.token_ids)
        peers.sync(engine.device)
        return tokens, time.perf_counter() - started

    run("warm")
    tokens, seconds = run("timed")
    return {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64, help="concurrency run: requests at once")
    ap.add_argument("--max-tokens", type=int, default=64, help="concurrency run: tokens each")
    ap.add_argument("--check-tokens", type=int, default=16, help="exactness: greedy tokens each")
    ap.add_argument("--eager", action="store_true", help="CUDA: no decode graphs (engine knob enforce_eager)")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from loraplex.launch.serve import seed_adapter_store
    from peft_reference import greedy_tokens

    work = Path(tempfile.mkdtemp(prefix="loraplex-triton-gpu-"))
    model_dir, adapters = peers.build_model_and_adapters(
        work, 2, 16, "all", hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads)
    engine_config = {"device": args.device, "dtype": "float32", "max_loras": 2, "enforce_eager": args.eager}
    names = [None, *sorted(adapters)]
    report: dict = {"device": args.device, "shape": vars(args)}
    with serving.Launcher(["--model-dir", model_dir], engine_config, work / "store", work / "serve.log") as server:
        seed_adapter_store(work / "store", work / "adapters")
        started = time.perf_counter()
        server.start(args.ready_timeout)
        report["server_start_s"] = time.perf_counter() - started
        checks = [(p, {"max_tokens": args.check_tokens, "temperature": 0, **({"lora_name": n} if n else {})})
                  for p in PROMPTS for n in names]
        outcomes, _ = all_at_once(server.http_url, checks)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        matched = 0
        for (prompt, params), got in zip(checks, outcomes):
            expected = greedy_tokens(model_dir, adapters.get(params.get("lora_name")), tokenizer(prompt).input_ids,
                                     args.check_tokens)
            ok = got["error"] is None and got["ids"] == expected
            matched += ok
            if not ok:
                print(f"MISMATCH {prompt!r} {params.get('lora_name')}: served {got} peft {expected}")
        report["exact"] = {"matched": matched, "requests": len(checks)}
        print(f"triton_gpu.py: {matched}/{len(checks)} served streams equal peft's greedy tokens", flush=True)
        jobs = concurrency_jobs(names, args.requests, args.max_tokens)
        all_at_once(server.http_url, jobs[: len(names)])  # warm-up
        outcomes, seconds = all_at_once(server.http_url, jobs)
        lost = [o for o in outcomes if o["error"] or len(o["ids"]) != args.max_tokens]
        tokens = sum(len(o["ids"]) for o in outcomes)
        report["served"] = {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "failed": len(lost)}
        print(f"triton_gpu.py: through Triton {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s, "
              f"{len(lost)} failed", flush=True)
    report["in_process"] = in_process(model_dir, adapters, engine_config, jobs)
    ratio = report["served"]["tok_s"] / report["in_process"]["tok_s"]
    report["served_over_in_process"] = ratio
    print(f"triton_gpu.py: in-process {report['in_process']['tok_s']:.1f} tok/s; through Triton / in-process "
          f"{ratio:.3f}", flush=True)
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if matched == len(checks) and not lost and tokens == args.requests * args.max_tokens else 1


if __name__ == "__main__":
    sys.exit(main())
