"""The native CPU ops (backend/kernels/cpu_native.c) against the torch path they replace, measured in one process.

    python benchmarks/cpu_native.py [--streams 1,16] [--rounds 3] [--gemm-rows 1,4,16,48,128,256] [--threads 1]

Two parts, each alternating its two sides round by round (best of each reported: on a shared
machine other processes only ever add time):

  gemm    SmolLM2-135M's 30 layers of fp16-weight projections (q/k/v and gate/up packed) plus
          its lm_head, at each row count: the native panel GEMM against FBGEMM's
          (torch.ops.quantized.linear_dynamic_fp16), random weights of the real shapes; GB/s
          is the fp16 weights' 271 MB over the time
  engine  SmolLM2 with weight_dtype float16, in-process (LLMEngine.generate), 64 greedy
          ignore_eos tokens per request, N requests at once: LORAPLEX_KERNELS=auto (native ops,
          native GEMM, one-call decode forward) against reference (torch ops, FBGEMM), two
          engines in one process
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down_proj": (576, 1536)}
LAYERS, VOCAB, WEIGHT_MB = 30, 49152, 271


def best_of(fns: dict, rounds: int, reps: int) -> dict:
    """name -> fastest mean ms over rounds, the functions alternated within each round."""
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / reps * 1e3)
    return best


def gemm_part(rows_list: list[int], rounds: int) -> None:
    import torch

    from loraplex.kernels import cpu_native, reference

    if not cpu_native.panels_native():
        print("gemm: no native fp16 GEMM on this CPU (no AVX-512 / AVX2+F16C+FMA, or no compiler)")
        return
    weights = {m: [torch.randn(n, k) * 0.05 for _ in range(LAYERS)] for m, (n, k) in SHAPES.items()}
    lm_head = torch.randn(VOCAB, 576) * 0.05
    ours = {m: [cpu_native.Panels(w) for w in ws] for m, ws in weights.items()}
    fbgemm = {m: [reference.fp16_linear_pack(w) for w in ws] for m, ws in weights.items()}
    ours_lm, fbgemm_lm = cpu_native.Panels(lm_head), reference.fp16_linear_pack(lm_head)
    print(f"gemm: SmolLM2's {LAYERS} layers + lm_head, fp16 weights ({WEIGHT_MB} MB), {torch.get_num_threads()} "
          "torch threads")
    print(f"{'rows':>5} {'native ms':>10} {'FBGEMM ms':>10} {'FBGEMM/native':>14} {'native GB/s':>12}")
    for rows in rows_list:
        xs = {m: torch.randn(rows, k) for m, (n, k) in SHAPES.items()}

        def native():
            for m in SHAPES:
                for w in ours[m]:
                    cpu_native.packed_linear(xs[m], w)
            cpu_native.packed_linear(xs["qkv"], ours_lm)

        def theirs():
            for m in SHAPES:
                for w in fbgemm[m]:
                    reference.fp16_linear(xs[m], w)
            reference.fp16_linear(xs["qkv"], fbgemm_lm)

        t = best_of({"native": native, "fbgemm": theirs}, rounds, 5 if rows < 100 else 2)
        print(f"{rows:>5} {t['native']:>10.1f} {t['fbgemm']:>10.1f} {t['fbgemm'] / t['native']:>13.2f}x "
              f"{WEIGHT_MB / t['native']:>12.1f}", flush=True)


def engine_part(streams: list[int], rounds: int) -> None:
    from serving import BASE_MODEL
    from triton_overhead import in_process, prompts_for

    from loraplex.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine
    from loraplex.kernels import dispatch
    from loraplex.launch.serve import builtin_model

    checkpoint = builtin_model("smollm2")[0]
    engines = {}
    for mode in ("auto", "reference"):
        dispatch.MODE = mode  # read when the model packs its weights and picks its ops
        engines[mode] = LLMEngine(EngineConfig.from_dict({"model_dir": str(checkpoint), "weight_dtype": "float16"}))
        in_process(engines[mode], prompts_for("smollm2", 2), [BASE_MODEL], 4, f"warm-{mode}")
    print("engine: SmolLM2 fp16 weights in-process, 64 tokens per request; best of", rounds)
    print(f"{'streams':>7} {'native tok/s':>13} {'reference tok/s':>16} {'native/reference':>17}")
    for n in streams:
        best = {"auto": 0.0, "reference": 0.0}
        for k in range(rounds):
            for mode, engine in engines.items():
                dispatch.MODE = mode
                best[mode] = max(best[mode], in_process(engine, prompts_for("smollm2", n), [BASE_MODEL], 64,
                                                        f"{n}-{k}-{mode}"))
        print(f"{n:>7} {best['auto']:>13.1f} {best['reference']:>16.1f} {best['auto'] / best['reference']:>16.2f}x",
              flush=True)
    dispatch.MODE = dispatch.read_mode()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="1,16", help="engine part: concurrent requests (empty: skip the part)")
    ap.add_argument("--gemm-rows", default="1,4,16,48,128,256", help="gemm part: row counts (empty: skip the part)")
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds per measurement (best reported)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default: 1, as served on 2 cores)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.gemm_rows:
        gemm_part([int(r) for r in args.gemm_rows.split(",")], args.rounds)
    if args.streams:
        engine_part([int(n) for n in args.streams.split(",")], args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
