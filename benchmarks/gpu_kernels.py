"""GPU kernel benchmark: numerics vs the torch reference, then bandwidth and time vs torch baselines.

Runs in-process on one CUDA device (no Triton). Sections:
  1. numerics: every kernel (all dtypes) against backend/kernels/reference.py on the GPU;
  2. prefill attention: tiled kernel vs gather + SDPA vs torch's varlen_attn over the paged cache (which
     default to use);
  3. paged-attention decode at 7B-class shapes: achieved memory bandwidth as a fraction
     of the device peak, and time vs gather + torch SDPA;
  4. BGMV shrink + expand (hidden 4096, ranks 8-64): bandwidth and time vs gather + bmm, at
     every instantiated tile (tokens per block: which default to use).
Before 2-4, the LoRA variants (issue 34, decision 057) on Llama-3-8B's q/k/v at batches 1-256: tile 1 vs 4,
per-module launches vs the fused group, the shrink tiled vs split-K; % of HBM for the adapter bytes read.
Prints a table per section; writes JSON to --out, or to $OUT/gpu_kernels.json when $OUT
is set. Stops adding measurements once --budget-s seconds have passed (default 240).
Usage: python benchmarks/gpu_kernels.py [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
NO_GPU_EXIT = 2
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
HIDDEN, NUM_ADAPTERS = 4096, 16


@dataclass(frozen=True, slots=True)
class DecodeShape:
    """One decode measurement: batch sequences of context tokens, 7B-class heads."""

    batch: int
    context: int
    num_q_heads: int = NUM_Q_HEADS
    num_kv_heads: int = NUM_KV_HEADS
    head_dim: int = HEAD_DIM
    block_size: int = BLOCK_SIZE


@dataclass(frozen=True, slots=True)
class BgmvShape:
    """One BGMV measurement: batch tokens over NUM_ADAPTERS adapters of the given ranks."""

    batch: int
    ranks: tuple[int, ...]
    hidden: int = HIDDEN


@dataclass(frozen=True, slots=True)
class PrefillShape:
    """One prefill measurement: seqs chunks of new tokens after prefix cached tokens."""

    seqs: int
    new_tokens: int
    prefix: int


def import_kernels():
    """loraplex.kernels, installed or (without an install) loaded from this checkout's backend/kernels/."""
    try:
        import loraplex.kernels as kernels

        return kernels
    except ImportError:
        pass
    import types

    if "loraplex" not in sys.modules:
        root = types.ModuleType("loraplex")
        root.__path__ = []
        sys.modules["loraplex"] = root
    spec = importlib.util.spec_from_file_location(
        "loraplex.kernels", REPO / "backend" / "kernels" / "__init__.py",
        submodule_search_locations=[str(REPO / "backend" / "kernels")]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["loraplex.kernels"] = module
    spec.loader.exec_module(module)
    return module


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer shapes and iterations")
    p.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--lora-batches", type=int, nargs="*", default=[1, 16, 64, 256],
                   help="batches of the LoRA variants section (none: skip it)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    p.add_argument("--peak-gbs", type=float, default=None, help="device peak memory bandwidth, GB/s")
    p.add_argument("--budget-s", type=float, default=240.0, help="stop measuring after this long")
    p.add_argument("--out", type=Path, default=None, help="JSON file (default $OUT/gpu_kernels.json)")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.contexts, args.ranks, args.iters = [64, 256], [512, 4096], [8, 64], 10
    return args


def decode_shapes(batches, contexts) -> list[DecodeShape]:
    """Decode shapes: every batch x context."""
    return [DecodeShape(b, c) for b in batches for c in contexts]


def bgmv_shapes(batches, ranks) -> list[BgmvShape]:
    """BGMV shapes: every batch x uniform rank, plus one mixed-rank set per batch."""
    shapes = [BgmvShape(b, (r,) * NUM_ADAPTERS) for b in batches for r in ranks]
    mixed = tuple(ranks[i % len(ranks)] for i in range(NUM_ADAPTERS))
    return shapes + [BgmvShape(b, mixed) for b in batches]


def prefill_shapes(quick: bool) -> list[PrefillShape]:
    """Prefill chunk shapes."""
    shapes = [PrefillShape(1, 2048, 0), PrefillShape(4, 512, 1024), PrefillShape(8, 128, 2048)]
    return shapes[:2] if quick else shapes


def decode_bytes(s: DecodeShape, elem: int) -> int:
    """Bytes decode must move: K and V of every context token, q and out."""
    kv = s.batch * s.context * s.num_kv_heads * s.head_dim * 2 * elem
    return kv + 2 * s.batch * s.num_q_heads * s.head_dim * elem


def bgmv_bytes(s: BgmvShape, used_slots: list[int], elem: int) -> int:
    """Bytes shrink + expand must move: x, used A/B rows, v (twice), y read and written."""
    max_rank = max(s.ranks)
    weights = sum(2 * s.ranks[slot] * s.hidden for slot in used_slots) * elem
    return (s.batch * s.hidden + 2 * s.batch * max_rank + 2 * s.batch * s.hidden) * elem + weights


def out_path(args) -> Path | None:
    """Where the JSON goes, if anywhere."""
    if args.out:
        return args.out
    env = os.environ.get("OUT")
    return Path(env) / "gpu_kernels.json" if env else None


class Timer:
    """Times GPU work with CUDA events, L2 flushed before each run."""

    def __init__(self, iters: int):
        self.iters = iters
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def ms(self, fn) -> float:
        """Median milliseconds of fn over iters cold-L2 runs (after 3 warm-ups)."""
        for _ in range(3):
            fn()
        times = []
        for _ in range(self.iters):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]


