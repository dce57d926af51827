"""Quantized linear layers at Llama-3-8B's shapes against the HBM roofline for each format's bytes (issue 41).

For each shape (in x out: 4096x4096 q/o_proj, 4096x14336 gate/up, 14336x4096 down, 4096x128256 lm_head) and
batch (rows of x: 1, 16, 64), random weights, each call captured in a CUDA graph (as decode runs it) and its
replays timed with CUDA events over cold-L2 runs (median):
  bf16            torch's GEMM on bf16 weights (the unquantized base);
  fp8, int4       kernels.fp8_linear / w4a16_linear as the model calls them (impl auto: the GEMV up to 8 rows,
                  the tensor-core GEMM above) and each impl forced: gemv, gemm, dequant (W dequantized into a
                  bf16 scratch, then torch's GEMM: "dequantize-then-bf16-GEMM"); fp8 also scaled_mm
                  (torch._scaled_mm, per-row e4m3 activations) where the device serves it.
Each row reports ms, GB/s of the format's bytes (weights + scales + zeros + x + out) and their fraction of
the peak (--peak-gbs, else from the device's memory clock and bus width) and the time against bf16. Before the
timings every impl is checked against the reference (max error relative to the largest output). Prints a
table and the JSON (--json writes it too; $OUT/quant_gemm.json when $OUT is set).

    python benchmarks/quant_gemm.py [--batches 1 16 64] [--iters 20] [--peak-gbs 4800] [--json out.json]
    python benchmarks/quant_gemm.py --device cpu --shapes 96x80 --batches 1 9   # the CPU shim: the driver runs
    python benchmarks/quant_gemm.py --ptx   # no GPU: PTX instructions per weight of the GEMV loops (NVRTC)
INT4 weights: groups of 128, scales in bf16 (the activation dtype: the packed dequantization); FP8: per
output channel.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
SHAPES_8B = ("4096x4096", "4096x14336", "14336x4096", "4096x128256")
GROUP = 128
IMPLS = {"fp8": ("auto", "gemv", "gemm", "dequant", "scaled_mm"), "int4": ("auto", "gemv", "gemm", "dequant")}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda (the figures), or cpu: the kernels on the CPU shim at tiny shapes (a smoke run)")
    p.add_argument("--shapes", nargs="+", default=None, help="in x out (default: Llama-3-8B's; cpu: 96x80)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64], help="rows of x")
    p.add_argument("--iters", type=int, default=20, help="timed runs per measurement (median)")
    p.add_argument("--peak-gbs", type=float, default=None, help="HBM peak in GB/s (default: from the device)")
    p.add_argument("--budget-s", type=float, default=240.0, help="stop measuring after this long")
    p.add_argument("--json", type=Path, default=None, help="write the results here too")
    p.add_argument("--ptx", action="store_true",
                   help="only count the PTX instructions per weight of each GEMV's main loop (NVRTC, no GPU)")
    args = p.parse_args(argv)
    if args.shapes is None:
        args.shapes = list(SHAPES_8B) if args.device == "cuda" else ["96x80"]
    return args


def shape_of(text: str) -> tuple[int, int]:
    """'in x out' -> (K, N)."""
    k, n = (int(v) for v in text.lower().split("x"))
    return k, n


def format_bytes(fmt: str, m: int, k: int, n: int, group: int = GROUP) -> int:
    """Bytes one call must move: the weights in the format (with scales and zeros), x and out in bf16."""
    weights = {"bf16": 2 * n * k, "fp8": n * k + 4 * n,
               "int4": n * -(-k // 2) + 3 * n * -(-k // group)}[fmt]  # int4: bf16 scales + uint8 zeros
    return weights + 2 * m * k + 2 * m * n


def make_weights(fmt: str, k: int, n: int, device: str, gen: torch.Generator):
    """The kernel arguments after x (bias None) of a random weight in fmt."""
    if fmt == "bf16":
        return ((torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16).to(device),)
    if fmt == "fp8":
        w = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        return w.to(device), (torch.rand(n, generator=gen) * 1e-3 + 1e-4).to(device), None, None
    groups = -(-k // GROUP)
    q = torch.randint(0, 256, (n, -(-k // 2)), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, groups, generator=gen) * 0.01 + 1e-3).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (n, groups), generator=gen, dtype=torch.uint8)
    return q.to(device), scales.to(device), zeros.to(device), GROUP, None


class Timer:
    """Median ms of fn: on CUDA, fn captured in a CUDA graph (as decode runs; no host launch time between the
    events) replayed over cold-L2 runs, timed with CUDA events (eager when it cannot be captured); perf_counter on
    the CPU. `how` says which the last measurement used."""

    def __init__(self, device: str, iters: int):
        self.device, self.iters, self.how = device, iters, "cpu"
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if device == "cuda" else None

    def _graph(self, fn):
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            torch.cuda.synchronize()
            return graph.replay
        except Exception as err:  # noqa: BLE001 - time it eagerly instead
            print(f"note: not capturable ({type(err).__name__}: {err}); timed eagerly", file=sys.stderr)
            torch.cuda.synchronize()
            return None

    def ms(self, fn) -> float:
        for _ in range(2 if self.device == "cuda" else 1):
            fn()
        run = fn
        if self.device == "cuda":
            torch.cuda.synchronize()
            replay = self._graph(fn)
            run, self.how = (replay, "graph") if replay else (fn, "eager")
        times = []
        for _ in range(self.iters):
            if self.flush is None:
                start = time.perf_counter()
                run()
                times.append((time.perf_counter() - start) * 1e3)
                continue
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]


def calls(kernels, quant_launch, reference, fmt, weights, device):
    """impl -> fn(x) for fmt on device (impls the device cannot run left out), and the reference."""
    runner = None
    if device == "cpu":
        from loraplex.kernels.cpu_runner import CpuRunner

        runner = CpuRunner()
    if fmt == "bf16":
        return {"torch": lambda x: torch.nn.functional.linear(x, weights[0])}, None
    launcher = quant_launch.fp8_linear if fmt == "fp8" else quant_launch.w4a16_linear
    out = {}
    for impl in IMPLS[fmt]:
        if impl == "scaled_mm" and not (device == "cuda" and quant_launch.scaled_mm_serves(
                torch.empty(1, weights[0].shape[1], dtype=torch.bfloat16, device=device), weights[0], None)):
            continue
        options = {"impl": impl} if runner is None else {"impl": impl, "runner": runner}
        out[impl] = (lambda o: lambda x: launcher(x, *weights, **o))(options)
    ref = reference.fp8_linear if fmt == "fp8" else reference.w4a16_linear
    return out, lambda x: ref(x.cpu(), *(w.cpu() if isinstance(w, torch.Tensor) else w for w in weights))


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest error relative to the largest expected magnitude."""
    return ((got.float().cpu() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-30)).item()


