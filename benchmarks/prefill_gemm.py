"""Prefill-sized GEMMs on the CPU: the native packed GEMM (fp16 and fp32 panels, kernels.packed_linear), the same
panels on AMX-BF16 tiles (kernels.bf16_linear: bf16x3, two parts of x and W; bf16, one part; where the CPU has the
tiles), and torch's own: fp32 (MKL), fp32 with oneDNN's bf16 math mode (AMX where present: fp32 in and out, inputs
rounded to bf16, fp32 sums), and bf16 in and out.

    python benchmarks/prefill_gemm.py [--rows 16,64,256,1024,2048] [--threads 1,2] [--shapes qkv,o,gate_up,down]
        [--repeats 5] [--json PATH]
    python benchmarks/prefill_gemm.py --steps MODEL_DIR [--prompts 64,128,256,512] [--decodes 0,16] [--repeats 4]
    python benchmarks/prefill_gemm.py --exact MODEL_DIR [--adapters name=dir,...] [--scale 1] [--max-tokens 16]

Shapes are SmolLM2-135M's projections (hidden 576, intermediate 1536, q/k/v fused 576 + 2 * 192, vocabulary
49,152); each figure is the best of --repeats timed calls (GFLOP/s = 2 * M * N * K / time). The candidates take
turns within each repeat, so a slower moment of a shared machine hits them alike. The ISA oneDNN picked is
printed (run with ONEDNN_VERBOSE=1 to see each call).

--steps: one engine step that prefills a prompt of P tokens (with D sequences decoding beside it) under each
prefill_dtype, engines built side by side (prefix cache off, 2 native threads, 1 torch thread, the server's),
taking turns, best of --repeats, bf16_prefill.MIN_ROWS set to 1 so every size takes the tiles: where the tiles
start to pay (MIN_ROWS, decision 074).

--exact: six prompts (each alone and with each adapter) in one batch, greedy, through the engine under each
prefill_dtype (prefix cache off), against transformers + peft teacher-forced: the worst |logprob| difference of
the chosen tokens and how many sequences' greedy tokens equal peft's (decision 074's numerics; --scale lengthens
the prompts, 40-105 characters times it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from loraplex import kernels
from loraplex.kernels import cpu_native

HIDDEN, INTERMEDIATE, KV, VOCAB = 576, 1536, 192, 49152
# name -> (N outputs, K inputs)
SHAPES = {"qkv": (HIDDEN + 2 * KV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTERMEDIATE, HIDDEN),
          "down": (HIDDEN, INTERMEDIATE), "lm_head": (VOCAB, HIDDEN)}


def fp32_bf16_math(x, w):
    """fp32 in and out, oneDNN's bf16 math mode (AMX/AVX-512 BF16 where present)."""
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    try:
        return F.linear(x, w)
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = "none"


def candidates(n: int, k: int, half_panels, f32_panels, w32: torch.Tensor, w16: torch.Tensor) -> dict:
    """name -> f(x fp32) of the one projection."""
    out = {}
    if half_panels is not None:
        out["ours fp16 panels"] = lambda x: kernels.packed_linear(x, half_panels)
        out["ours fp32 panels"] = lambda x: kernels.packed_linear(x, f32_panels)
    if half_panels is not None and kernels.bf16_tiles(f32_panels):
        out["tiles bf16x3, fp32 panels"] = lambda x: kernels.bf16_linear(x, f32_panels, 2)
        out["tiles bf16x3, fp16 panels"] = lambda x: kernels.bf16_linear(x, half_panels, 2)
        out["tiles bf16, fp32 panels"] = lambda x: kernels.bf16_linear(x, f32_panels, 1)
    out["torch fp32"] = lambda x: F.linear(x, w32)
    out["torch fp32, bf16 math"] = lambda x: fp32_bf16_math(x, w32)
    out["torch bf16 (x cast in, y cast out)"] = lambda x: F.linear(x.to(torch.bfloat16), w16).float()
    return out


def bench(fn, x, repeats: int) -> float:
    """Seconds of one call, best of repeats (after a warm-up call)."""
    fn(x)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - t)
    return best


def step_seconds(engine, prompt: str, decodes: int, tag: str) -> float:
    """Seconds of the one step that prefills prompt, decodes sequences (started first) beside it."""
    from loraplex.engine.request import SamplingParams

    params = SamplingParams.from_dict({"max_tokens": 64, "temperature": 0, "ignore_eos": True})
    ids = [f"{tag}-d{i}" for i in range(decodes)]
    for rid in ids:
        engine.add_request(engine.make_request(rid, "hi there", params))
    if decodes:
        engine.step(), engine.step()
    ids.append(f"{tag}-p")
    engine.add_request(engine.make_request(ids[-1], prompt, SamplingParams.from_dict({"max_tokens": 1})))
    started = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - started
    for rid in ids:
        engine.abort(rid)
    while engine.has_work():
        engine.step()
    return seconds