def paged(shape: DecodeShape, dtype, contexts, device="cuda"):
    """Random paged K/V with shuffled block tables for the given context lengths."""
    per_seq = [math.ceil(c / shape.block_size) for c in contexts]
    width = max(per_seq)
    num_blocks = sum(per_seq)
    k = torch.randn(num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    tables = torch.zeros(len(contexts), width, dtype=torch.int32, device=device)
    pos = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = perm[pos : pos + n]
        pos += n
    lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    return k, v, tables, lens


def numerics(dtypes) -> list[dict]:
    """Max abs error of every kernel vs the reference, each dtype; small varied shapes."""
    from loraplex.kernels import cache_launch, decode_launch, lora_launch, prefill_launch, reference
    from loraplex.kernels.instances import BGMV_TILES

    rows = []
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 8e-2}

    def record(kernel, dtype, got, want):
        err = (got.float() - want.float()).abs().max().item()
        scale = max(1.0, want.float().abs().max().item())
        ok = err <= tol[dtype] * scale
        rows.append({"kernel": kernel, "dtype": str(dtype).split(".")[-1], "max_abs_err": err, "ok": ok})

    for dtype in dtypes:
        g = torch.Generator(device="cuda").manual_seed(0)
        rn = lambda *s: torch.randn(*s, generator=g, device="cuda").to(dtype)  # noqa: E731
        ranks = torch.tensor([8, 1, 64, 16], dtype=torch.int32, device="cuda")
        scales = torch.tensor([0.5, 1.0, 2.0, 0.25], device="cuda")
        a, b = rn(4, 64, 512), rn(4, 384, 64)
        slots = torch.randint(-1, 4, (37,), generator=g, device="cuda", dtype=torch.int32)
        x, y, vv = rn(37, 512), rn(37, 384), rn(37, 64)
        want = reference.lora_shrink_bgmv(x, a, slots, ranks)
        want_y = reference.lora_expand_bgmv(y.clone(), vv, b, slots, ranks, scales)
        for tile in BGMV_TILES:
            record(f"shrink_bgmv tile={tile}", dtype, lora_launch.lora_shrink_bgmv(x, a, slots, ranks, tile=tile), want)
            record(f"expand_bgmv tile={tile}", dtype,
                   lora_launch.lora_expand_bgmv(y.clone(), vv, b, slots, ranks, scales, tile=tile), want_y)
        stacks = [(a, b, ranks, scales), (rn(4, 64, 512), rn(4, 128, 64), ranks.flip(0), scales.flip(0)),
                  (rn(4, 64, 512), rn(4, 96, 64), ranks.roll(1), scales)]
        ga, gb, gr, gs = (list(col) for col in zip(*stacks))
        record("shrink_bgmv_group", dtype, lora_launch.lora_shrink_bgmv_group(x, ga, slots, gr),
               reference.lora_shrink_bgmv_group(x, ga, slots, gr))
        gv, base = rn(37, 3 * 64), rn(37, 384 + 128 + 96)
        want_g, got_g = base.clone(), base.clone()
        reference.lora_expand_bgmv_group(gv, list(want_g.split([384, 128, 96], 1)), gb, slots, gr, gs)
        lora_launch.lora_expand_bgmv_group(gv, list(got_g.split([384, 128, 96], 1)), gb, slots, gr, gs)
        record("expand_bgmv_group", dtype, got_g, want_g)
        for splits in (2, 3):
            record(f"shrink_bgmv split={splits}", dtype,
                   lora_launch.lora_shrink_bgmv(x, a, slots, ranks, splits=splits), want)
        starts = torch.tensor([0, 10, 10, 30, 37], dtype=torch.int32, device="cuda")
        seg = torch.tensor([2, 0, -1, 3], dtype=torch.int32, device="cuda")
        want = reference.lora_shrink_sgmv(x, a, starts, seg, ranks)
        record("shrink_sgmv", dtype, lora_launch.lora_shrink_sgmv(x, a, starts, seg, ranks), want)
        record("expand_sgmv", dtype, lora_launch.lora_expand_sgmv(y.clone(), vv, b, starts, seg, ranks, scales),
               reference.lora_expand_sgmv(y.clone(), vv, b, starts, seg, ranks, scales))
        shape = DecodeShape(5, 0)
        k, v, tables, lens = paged(shape, dtype, [1, 16, 17, 700, 2100])
        q = rn(5, NUM_Q_HEADS, HEAD_DIM)
        want = reference.paged_attention_decode(q, k, v, tables, lens, HEAD_DIM**-0.5)
        for splits in (1, 4, None):
            got = decode_launch.paged_attention_decode(q, k, v, tables, lens, HEAD_DIM**-0.5, num_splits=splits)
            record(f"decode splits={splits or 'auto'}", dtype, got, want)
        k, v, tables, lens = paged(shape, dtype, [40, 300, 17, 1, 90])
        cu = torch.tensor([0, 40, 140, 157, 158, 178], dtype=torch.int32, device="cuda")
        q = rn(178, NUM_Q_HEADS, HEAD_DIM)
        want = reference.paged_attention_prefill(q, k, v, tables, cu, lens, HEAD_DIM**-0.5)
        for impl in prefill_launch.IMPLS:
            try:
                got = prefill_launch.paged_attention_prefill(q, k, v, tables, cu, lens, HEAD_DIM**-0.5, impl=impl)
            except Exception as exc:  # noqa: BLE001 - varlen (Flash Attention) takes fp16/bf16 only: not a failure
                rows.append({"kernel": f"prefill {impl}", "dtype": str(dtype).split(".")[-1], "max_abs_err": None,
                             "ok": None if impl == "varlen" else False, "error": f"{type(exc).__name__}: {exc}"[:300]})
                continue
            record(f"prefill {impl}", dtype, got, want)
        kc, vc = torch.zeros_like(k), torch.zeros_like(v)
        kr, vr = kc.clone(), vc.clone()
        slot_map = torch.tensor([3, -1, 40, 77, 5], device="cuda")
        newk, newv = rn(5, NUM_KV_HEADS, HEAD_DIM), rn(5, NUM_KV_HEADS, HEAD_DIM)
        cache_launch.write_kv(kc, vc, newk, newv, slot_map)
        reference.write_kv(kr, vr, newk, newv, slot_map)
        record("write_kv", dtype, torch.stack([kc, vc]), torch.stack([kr, vr]))
        kv = rn(2, 2, 8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        kv_ref = kv.clone()
        src, dst = torch.tensor([0, 3], device="cuda"), torch.tensor([5, 6], device="cuda")
        cache_launch.copy_blocks(kv, src, dst)
        reference.copy_blocks(kv_ref, src, dst)
        record("copy_blocks", dtype, kv, kv_ref)
    torch.cuda.synchronize()
    return rows


def bench_decode(shapes, dtype, timer, peak, deadline) -> list[dict]:
    """Decode kernel bandwidth and time vs gather + SDPA."""
    import torch.nn.functional as F

    from loraplex.kernels import decode_launch

    rows = []
    for s in shapes:
        if time.monotonic() > deadline:
            break
        k, v, tables, lens = paged(s, dtype, [s.context] * s.batch)
        q = torch.randn(s.batch, s.num_q_heads, s.head_dim, device="cuda", dtype=dtype)
        scale = s.head_dim**-0.5
        kernel_ms = timer.ms(lambda: decode_launch.paged_attention_decode(q, k, v, tables, lens, scale))

        def baseline():
            kk = k[tables.long()].flatten(1, 2)[:, : s.context].transpose(1, 2)
            vv = v[tables.long()].flatten(1, 2)[:, : s.context].transpose(1, 2)
            return F.scaled_dot_product_attention(q.unsqueeze(2), kk, vv, scale=scale, enable_gqa=True)

        base_ms = timer.ms(baseline)
        gbs = decode_bytes(s, k.element_size()) / (kernel_ms * 1e-3) / 1e9
        rows.append({**asdict(s), "kernel_ms": kernel_ms, "torch_ms": base_ms, "speedup": base_ms / kernel_ms,
                     "gbs": gbs, "peak_fraction": gbs / peak})
        k = v = None  # the next shape's tensors get the memory
    return rows


def bench_bgmv(shapes, dtype, timer, peak, deadline) -> list[dict]:
    """BGMV shrink + expand bandwidth and time vs gather + bmm (padded to the max rank); kernel_ms at the default
    tile (tokens per block), tile<N>_ms at the other instantiated tiles (random slots: runs of one are the rule)."""
    from loraplex.kernels import lora_launch
    from loraplex.kernels.instances import BGMV_TILES

    rows = []
    for s in shapes:
        if time.monotonic() > deadline:
            break
        max_rank = max(s.ranks)
        a = torch.randn(NUM_ADAPTERS, max_rank, s.hidden, device="cuda", dtype=dtype) * 0.02
        b = torch.randn(NUM_ADAPTERS, s.hidden, max_rank, device="cuda", dtype=dtype) * 0.02
        ranks = torch.tensor(s.ranks, dtype=torch.int32, device="cuda")
        scales = torch.ones(NUM_ADAPTERS, device="cuda")
        slots = torch.randint(0, NUM_ADAPTERS, (s.batch,), device="cuda", dtype=torch.int32)
        x = torch.randn(s.batch, s.hidden, device="cuda", dtype=dtype)
        y = torch.zeros(s.batch, s.hidden, device="cuda", dtype=dtype)

        def kernel(tile=lora_launch.BGMV_TILE):
            v = lora_launch.lora_shrink_bgmv(x, a, slots, ranks, tile=tile)
            lora_launch.lora_expand_bgmv(y, v, b, slots, ranks, scales, tile=tile)

        def baseline():
            idx = slots.long()
            v = torch.bmm(a[idx], x.unsqueeze(2))  # [T, R, 1]
            y.add_(torch.bmm(b[idx], v).squeeze(2))

        kernel_ms = timer.ms(kernel)
        tile_ms = {tile: timer.ms(lambda: kernel(tile)) for tile in BGMV_TILES if tile != lora_launch.BGMV_TILE}
        base_ms = timer.ms(baseline)
        used = sorted(set(slots.tolist()))
        gbs = bgmv_bytes(s, used, x.element_size()) / (kernel_ms * 1e-3) / 1e9
        rank_label = str(s.ranks[0]) if len(set(s.ranks)) == 1 else "mixed " + "/".join(map(str, sorted(set(s.ranks))))
        rows.append({"batch": s.batch, "ranks": rank_label, "hidden": s.hidden, "kernel_ms": kernel_ms,
                     **{f"tile{tile}_ms": ms for tile, ms in tile_ms.items()}, "torch_ms": base_ms,
                     "speedup": base_ms / kernel_ms, "gbs": gbs, "peak_fraction": gbs / peak})
    return rows


def qkv_adapter_bytes(ranks_used: list[int], h_in: int, outs: tuple[int, ...], elem: int) -> int:
    """Adapter bytes a q/k/v group's shrink + expand must read: each used slot's A rows (one per module) and
    B columns at its rank."""
    return sum(r * (len(outs) * h_in + sum(outs)) for r in ranks_used) * elem


def bench_lora_variants(batches, rank, dtype, timer, peak, deadline, adapters=32, device="cuda") -> list[dict]:
    """The LoRA kernel variants on Llama-3-8B's q/k/v (4096 -> 4096/1024/1024), rank `rank`, `adapters` adapters
    (random slots): per-module launches at tile 4 and tile 1, the fused group at both tiles, and the shrink alone
    tiled vs split-K (choose_splits); each time with the % of HBM bandwidth for the adapter bytes read. device
    cpu: the shim (a test's smoke run)."""
    from loraplex.kernels import lora_launch

    h_in, outs = 4096, (4096, 1024, 1024)
    rows = []
    a = [torch.randn(adapters, rank, h_in, device=device, dtype=dtype) * 0.02 for _ in outs]
    b = [torch.randn(adapters, h, rank, device=device, dtype=dtype) * 0.02 for h in outs]
    ranks = [torch.full((adapters,), rank, dtype=torch.int32, device=device) for _ in outs]
    scales = [torch.ones(adapters, device=device) for _ in outs]
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 1
    for batch in batches:
        if time.monotonic() > deadline:
            break
        slots = torch.randint(0, adapters, (batch,), device=device, dtype=torch.int32)
        x = torch.randn(batch, h_in, device=device, dtype=dtype)
        out = torch.zeros(batch, sum(outs), device=device, dtype=dtype)
        ys = list(out.split(list(outs), 1))

        def separate(tile):
            for g in range(len(outs)):
                v = lora_launch.lora_shrink_bgmv(x, a[g], slots, ranks[g], tile=tile, splits=1)
                lora_launch.lora_expand_bgmv(ys[g], v, b[g], slots, ranks[g], scales[g], tile=tile)

        def group(tile):
            v = lora_launch.lora_shrink_bgmv_group(x, a, slots, ranks, tile=tile)
            lora_launch.lora_expand_bgmv_group(v, ys, b, slots, ranks, scales, tile=tile)

        times = {f"tile{t}_ms": timer.ms(lambda t=t: separate(t)) for t in (1, 4)}  # the prepared tile 1 first
        times |= {f"group_tile{t}_ms": timer.ms(lambda t=t: group(t)) for t in (1, 4)}
        splits = lora_launch.choose_splits(batch, rank, h_in, sm_count)
        times["shrink_ms"] = timer.ms(lambda: lora_launch.lora_shrink_bgmv(x, a[0], slots, ranks[0], splits=1))
        times["shrink_split_ms"] = timer.ms(
            lambda: lora_launch.lora_shrink_bgmv(x, a[0], slots, ranks[0], splits=max(2, splits)))
        used = len(set(slots.tolist()))
        group_bytes = qkv_adapter_bytes([rank] * used, h_in, outs, x.element_size())
        shrink_bytes = used * rank * h_in * x.element_size()
        frac = lambda nbytes, ms: nbytes / (ms * 1e-3) / 1e9 / peak  # noqa: E731
        best = min(times["group_tile1_ms"], times["group_tile4_ms"])
        rows.append({"batch": batch, "rank": rank, "used_adapters": used, **times, "splits": max(2, splits),
                     "auto_splits": splits, "tile1_hbm": frac(group_bytes, times["tile1_ms"]),
                     "tile4_hbm": frac(group_bytes, times["tile4_ms"]), "group_hbm": frac(group_bytes, best),
                     "shrink_hbm": frac(shrink_bytes, times["shrink_ms"]),
                     "shrink_split_hbm": frac(shrink_bytes, times["shrink_split_ms"])})
    return rows


def bench_prefill(shapes, dtype, timer, deadline) -> list[dict]:
    """Prefill: tiled kernel vs gather + SDPA vs varlen_attn."""
    from loraplex.kernels import prefill_launch

    rows = []
    for s in shapes:
        if time.monotonic() > deadline:
            break
        ctx = s.prefix + s.new_tokens
        k, v, tables, lens = paged(DecodeShape(s.seqs, ctx), dtype, [ctx] * s.seqs)
        cu = torch.arange(0, s.seqs + 1, device="cuda", dtype=torch.int32) * s.new_tokens
        q = torch.randn(s.seqs * s.new_tokens, NUM_Q_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
        times = {}
        for impl in prefill_launch.IMPLS:
            args = (q, k, v, tables, cu, lens, HEAD_DIM**-0.5)
            try:
                times[impl] = timer.ms(lambda: prefill_launch.paged_attention_prefill(*args, impl=impl))
            except Exception as exc:  # noqa: BLE001 - a candidate this device or dtype cannot run
                print(f"prefill {impl} {s}: {type(exc).__name__}: {exc}"[:300])
        rows.append({**asdict(s), **{f"{impl}_ms": times.get(impl) for impl in prefill_launch.IMPLS},
                     "faster": min(times, key=times.get)})
    return rows


def print_table(title: str, rows: list[dict]) -> None:
    """A plain aligned table."""
    print(f"\n== {title}")
    if not rows:
        print("(nothing measured)")
        return
    cols = list(rows[0])
    cells = [[f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for row in cells:
        print("  ".join(x.rjust(w) for x, w in zip(row, widths)))


def main(argv=None) -> int:
    """Run every section; 0 when all numerics pass, 1 when some fail, 2 without a GPU."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device available; nothing to measure (run this on a GPU machine).", file=sys.stderr)
        return NO_GPU_EXIT
    deadline = time.monotonic() + args.budget_s
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)
    from hbm_peak import peak_gbs  # a sibling: benchmarks/ is on sys.path when run

    peak, peak_source = peak_gbs(args.peak_gbs)
    report = {"device": torch.cuda.get_device_name(), "peak_gbs": peak, "peak_source": peak_source,
              "dtype": args.dtype, "torch": torch.__version__}
    print(f"device {report['device']}: peak {peak:.0f} GB/s ({peak_source})")
    import_kernels()
    report["numerics"] = numerics((torch.float32, torch.float16, torch.bfloat16))
    print_table("numerics vs reference", report["numerics"])
    timer = Timer(args.iters)
    if args.lora_batches:  # first: the LoRA variants of issue 34 (decision 057)
        report["lora_variants"] = bench_lora_variants(args.lora_batches, args.lora_rank, dtype, timer, peak, deadline)
        print_table(f"LoRA q/k/v variants (8B shapes, rank {args.lora_rank}; *_hbm: fraction of peak for the adapter "
                    "bytes read)", report["lora_variants"])
    report["prefill"] = bench_prefill(prefill_shapes(args.quick), dtype, timer, deadline)  # first: it picks a default
    print_table("prefill attention: tiled kernel vs gather+SDPA vs varlen_attn", report["prefill"])
    report["decode"] = bench_decode(decode_shapes(args.batches, args.contexts), dtype, timer, peak, deadline)
    print_table("paged-attention decode (Hq 32, Hkv 8, D 128, block 16)", report["decode"])
    report["bgmv"] = bench_bgmv(bgmv_shapes(args.batches, args.ranks), dtype, timer, peak, deadline)
    print_table(f"BGMV shrink+expand (hidden {HIDDEN}, {NUM_ADAPTERS} adapters)", report["bgmv"])
    report["elapsed_s"] = args.budget_s - (deadline - time.monotonic())
    path = out_path(args)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
        print(f"\nwrote {path}")
    return 0 if all(r["ok"] is not False for r in report["numerics"]) else 1  # None: a candidate that cannot run


if __name__ == "__main__":
    sys.exit(main())
