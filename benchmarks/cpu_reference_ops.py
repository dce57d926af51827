"""CPU timings of the torch reference kernels: the per-sequence / per-adapter loops they replaced
("before", kept verbatim below as _loop_*) vs the vectorized backend/kernels/reference.py ("after").

    python benchmarks/cpu_reference_ops.py [--quick] [--threads N] [--rounds 7] [--json PATH]

On CPU the engine runs these references as its compute path, so their speed is the CPU
serving speed. Every case first checks that both versions agree in fp32 on inputs that
hold NaN wherever nothing may be read (cache slots outside the contexts, block-table
entries past them, A rows / B columns at or beyond each slot's rank), then times them
alternately (before, after, before, ...) for --rounds rounds and reports each one's fastest
round: on a shared machine other processes only ever add time. Runs under
torch.inference_mode like the engine. Cases:

  decode     paged attention, B = 32 / 128 sequences, contexts 64-512, Hq 8, Hkv 2, D 64,
             plus the engine's lora_throughput shape (B 32, contexts 33-64, 8/8 heads)
  prefill    4 sequences x 128 new tokens after a 64-token cached prefix; a mixed step
             (one 128-token chunk next to 31 decodes)
  bgmv       shrink + expand, T = 32 / 256 tokens, hidden 512, 32 slots of ranks 8-64,
             1 / 8 / 32 distinct adapters (round-robin)
  sgmv       shrink + expand, 512 tokens in 1 / 4 segments; 256 tokens in 32 segments
  lora layer one layer's 7 projections of the lora_throughput model (hidden 512,
             intermediate 1376, rank 16), T = 32, 1 / 8 / 32 adapters
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def import_reference():
    """loraplex.kernels.reference, installed or (without an install) loaded from this checkout."""
    try:
        from loraplex.kernels import reference

        return reference
    except ImportError:
        spec = importlib.util.spec_from_file_location("cpu_bench_reference", REPO / "backend" / "kernels" / "reference.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


# ---------------------------------------------------------------------------------------------
# Before: the loop implementations the vectorized references replaced (verbatim).
# ---------------------------------------------------------------------------------------------


def _loop_lora_shrink_bgmv(x, a_stack, token_slots, ranks):
    out = torch.zeros(x.shape[0], a_stack.shape[1], dtype=torch.float32, device=x.device)
    for slot in torch.unique(token_slots).tolist():
        if slot < 0:
            continue
        rows = (token_slots == slot).nonzero(as_tuple=True)[0]
        r = int(ranks[slot])
        out[rows, :r] = x[rows].float() @ a_stack[slot, :r].float().T
    return out.to(x.dtype)


def _loop_lora_expand_bgmv(y, v, b_stack, token_slots, ranks, scales):
    for slot in torch.unique(token_slots).tolist():
        if slot < 0:
            continue
        rows = (token_slots == slot).nonzero(as_tuple=True)[0]
        r = int(ranks[slot])
        delta = (v[rows, :r].float() @ b_stack[slot, :, :r].float().T) * float(scales[slot])
        y[rows] += delta.to(y.dtype)
    return y


def _loop_lora_shrink_sgmv(x, a_stack, seg_starts, seg_slots, ranks):
    out = torch.zeros(x.shape[0], a_stack.shape[1], dtype=torch.float32, device=x.device)
    starts = seg_starts.tolist()
    for g, slot in enumerate(seg_slots.tolist()):
        lo, hi = starts[g], starts[g + 1]
        if slot < 0 or hi <= lo:
            continue
        r = int(ranks[slot])
        out[lo:hi, :r] = x[lo:hi].float() @ a_stack[slot, :r].float().T
    return out.to(x.dtype)


def _loop_lora_expand_sgmv(y, v, b_stack, seg_starts, seg_slots, ranks, scales):
    starts = seg_starts.tolist()
    for g, slot in enumerate(seg_slots.tolist()):
        lo, hi = starts[g], starts[g + 1]
        if slot < 0 or hi <= lo:
            continue
        r = int(ranks[slot])
        delta = (v[lo:hi, :r].float() @ b_stack[slot, :, :r].float().T) * float(scales[slot])
        y[lo:hi] += delta.to(y.dtype)
    return y


def _loop_gather_context(cache, block_table, ctx_len):
    block_size = cache.shape[1]
    n_blocks = (ctx_len + block_size - 1) // block_size
    return cache[block_table[:n_blocks].long()].reshape(-1, *cache.shape[2:])[:ctx_len]


def _loop_attend(q, k, v, scale, q_positions):
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    key_pos = torch.arange(k.shape[0], device=q.device)
    mask = key_pos[None, :] > q_positions[:, None]
    scores.masked_fill_(mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)


def _loop_paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        k = _loop_gather_context(k_cache, block_tables[b], n)
        v = _loop_gather_context(v_cache, block_tables[b], n)
        pos = torch.tensor([n - 1], device=q.device)
        out[b : b + 1] = _loop_attend(q[b : b + 1], k, v, scale, pos)
    return out


def _loop_paged_attention_prefill(q, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale):
    out = torch.empty_like(q)
    cu = cu_query_lens.tolist()
    for b in range(len(cu) - 1):
        lo, hi = cu[b], cu[b + 1]
        if hi <= lo:
            continue
        n = int(context_lens[b])
        k = _loop_gather_context(k_cache, block_tables[b], n)
        v = _loop_gather_context(v_cache, block_tables[b], n)
        pos = torch.arange(n - (hi - lo), n, device=q.device)
        out[lo:hi] = _loop_attend(q[lo:hi], k, v, scale, pos)
    return out


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------

BLOCK_SIZE, HEAD_DIM = 16, 64
NUM_SLOTS, MAX_RANK = 32, 64
RANK_CYCLE = (8, 16, 32, 64)  # slot s has rank RANK_CYCLE[s % 4]


def paged_cache(contexts, num_kv_heads, gen):
    """K/V caches [blocks, 16, Hkv, 64] with each context at shuffled blocks; NaN everywhere else.

    Block-table entries past a sequence's last block point at an all-NaN block.
    """
    need = [math.ceil(n / BLOCK_SIZE) for n in contexts]
    num_blocks = sum(need) + 1
    order = torch.randperm(num_blocks, generator=gen).tolist()
    poison = order.pop()
    tables = torch.full((len(contexts), max(need) + 1), poison, dtype=torch.int32)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    k, v = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    for b, n in enumerate(contexts):
        for i in range(need[b]):
            blk = order.pop()
            tables[b, i] = blk
            used = min(BLOCK_SIZE, n - i * BLOCK_SIZE)
            k[blk, :used] = torch.randn(used, num_kv_heads, HEAD_DIM, generator=gen)
            v[blk, :used] = torch.randn(used, num_kv_heads, HEAD_DIM, generator=gen)
    return k, v, tables, torch.tensor(contexts, dtype=torch.int32)


def lora_stacks(h_in, h_out, ranks, gen):
    """A [S, R, h_in] / B [S, h_out, R] with NaN at and beyond each slot's rank; ranks; scales."""
    a = torch.randn(len(ranks), MAX_RANK, h_in, generator=gen)
    b = torch.randn(len(ranks), h_out, MAX_RANK, generator=gen) * 0.1
    for s, r in enumerate(ranks):
        a[s, r:] = float("nan")
        b[s, :, r:] = float("nan")
    scales = torch.rand(len(ranks), generator=gen) + 0.5
    return a, b, torch.tensor(ranks, dtype=torch.int32), scales