def main_steps(args: argparse.Namespace) -> int:
    """--steps: prefill steps under each prefill_dtype."""
    from loraplex.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine
    from loraplex.models import bf16_prefill

    bf16_prefill.MIN_ROWS = 1
    torch.set_num_threads(1)
    modes = ["float32", *(["bf16x3", "bfloat16"] if bf16_prefill.tiles_available() else [])]
    engines = {mode: LLMEngine(EngineConfig(model_dir=args.steps, native_threads=2, prefill_dtype=mode,
                                            enable_prefix_caching=False, max_model_len=2048, num_kv_blocks=1024))
               for mode in modes}
    tokenizer = engines["float32"].tokenizer
    print(f"{args.steps}: one step's seconds (ms), best of {args.repeats}; the tiles' speed-up over float32")
    for decodes in (int(d) for d in args.decodes.split(",")):
        for tokens in (int(p) for p in args.prompts.split(",")):
            words = []
            while len(tokenizer(" ".join(words)).input_ids) < tokens:
                words.append(WORDS[len(words) % len(WORDS)])
            prompt, best = " ".join(words), dict.fromkeys(modes, float("inf"))
            for r in range(args.repeats):
                for mode, engine in engines.items():
                    best[mode] = min(best[mode], step_seconds(engine, prompt, decodes, f"{mode}-{tokens}-{r}"))
            print(f"prompt {tokens:5d} tokens, {decodes:3d} decoding: " + "  ".join(
                f"{mode} {best[mode] * 1e3:7.1f} ({best['float32'] / best[mode]:.2f}x)" for mode in modes), flush=True)
    return 0


def main_exact(args: argparse.Namespace) -> int:
    """--exact: each prefill_dtype's tokens and logprobs against peft's."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
    from exactness import run_greedy_logprobs
    from peft_reference import teacher_forced_logits

    from loraplex.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine
    from loraplex.models import bf16_prefill

    adapters = dict(a.split("=", 1) for a in args.adapters.split(",")) if args.adapters else {}
    prompts = [(" ".join(WORDS[i:] + WORDS[:i]) * args.scale)[: (40 + 13 * i) * args.scale] for i in range(6)]
    batch = {f"{i}:{lora}": (p, lora) for i, p in enumerate(prompts) for lora in [None, *adapters]}
    modes = ["float32", *(["bf16x3", "bfloat16"] if bf16_prefill.tiles_available() else [])]
    for mode in modes:
        engine = LLMEngine(EngineConfig(model_dir=args.exact, prefill_dtype=mode, enable_prefix_caching=False,
                                        max_model_len=2048, num_kv_blocks=1024, max_loras=max(1, len(adapters)),
                                        max_lora_rank=64, multi_lora=adapters))
        requests, tokens, logprobs = run_greedy_logprobs(engine, batch, args.max_tokens)
        worst, equal = 0.0, 0
        for rid, (_, lora) in batch.items():
            ref = teacher_forced_logits(args.exact, adapters.get(lora), requests[rid].prompt_token_ids, tokens[rid])
            want = torch.log_softmax(ref, -1).gather(1, torch.tensor(tokens[rid])[:, None])[:, 0]
            worst = max(worst, float((torch.tensor(logprobs[rid]) - want).abs().max()))
            equal += tokens[rid] == ref.argmax(-1).tolist()
        print(f"{mode}: worst |logprob - peft's| {worst:.2g}, greedy tokens equal {equal}/{len(batch)}", flush=True)
    return 0


WORDS = "the quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing matches".split()


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--rows", default="16,32,64,128,256,512,1024,2048", help="comma-separated M (tokens)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (torch's and the native GEMM's)")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per candidate; the best counts")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--steps", metavar="MODEL_DIR", help="time engine prefill steps of this checkpoint instead")
    ap.add_argument("--prompts", default="64,128,256,512", help="--steps: comma-separated prompt lengths (tokens)")
    ap.add_argument("--decodes", default="0,16", help="--steps: comma-separated counts of sequences decoding beside")
    ap.add_argument("--exact", metavar="MODEL_DIR", help="numerics of each prefill_dtype against peft instead")
    ap.add_argument("--adapters", default="", help="--exact: comma-separated name=PEFT dir")
    ap.add_argument("--scale", type=int, default=1, help="--exact: prompt length multiplier")
    ap.add_argument("--max-tokens", type=int, default=16, help="--exact: greedy tokens a sequence")
    args = ap.parse_args(argv)
    if args.steps:
        return main_steps(args)
    if args.exact:
        return main_exact(args)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, oneDNN "
          f"{torch.backends.mkldnn.is_available()}, AMX tiles {torch.cpu._is_amx_tile_supported()}, "
          f"AVX-512 BF16 {torch.cpu._is_avx512_bf16_supported()}, native panels {cpu_native.panels_native()}, "
          f"our AMX-BF16 tiles {kernels.bf16_tiles()}")
    results = []
    torch.manual_seed(0)
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        kernels.set_native_threads(threads)
        for shape in args.shapes.split(","):
            n, k = SHAPES[shape]
            w32 = torch.randn(n, k) * k**-0.5
            panels = (kernels.linear_pack(w32, half=True), kernels.linear_pack(w32, half=False)) \
                if cpu_native.panels_native() else (None, None)
            fns = candidates(n, k, *panels, w32, w32.to(torch.bfloat16))
            print(f"\n{shape} (N {n}, K {k}), {threads} thread(s): GFLOP/s, best of {args.repeats}")
            print(f"{'M':>6}  " + "  ".join(f"{name:>26}" for name in fns))
            for m in rows:
                x = torch.randn(m, k)
                best = {name: float("inf") for name in fns}
                for _ in range(args.repeats):  # the candidates take turns
                    for name, fn in fns.items():
                        best[name] = min(best[name], bench(fn, x, 1))
                flops = 2 * m * n * k
                print(f"{m:>6}  " + "  ".join(f"{flops / best[name] / 1e9:>26.1f}" for name in fns), flush=True)
                results.append({"threads": threads, "shape": shape, "n": n, "k": k, "m": m,
                                "seconds": best, "gflops": {name: flops / s / 1e9 for name, s in best.items()}})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