def run(args) -> dict:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_kernels import import_kernels

    kernels = import_kernels()
    from loraplex.kernels import quant_launch, reference

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --device cpu for the shim)")
    from hbm_peak import peak_gbs  # a sibling: benchmarks/ is on sys.path when run

    peak, peak_source = peak_gbs(args.peak_gbs, args.device)
    timer = Timer(args.device, args.iters)
    deadline = time.monotonic() + args.budget_s
    gen = torch.Generator().manual_seed(0)
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (shim)", "peak_gbs": peak,
              "peak_source": peak_source, "group_size": GROUP, "rows": [], "numerics": []}
    for text in args.shapes:
        k, n = shape_of(text)
        for fmt in ("bf16", "fp8", "int4"):
            weights = make_weights(fmt, k, n, args.device, gen)
            fns, ref = calls(kernels, quant_launch, reference, fmt, weights, args.device)
            for m in args.batches:
                if time.monotonic() > deadline:
                    report["stopped"] = f"budget of {args.budget_s} s spent"
                    return report
                x = (torch.randn(m, k, generator=gen)).to(torch.bfloat16).to(args.device)
                want = ref(x) if ref is not None and n * k <= 4096 * 14336 else None
                for impl, fn in fns.items():
                    if want is not None:
                        report["numerics"].append({"shape": text, "format": fmt, "batch": m, "impl": impl,
                                                   "max_error": max_error(fn(x), want)})
                    ms = timer.ms(lambda: fn(x))
                    nbytes = format_bytes(fmt, m, k, n)
                    gbs = nbytes / (ms * 1e-3) / 1e9
                    report["rows"].append({"shape": text, "format": fmt, "batch": m, "impl": impl, "ms": ms,
                                           "bytes": nbytes, "gbs": gbs, "peak_fraction": gbs / peak,
                                           "timed": timer.how})
    bf16 = {(r["shape"], r["batch"]): r["ms"] for r in report["rows"] if r["format"] == "bf16"}
    for r in report["rows"]:
        r["vs_bf16"] = bf16.get((r["shape"], r["batch"]), math.nan) / r["ms"]
    return report