# ---------------------------------------------------------------------------------------------
# Cases: (name, before, after); each callable returns the output the check compares.
# ---------------------------------------------------------------------------------------------


def decode_case(ref, name, batch, lo, hi, num_q_heads, num_kv_heads, gen):
    contexts = torch.randint(lo, hi + 1, (batch,), generator=gen).tolist()
    k, v, tables, lens = paged_cache(contexts, num_kv_heads, gen)
    q = torch.randn(batch, num_q_heads, HEAD_DIM, generator=gen)
    args = (q, k, v, tables, lens, HEAD_DIM**-0.5)
    return name, lambda: _loop_paged_attention_decode(*args), lambda: ref.paged_attention_decode(*args)


def prefill_case(ref, name, query_lens, prefixes, num_q_heads, num_kv_heads, gen):
    contexts = [p + n for p, n in zip(prefixes, query_lens)]
    k, v, tables, lens = paged_cache(contexts, num_kv_heads, gen)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_q_heads, HEAD_DIM, generator=gen)
    args = (q, k, v, tables, cu, lens, HEAD_DIM**-0.5)
    return name, lambda: _loop_paged_attention_prefill(*args), lambda: ref.paged_attention_prefill(*args)


def bgmv_case(ref, name, tokens, distinct, gen, hidden=512):
    ranks = [RANK_CYCLE[s % len(RANK_CYCLE)] for s in range(NUM_SLOTS)]
    a, b, ranks_t, scales = lora_stacks(hidden, hidden, ranks, gen)
    slots = torch.tensor([t % distinct for t in range(tokens)], dtype=torch.int32)
    x = torch.randn(tokens, hidden, generator=gen)
    y0 = torch.randn(tokens, hidden, generator=gen)

    def run(shrink, expand):
        y = y0.clone()
        return expand(y, shrink(x, a, slots, ranks_t), b, slots, ranks_t, scales)

    return (name, lambda: run(_loop_lora_shrink_bgmv, _loop_lora_expand_bgmv),
            lambda: run(ref.lora_shrink_bgmv, ref.lora_expand_bgmv))


