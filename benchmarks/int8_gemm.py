"""Int8 weights in the native CPU GEMM (decision 071) against fp16 and fp32 panels, and the exactness of the
VNNI path's activation split on SmolLM2.

    python benchmarks/int8_gemm.py [--part gemm,exact] [--rows 1,16,64,256] [--threads 1,2] [--rounds 3]
                                   [--parts 2,3] [--tokens 1024]

gemm   One pass over SmolLM2-135M's 30 layers of projections (q/k/v and gate/up fused) plus its lm_head (distinct
       weights: the model's own working set), and Llama-3-8B's shapes one at a time ([N, K] 4096x4096: q/o;
       14336x4096: up; 4096x14336: down) over copies of at least 768 MiB, so their weights come from memory as an
       8B model's do. Each at M rows and each thread count: int8 on AMX (from lp_int8_amx_min_rows rows, VNNI
       below), int8 on VNNI (the library's parts; --parts builds the other part counts beside it), int8 with
       the weights converted to fp32 (the path without VNNI), fp16 panels, fp32 panels. ms per pass, GB/s of weights read, GFLOP/s. Each round alternates the variants; the
       best round is reported (on a shared machine other processes only ever add time).
exact  SmolLM2-135M-Instruct's linear layers (lm_head too) quantized to int8 per channel (models.quant), run by
       packed_linear over int8 panels on each path, against the same model on the dequantized weights in fp32
       (transformers' own forward: the oracle of the tests): logits teacher-forced over the first --tokens
       tokens of benchmarks/data/alice-chapter-1.txt (max and mean |difference|, argmax agreement), and 48 greedy
       tokens from 4 prompts (tokens equal to the oracle's). "q8_0" is llama.cpp's activation scheme for
       comparison (one int8 part per 32 inputs, simulated in torch).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOL = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down_proj": (576, 1536)}
SMOL_LAYERS, SMOL_VOCAB = 30, 49152
LLAMA8B = {"q/o 4096x4096": (4096, 4096), "up 14336x4096": (14336, 4096), "down 4096x14336": (4096, 14336)}
BYTES = {"vnni": 1, "cvt": 1, "fp16": 2, "fp32": 4}
TEXT = ROOT / "benchmarks" / "data" / "alice-chapter-1.txt"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three laws of thermodynamics"]


@contextlib.contextmanager
def using(lib):
    """cpu_native's wrappers calling lib (a build with other flags) instead of the library."""
    from loraplex.kernels import cpu_native

    saved = cpu_native.library
    cpu_native.library = lambda: lib
    try:
        yield
    finally:
        cpu_native.library = saved


def variant_libs(parts: list[int]) -> dict:
    """name -> (library, int8 level): AMX (from lp_int8_amx_min_rows rows; VNNI below), VNNI with each part
    count (vnni = the library's own), and the fallback."""
    from loraplex.kernels import cpu_native

    lib = cpu_native.library()
    own = lib.lp_int8_parts()
    libs = {}
    if lib.lp_int8_isa() >= cpu_native.INT8_AMX:
        libs["amx"] = (lib, cpu_native.INT8_AMX)
    if lib.lp_int8_isa() >= cpu_native.INT8_VNNI:
        libs["vnni"] = (lib, cpu_native.INT8_VNNI)
        for p in parts:
            if p != own:
                libs[f"vnni{p}"] = (cpu_native.load(cpu_native.build((*cpu_native.C_FLAGS, f"-DI8_PARTS={p}"))),
                                    cpu_native.INT8_VNNI)
    libs["cvt"] = (lib, cpu_native.INT8_CVT)
    return libs


def timed(fns: dict, rounds: int, budget_s: float = 0.2) -> dict:
    """name -> best seconds per call over rounds, the functions alternated within each round (each at least
    budget_s a round, or one call)."""
    reps = {}
    for name, fn in fns.items():
        fn()
        start = time.perf_counter()
        fn()
        reps[name] = max(1, int(budget_s / max(time.perf_counter() - start, 1e-6)))
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(reps[name]):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / reps[name])
    return best


