"""The engine on a device, in-process: greedy tokens of base + adapters equal transformers + peft.

    python benchmarks/engine_check.py [--device auto|cpu|cuda] [--json PATH]

Builds the offline demo (tiny random LLaMA, adapters demo-a and demo-b) in a temp dir,
serves 24 greedy requests (8 prompts x base / demo-a / demo-b) through `LLMEngine` in fp32
on the device, adding them in three waves so they join a running batch, and compares
every output with peft's `generate(do_sample=False)` on the CPU. Also reports the largest
first-token logprob difference, and on CUDA the synchronizing operations of every step
(torch's sync debug mode; `cuda_syncs.py`): per step, and inside the forward. Exit status 1
on any mismatch. For GPU sessions, where there is no Triton: this is the end-to-end check of
the CUDA path (kernels included).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support"), str(ROOT / "benchmarks")]  # the peft oracle



def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--eager", action="store_true", help="CUDA: no decode graphs (engine knob enforce_eager)")
    ap.add_argument("--json", dest="json_path", default=None, help="write the results to this JSON file")
    args = ap.parse_args(argv)
    import torch

    from loraplex.config import EngineConfig
    from loraplex.models.builtin.demo import CHECK_PROMPTS, build_demo
    from loraplex.engine.llm_engine import LLMEngine
    from loraplex.kernels.prefill_launch import DEFAULT_IMPL as PREFILL_DEFAULT
    from loraplex.engine.request import SamplingParams
    from cuda_syncs import SyncCounter
    from peft_reference import first_logits, greedy_tokens

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    demo = build_demo(Path(tempfile.mkdtemp(prefix="loraplex-engine-check-")) / "demo")
    adapters = {None: None, "demo-a": str(demo["demo-a"]), "demo-b": str(demo["demo-b"])}
    engine = LLMEngine(EngineConfig(model_dir=str(demo["model"]), device=device, dtype="float32", max_loras=2,
                                    multi_lora={k: v for k, v in adapters.items() if k}, enforce_eager=args.eager))
    jobs = [(f"{i}-{name}", prompt, name) for i, prompt in enumerate(CHECK_PROMPTS) for name in adapters]
    outputs: dict[str, list] = {}
    syncs = SyncCounter(engine) if device == "cuda" else None  # goal 5: the forward never waits for the device
    step = syncs.step if syncs else engine.step
    start = time.perf_counter()
    for wave in range(3):  # each wave joins the batch the previous one started
        for request_id, prompt, name in jobs[wave::3]:
            params = {"max_tokens": args.max_tokens, "temperature": 0, "logprobs": 0}
            if name:
                params["lora_name"] = name
            engine.add_request(engine.make_request(request_id, prompt, SamplingParams.from_dict(params)))
        for _ in range(4):
            for out in step():
                outputs.setdefault(out.request_id, []).append(out)
    while engine.has_work():
        for out in step():
            outputs.setdefault(out.request_id, []).append(out)
    seconds = time.perf_counter() - start
    matched, worst_logprob = 0, 0.0
    for request_id, prompt, name in jobs:
        ids = engine.tokenizer(prompt).input_ids
        got = [t for o in outputs[request_id] for t in o.token_ids]
        expected = greedy_tokens(str(demo["model"]), adapters[name], ids, args.max_tokens)
        matched += got == expected
        if got != expected:
            print(f"MISMATCH {request_id}: engine {got} peft {expected}")
        first = next(o for o in outputs[request_id] if o.logprobs)
        reference = torch.log_softmax(first_logits(str(demo["model"]), adapters[name], ids), -1)
        worst_logprob = max(worst_logprob, abs(first.logprobs[0]["token"][1] - float(reference[got[0]])))
    graphs = engine.runner.graphs
    result = {"device": device, "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
              "requests": len(jobs), "matched": matched, "max_first_logprob_diff": worst_logprob,
              "engine_seconds": seconds, "steps": engine.num_steps,
              "decode_graphs": None if graphs is None else {"sizes": graphs.sizes, "replays": graphs.replays},
              "prefill_attention": PREFILL_DEFAULT if device == "cuda" else None,
              "syncs": syncs.summary() if syncs else None}
    print(json.dumps(result, indent=2))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if matched == len(jobs) else 1


if __name__ == "__main__":
    sys.exit(main())