def print_table(report: dict) -> None:
    print(f"device {report['device']}: peak {report['peak_gbs']:.0f} GB/s ({report['peak_source']})")
    print(f"{'shape':>12} {'fmt':>5} {'batch':>5} {'impl':>10} {'ms':>9} {'GB/s':>8} {'peak':>6} {'x bf16':>7}")
    for r in report["rows"]:
        print(f"{r['shape']:>12} {r['format']:>5} {r['batch']:>5} {r['impl']:>10} {r['ms']:9.4f} {r['gbs']:8.1f} "
              f"{r['peak_fraction']:6.2f} {r.get('vs_bf16', math.nan):7.2f}")
    worst = max((e["max_error"] for e in report["numerics"]), default=math.nan)
    print(f"numerics: {len(report['numerics'])} checks against the reference, worst relative error {worst:.2e}")


PTX_GEMVS = (  # (activations, weight format): the per-weight cost of each dequantization path
    ("__nv_bfloat16", "Int4Weights<__nv_bfloat16>"), ("__half", "Int4Weights<__half>"),
    ("__nv_bfloat16", "Int4Weights<__half>"), ("__nv_bfloat16", "Fp8Weights"), ("__half", "Fp8Weights"))


def ptx_per_weight(arch: str = "sm_90") -> list[dict]:
    """PTX instructions (moves and address conversions left out) of the largest basic block of each one-row
    GEMV -- its vectorized main loop, one 16-byte load of each of its rows of W -- per weight it dequantizes."""
    import re

    from loraplex.kernels import nvrtc_check
    from loraplex.kernels.sources import expanded_source

    nvrtc = nvrtc_check.load_nvrtc()
    from loraplex.kernels.quant_launch import GEMV_ROWS, GEMV_THREADS

    rows_per_warp = GEMV_ROWS // (GEMV_THREADS // 32)
    rows = []
    for dtype, fmt in PTX_GEMVS:
        name = f"quant_gemv<{dtype}, {fmt}, 1>"
        prog = nvrtc.createProgram(expanded_source("quant_linear.cu"), "quant_linear.cu", [], [])
        try:
            nvrtc.addNameExpression(prog, name)
            nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", "-std=c++17"])
            ptx = nvrtc.getPTX(prog)
        finally:
            nvrtc.destroyProgram(prog)
        ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
        blocks, label = {}, None
        for line in ptx.splitlines():
            start = re.match(r"^(\$L__BB\d+_\d+):", line)
            if start:
                label = start.group(1)
            elif label and re.match(r"^\s+[a-z]", line) and not re.match(r"^\s+(mov|cvt\.u32\.u64|cvta)", line):
                blocks[label] = blocks.get(label, 0) + 1
        weights = rows_per_warp * 16 * (2 if fmt.startswith("Int4") else 1)
        rows.append({"kernel": name, "arch": arch, "loop_instructions": max(blocks.values()), "weights": weights,
                     "per_weight": max(blocks.values()) / weights})
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.ptx:
        rows = ptx_per_weight()
        for r in rows:
            print(f"{r['kernel']:>52}: {r['loop_instructions']} PTX instructions / {r['weights']} weights = "
                  f"{r['per_weight']:.1f}")
        print(json.dumps(rows, indent=1))
        return 0
    report = run(args)
    print_table(report)
    text = json.dumps(report, indent=1)
    print(text)
    path = args.json or (Path(os.environ["OUT"]) / "quant_gemm.json" if os.environ.get("OUT") else None)
    if path:
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