def gemm_part(rows_list: list[int], threads_list: list[int], rounds: int, parts: list[int], shapes: list[str]) -> None:
    import torch

    from loraplex.kernels import cpu_native

    libs = variant_libs(parts)
    print(f"gemm: int8 paths {', '.join(libs)} (vnni: {cpu_native.library().lp_int8_parts()} parts); "
          f"panel width {cpu_native.library().lp_gemm_panel_width()}")
    gen = torch.Generator().manual_seed(0)

    def layers(shapes: list[tuple[int, int]], min_bytes: int = 0) -> dict:
        """kind -> the weights of shapes packed as that kind (random, about unit outputs), repeated until they
        hold min_bytes of that kind."""
        out = {}
        for kind, size in (("int8", 1), ("fp16", 2), ("fp32", 4)):
            total = sum(n * k for n, k in shapes) * size
            out[kind] = []
            for _ in range(max(1, -(-min_bytes // total))):
                for n, k in shapes:
                    w = torch.randn(n, k, generator=gen) * k**-0.5
                    if kind == "int8":
                        scale = w.abs().amax(1) / 127
                        out[kind].append(cpu_native.Panels.int8(torch.round(w / scale[:, None]).to(torch.int8),
                                                                scale))
                    else:
                        out[kind].append(cpu_native.Panels(w, half=kind == "fp16"))
        return out

    def run(label: str, weights: dict, per_pass: int, elems: int) -> None:
        """Each pass: the next per_pass weights of the list (all of them, or one copy of several in turn)."""
        for m in rows_list:
            xs = {k: torch.randn(m, k, generator=gen) for k in {p.in_features for p in weights["fp32"]}}
            for threads in threads_list:
                fns = {}
                for name in [*libs, "fp16", "fp32"]:
                    ws = weights["int8" if name in libs else name]
                    lib, level = libs[name] if name in libs else (cpu_native.library(), None)

                    def one_pass(ws=ws, at=[0], lib=lib, level=level):
                        with using(lib):
                            lib.lp_set_threads(threads)
                            lib.lp_int8_force(cpu_native.INT8_AMX if level is None else level)
                            for _ in range(per_pass):
                                w = ws[at[0] % len(ws)]
                                at[0] += 1
                                cpu_native.packed_linear(xs[w.in_features], w)
                            lib.lp_int8_force(99)
                            lib.lp_set_threads(0)

                    fns[name] = one_pass
                results = timed(fns, rounds)
                cells = "  ".join(f"{name} {t * 1e3:8.2f} ms {elems * BYTES.get(name, 1) / t / 1e9:5.1f} GB/s "
                                  f"{2 * elems * m / t / 1e9:6.1f} GF/s" for name, t in results.items())
                print(f"{label:>16} M={m:<4} t={threads}  {cells}", flush=True)

    if "smollm2" in shapes:
        smol = layers([*list(SMOL.values()) * SMOL_LAYERS, (SMOL_VOCAB, 576)])
        run("SmolLM2 pass", smol, len(smol["fp32"]), sum(w.out_features * w.in_features for w in smol["fp32"]))
        del smol
    if "llama8b" in shapes:
        for label, (n, k) in LLAMA8B.items():  # >= 768 MiB of each kind: more than this machine's 480 MB L3
            run(label, layers([(n, k)], 768 << 20), 1, n * k)


def exact_part(tokens: int, parts: list[int]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loraplex.kernels import cpu_native
    from loraplex.launch.serve import builtin_model
    from loraplex.models.quant.quantize import quantize_int8

    model_dir = builtin_model("smollm2")[0]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    linears = {name: mod for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}
    packed = {}
    for name, mod in linears.items():  # a tied lm_head shares the embedding: both read the dequantized values
        form = quantize_int8(mod.weight.data)
        mod.weight.data.copy_(form.qweight.float() * form.scale[:, None])
        packed[name] = cpu_native.Panels.int8(form.qweight, form.scale)
    text = TEXT.read_text() if TEXT.exists() else " ".join(PROMPTS) * 200
    ids = tok(text, return_tensors="pt").input_ids[:, :tokens]
    prompts = [tok(p, return_tensors="pt").input_ids for p in PROMPTS]

    def run():
        with torch.no_grad():
            logits = model(ids).logits[0].float()
            greedy = [model.generate(p, max_new_tokens=48, do_sample=False)[0, p.shape[1]:] for p in prompts]
        return logits, greedy

    def patched(linear_fn):
        saved = {name: mod.forward for name, mod in linears.items()}
        for name, mod in linears.items():
            mod.forward = (lambda x, name=name: linear_fn(name, x))
        try:
            return run()
        finally:
            for name, mod in linears.items():
                mod.forward = saved[name]

    def native(name, x):
        shape = x.shape
        return cpu_native.packed_linear(x.reshape(-1, shape[-1]), packed[name]).view(*shape[:-1], -1)

    def q8_0(name, x):
        shape, mod = x.shape, linears[name]
        blocks = x.reshape(-1, shape[-1] // 32, 32)
        s = blocks.abs().amax(-1, keepdim=True) / 127
        xq = torch.where(s > 0, torch.round(blocks / s.clamp(min=1e-30)) * s, torch.zeros_like(blocks))
        return torch.nn.functional.linear(xq.reshape(shape), mod.weight)

    oracle, oracle_greedy = run()
    spread = float(oracle.std())
    print(f"exact: SmolLM2 int8 per channel, {ids.shape[1]} tokens teacher-forced (logits' std {spread:.2f}), "
          f"{len(prompts)} x 48 greedy tokens; against transformers on the dequantized weights in fp32")
    print(f"{'path':>8} {'max |dlogit|':>13} {'mean |dlogit|':>14} {'argmax agree':>13} {'greedy equal':>13}")
    variants = {name: (lib, level) for name, (lib, level) in variant_libs(parts).items()}
    rows = [(name, lambda n, x, lib=lib, level=level: _with(lib, level, native, n, x))
            for name, (lib, level) in variants.items()]
    rows.append(("q8_0", q8_0))
    for name, fn in rows:
        logits, greedy = patched(fn)
        diff = (logits - oracle).abs()
        agree = float((logits.argmax(-1) == oracle.argmax(-1)).float().mean())
        equal = sum(int(torch.equal(g, o)) for g, o in zip(greedy, oracle_greedy))
        print(f"{name:>8} {float(diff.max()):>13.2e} {float(diff.mean()):>14.2e} {agree:>12.2%} "
              f"{equal:>10}/{len(prompts)}", flush=True)


def _with(lib, level, fn, name, x):
    with using(lib):
        lib.lp_int8_force(level)
        try:
            return fn(name, x)
        finally:
            lib.lp_int8_force(99)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", default="gemm,exact", help="parts to run: gemm, exact (comma-separated)")
    ap.add_argument("--rows", default="1,16,64,256", help="gemm: row counts M")
    ap.add_argument("--threads", default="1,2", help="gemm: native thread counts")
    ap.add_argument("--rounds", type=int, default=3, help="gemm: alternated rounds (best reported)")
    ap.add_argument("--parts", default="", help="VNNI part counts to build beside the library's (e.g. 1,2)")
    ap.add_argument("--tokens", type=int, default=1024, help="exact: teacher-forced tokens of the text")
    ap.add_argument("--shapes", default="smollm2,llama8b", help="gemm: smollm2, llama8b")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    parts = [int(p) for p in args.parts.split(",") if p]
    todo = args.part.split(",")
    if "gemm" in todo:
        gemm_part([int(r) for r in args.rows.split(",")], [int(t) for t in args.threads.split(",")], args.rounds,
                  parts, args.shapes.split(","))
    if "exact" in todo:
        exact_part(args.tokens, parts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