def sgmv_case(ref, name, tokens, segments, gen, hidden=512):
    ranks = [RANK_CYCLE[s % len(RANK_CYCLE)] for s in range(NUM_SLOTS)]
    a, b, ranks_t, scales = lora_stacks(hidden, hidden, ranks, gen)
    starts = torch.tensor([g * tokens // segments for g in range(segments + 1)], dtype=torch.int32)
    seg_slots = torch.tensor([g % NUM_SLOTS for g in range(segments)], dtype=torch.int32)
    x = torch.randn(tokens, hidden, generator=gen)
    y0 = torch.randn(tokens, hidden, generator=gen)

    def run(shrink, expand):
        y = y0.clone()
        return expand(y, shrink(x, a, starts, seg_slots, ranks_t), b, starts, seg_slots, ranks_t, scales)

    return (name, lambda: run(_loop_lora_shrink_sgmv, _loop_lora_expand_sgmv),
            lambda: run(ref.lora_shrink_sgmv, ref.lora_expand_sgmv))


def lora_layer_case(ref, name, tokens, distinct, gen, hidden=512, intermediate=1376, rank=16):
    """One decoder layer's 7 LoRA projections (q, k, v, o: hidden -> hidden; gate, up; down)."""
    shapes = [(hidden, hidden)] * 4 + [(hidden, intermediate)] * 2 + [(intermediate, hidden)]
    ranks = torch.full((NUM_SLOTS,), rank, dtype=torch.int32)
    scales = torch.rand(NUM_SLOTS, generator=gen) + 0.5
    mods = [(torch.randn(NUM_SLOTS, rank, i, generator=gen), torch.randn(NUM_SLOTS, o, rank, generator=gen) * 0.1,
             torch.randn(tokens, i, generator=gen), torch.randn(tokens, o, generator=gen)) for i, o in shapes]
    slots = torch.tensor([t % distinct for t in range(tokens)], dtype=torch.int32)

    def run(shrink, expand):
        return torch.cat([expand(y.clone(), shrink(x, a, slots, ranks), b, slots, ranks, scales)
                          for a, b, x, y in mods], dim=1)

    return (name, lambda: run(_loop_lora_shrink_bgmv, _loop_lora_expand_bgmv),
            lambda: run(ref.lora_shrink_bgmv, ref.lora_expand_bgmv))


def build_cases(ref, quick: bool):
    gen = torch.Generator().manual_seed(0)
    cases = [
        decode_case(ref, "decode B=32 ctx 64-512 Hq8/Hkv2", 32, 64, 512, 8, 2, gen),
        decode_case(ref, "decode B=128 ctx 64-512 Hq8/Hkv2", 128, 64, 512, 8, 2, gen),
        decode_case(ref, "decode B=32 ctx 33-64 Hq8/Hkv8 (engine)", 32, 33, 64, 8, 8, gen),
        prefill_case(ref, "prefill 4x128 new + 64 cached", [128] * 4, [64] * 4, 8, 2, gen),
        prefill_case(ref, "prefill 1x128 chunk + 31 decodes", [128] + [1] * 31,
                     [0] + torch.randint(64, 512, (31,), generator=gen).tolist(), 8, 2, gen),
    ]
    for tokens in (32, 256):
        for distinct in (1, 8, 32):
            cases.append(bgmv_case(ref, f"bgmv T={tokens} {distinct} adapters", tokens, distinct, gen))
    for tokens, segments in ((512, 1), (512, 4), (256, 32)):
        cases.append(sgmv_case(ref, f"sgmv T={tokens} {segments} segments", tokens, segments, gen))
    for distinct in (1, 8, 32):
        cases.append(lora_layer_case(ref, f"lora layer T=32 {distinct} adapters (engine)", 32, distinct, gen))
    if quick:
        keep = ("decode B=32 ctx 64", "prefill 4x128", "bgmv T=32 32", "bgmv T=256 1 ", "sgmv T=512 4")
        cases = [c for c in cases if c[0].startswith(keep)]
    return cases


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------


def check(name, before, after) -> float:
    """Max abs difference of the two outputs; raises if they disagree (or either holds NaN)."""
    want, got = before(), after()
    if got.isnan().any() or want.isnan().any():
        raise AssertionError(f"{name}: NaN in the output (a masked value leaked)")
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * scale, msg=lambda m: f"{name}: {m}")
    return (got - want).abs().max().item()


def timed(fn, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def measure(before, after, rounds: int, min_round_s: float) -> tuple[float, float]:
    """Fastest round of each, in seconds per call; rounds alternate before and after."""
    iters = []
    for fn in (before, after):
        fn()  # warm-up
        one = timed(fn, 1)
        iters.append(max(1, math.ceil(min_round_s / max(one, 1e-6))))
    best = [math.inf, math.inf]
    for _ in range(rounds):
        for i, fn in enumerate((before, after)):
            best[i] = min(best[i], timed(fn, iters[i]))
    return best[0], best[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a few cases, 3 rounds")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per case (fastest is reported)")
    p.add_argument("--min-round-ms", type=float, default=30.0, help="repeat calls so a round lasts this long")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--json", dest="json_path", type=Path, default=None, help="write the rows to this JSON file")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds = 3
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ref = import_reference()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, fastest of {args.rounds} rounds")
    header = f"{'case':44s} {'before ms':>10s} {'after ms':>10s} {'speedup':>8s} {'max |diff|':>11s}"
    print(header)
    print("-" * len(header))
    rows = []
    with torch.inference_mode():
        for name, before, after in build_cases(ref, args.quick):
            diff = check(name, before, after)
            t_before, t_after = measure(before, after, args.rounds, args.min_round_ms / 1e3)
            rows.append({"case": name, "before_ms": t_before * 1e3, "after_ms": t_after * 1e3,
                         "speedup": t_before / t_after, "max_abs_diff": diff})
            print(f"{name:44s} {t_before * 1e3:10.3f} {t_after * 1e3:10.3f} {t_before / t_after:7.2f}x {diff:11.2e}",
                  flush=True)
    if args.json_path:
        args.json_path.write_text(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                                              "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
