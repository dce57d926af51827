"""The kernels' torch reference (loraplex.kernels.reference, itself the optimized CPU path) against a naive oracle.

The oracle is written here from the math, in float64, one sequence / row at a time: K and V gathered by hand
from the block table (position p of sequence b is row p % block_size of block block_tables[b, p // block_size]),
scores by einsum, softmax as exp(s - max) / sum, LoRA as A[slot, :rank] @ x and B[slot, :, :rank] @ v per row,
RMSNorm, SiLU and RoPE from their formulas. Inputs are random in fp32, fp16 and bf16 (the oracle reads the same
rounded values); every cache slot outside a context, every LoRA entry at or beyond a slot's rank and every row
without an adapter holds NaN, so a read of something that must not be read shows up.

Tolerance: |reference - oracle| <= TOL[dtype] * max(1, max |oracle|), with TOL about two units in the last place
of fp16 / bf16 (the reference rounds its fp32 result to the input dtype, some ops twice), and 1e-5 for fp32
(summation order). RoPE's tables are themselves rounded to the dtype, so it gets ROPE_UNITS times that.
The reference's CPU paths are each taken in turn (monkeypatching its path switches).
"""

from __future__ import annotations

import math

import pytest
import torch

from kernel_cases import DTYPE_IDS, DTYPES, paged_cache, randn
from loraplex.kernels import reference

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
ROPE_UNITS = 3
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)


def assert_matches(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, units: float = 1.0) -> None:
    """got (the reference, in dtype) within units * TOL[dtype] * max(1, max |want|) of want (float64)."""
    assert got.dtype == dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    assert torch.isfinite(got).all(), "the reference read a NaN it must never read"
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    err = (got.double() - want).abs().max().item() if want.numel() else 0.0
    assert err <= units * TOL[dtype] * scale, f"max error {err:.3g} > {units * TOL[dtype] * scale:.3g}"


# ---- attention ---------------------------------------------------------------------------------


def gather(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """Rows 0..length-1 of one sequence's K or V [length, Hkv, D] in float64, followed through its block table."""
    block_size = cache.shape[1]
    rows = [cache[int(table[p // block_size]), p % block_size] for p in range(length)]
    return torch.stack(rows).double() if rows else cache.new_zeros(0, *cache.shape[2:]).double()


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int], scale: float) -> torch.Tensor:
    """q [Lq, Hq, D] at cache positions; query i sees keys 0..positions[i]; query head h uses KV head
    h // (Hq / Hkv). Returns [Lq, Hq, D] float64."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, Hq, D]
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    visible = torch.arange(k.shape[0])[None, :] <= torch.tensor(positions)[:, None]  # [Lq, L]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    weights = torch.exp(scores - scores.max(dim=-1, keepdim=True).values)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return torch.einsum("hqk,khd->qhd", weights, v)


def oracle_decode(q, cache, scale) -> torch.Tensor:
    """Each sequence's one query over its whole context (an empty context gives zeros)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, n in enumerate(cache.context_lens.tolist()):
        if n:
            k, v = (gather(c, cache.block_tables[b], n) for c in (cache.k_cache, cache.v_cache))
            out[b] = attend(q[b][None], k, v, [n - 1], scale)[0]
    return out


def oracle_prefill(q, cache, new_tokens: list[int], scale) -> torch.Tensor:
    """Sequence b's new tokens are the last new_tokens[b] of its context, each seeing its prefix and itself."""
    out, row = torch.zeros(q.shape, dtype=torch.float64), 0
    for b, (n, c) in enumerate(zip(cache.context_lens.tolist(), new_tokens)):
        if c:
            k, v = (gather(x, cache.block_tables[b], n) for x in (cache.k_cache, cache.v_cache))
            out[row : row + c] = attend(q[row : row + c], k, v, list(range(n - c, n)), scale)
        row += c
    return out


# How the reference attends: its CPU decode way ("each", "buckets", "padded"), and for the padded batch
# (which is also what prefill uses) whether every KV head goes through one matmul or one loop step each.
PATHS = {
    "each": dict(CPU_DECODE="each"),
    "buckets": dict(CPU_DECODE="buckets"),
    "padded-all-heads": dict(CPU_DECODE="padded", _ALL_HEADS_ELEMENTS=1 << 40),
    "padded-per-head": dict(CPU_DECODE="padded", _ALL_HEADS_ELEMENTS=0),
}


@pytest.fixture(params=list(PATHS))
def path(request, monkeypatch) -> str:
    for name, value in PATHS[request.param].items():
        monkeypatch.setattr(reference, name, value)
    return request.param


@dtypes
@pytest.mark.parametrize("group", [1, 4], ids=["mha", "gqa4"])
def test_paged_decode_attention(path, dtype, group):
    gen = torch.Generator().manual_seed(1)
    head_dim, block_size = 32, 4
    # empty, one token, one block minus one, exactly one block, one past it, several blocks
    cache = paged_cache([0, 1, 3, 4, 5, 23], 2, head_dim, block_size, dtype, gen)
    q = randn(6, 2 * group, head_dim, dtype=dtype, gen=gen)
    scale = head_dim**-0.5
    got = reference.paged_attention_decode(q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens,
                                           scale)
    assert_matches(got, oracle_decode(q, cache, scale), dtype)


@dtypes
def test_paged_decode_attention_one_stream(dtype):
    """One sequence: the reference's own fast path (fused attention over exactly its context)."""
    gen = torch.Generator().manual_seed(2)
    cache = paged_cache([37], 2, 64, 8, dtype, gen)
    q = randn(1, 4, 64, dtype=dtype, gen=gen)
    got = reference.paged_attention_decode(q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens,
                                           0.125)
    assert_matches(got, oracle_decode(q, cache, 0.125), dtype)


@dtypes
@pytest.mark.parametrize("group", [1, 2], ids=["mha", "gqa2"])
def test_paged_prefill_attention(path, dtype, group):
    gen = torch.Generator().manual_seed(3)
    head_dim, block_size = 16, 4
    # (context, new tokens): a whole prompt, a chunk after a cached prefix, one token, a decode-like
    # row, a sequence without new tokens this step, a longer chunk crossing several blocks
    seqs = [(5, 5), (13, 4), (1, 1), (9, 1), (6, 0), (21, 11)]
    cache = paged_cache([n for n, _ in seqs], 2, head_dim, block_size, dtype, gen)
    new = [c for _, c in seqs]
    cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32)
    q = randn(sum(new), 2 * group, head_dim, dtype=dtype, gen=gen)
    scale = 0.3  # not head_dim ** -0.5: any scale must be applied as given
    got = reference.paged_attention_prefill(q, cache.k_cache, cache.v_cache, cache.block_tables, cu,
                                            cache.context_lens, scale)
    assert_matches(got, oracle_prefill(q, cache, new, scale), dtype)


@dtypes
def test_paged_prefill_attention_one_query(dtype):
    """One sequence with one new token: the prefill's fused-attention branch."""
    gen = torch.Generator().manual_seed(4)
    cache = paged_cache([10], 1, 32, 4, dtype, gen)
    q = randn(1, 3, 32, dtype=dtype, gen=gen)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    got = reference.paged_attention_prefill(q, cache.k_cache, cache.v_cache, cache.block_tables, cu,
                                            cache.context_lens, 0.2)
    assert_matches(got, oracle_prefill(q, cache, [1], 0.2), dtype)


def test_the_attention_oracle_is_what_it_says():
    """Hand-checked: equal keys give the mean of the visible values; a query sees no key past its position."""
    k = torch.ones(3, 1, 2, dtype=torch.float64)
    v = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]], [[5.0, 5.0]]], dtype=torch.float64)
    q = torch.ones(2, 1, 2, dtype=torch.float64)
    out = attend(q, k, v, [0, 1], 0.5)
    assert torch.equal(out[:, 0], torch.tensor([[1.0, 0.0], [0.5, 0.5]], dtype=torch.float64))
    cache = torch.arange(2 * 2 * 1 * 1, dtype=torch.float32).view(2, 2, 1, 1)  # block 1 holds rows 2, 3
    assert gather(cache, torch.tensor([1, 0]), 3).flatten().tolist() == [2.0, 3.0, 0.0]


# ---- LoRA shrink / expand (BGMV per row, SGMV per segment) --------------------------------------


def lora_inputs(num_rows, ranks, dtype, gen, h_in=48, h_out=40, max_rank=16):
    """A [S, R, H_in] and B [S, H_out, R] with NaN at and beyond each slot's rank; scales; ranks int32."""
    a = randn(len(ranks), max_rank, h_in, dtype=dtype, gen=gen)
    b = randn(len(ranks), h_out, max_rank, dtype=dtype, gen=gen)
    for s, r in enumerate(ranks):
        a[s, r:] = float("nan")
        b[s, :, r:] = float("nan")
    scales = torch.rand(len(ranks), generator=gen) + 0.5
    return a, b, torch.tensor(ranks, dtype=torch.int32), scales


def adapted(slot: int, ranks: list[int]) -> bool:
    return slot >= 0 and ranks[slot] > 0


def oracle_shrink(x, a, slots: list[int], ranks: list[int]) -> torch.Tensor:
    """out[t, :r] = A[s, :r] @ x[t] for row t's slot s of rank r; zeros elsewhere."""
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    for t, s in enumerate(slots):
        if adapted(s, ranks):
            r = ranks[s]
            out[t, :r] = a[s, :r].double() @ x[t].double()
    return out


def oracle_expand(y, v, b, slots: list[int], ranks: list[int], scales) -> torch.Tensor:
    """y[t] + scale[s] * B[s, :, :r] @ v[t, :r] for row t's slot s of rank r; y[t] elsewhere."""
    out = y.double().clone()
    for t, s in enumerate(slots):
        if adapted(s, ranks):
            r = ranks[s]
            out[t] += float(scales[s]) * (b[s, :, :r].double() @ v[t, :r].double())
    return out


def poisoned_rows(rows, width, slots, ranks, dtype, gen, past_rank=False):
    """Random rows, NaN where they must not be read: rows without an adapter, and (past_rank: expand's v)
    entries at or beyond the row's rank."""
    x = randn(rows, width, dtype=dtype, gen=gen)
    for t, s in enumerate(slots):
        if not adapted(s, ranks):
            x[t] = float("nan")
        elif past_rank:
            x[t, ranks[s]:] = float("nan")
    return x


RANKS = [8, 16, 0, 4, 8]  # slot 2 does not adapt this module (rank 0); slots 0 and 4 share a rank
BGMV_SLOTS = [1, -1, 0, 4, 0, 3, 2, 1, -1, 3, 0, 4, 1, 1, 4]


@dtypes
def test_lora_bgmv(dtype):
    gen = torch.Generator().manual_seed(5)
    a, b, ranks_t, scales = lora_inputs(len(BGMV_SLOTS), RANKS, dtype, gen)
    slots_t = torch.tensor(BGMV_SLOTS, dtype=torch.int32)
    x = poisoned_rows(len(BGMV_SLOTS), a.shape[2], BGMV_SLOTS, RANKS, dtype, gen)
    got = reference.lora_shrink_bgmv(x, a, slots_t, ranks_t)
    assert_matches(got, oracle_shrink(x, a, BGMV_SLOTS, RANKS), dtype)
    v = poisoned_rows(len(BGMV_SLOTS), a.shape[1], BGMV_SLOTS, RANKS, dtype, gen, past_rank=True)
    y = randn(len(BGMV_SLOTS), b.shape[1], dtype=dtype, gen=gen)
    got = reference.lora_expand_bgmv(y.clone(), v, b, slots_t, ranks_t, scales)
    assert_matches(got, oracle_expand(y, v, b, BGMV_SLOTS, RANKS, scales), dtype)


@dtypes
def test_lora_sgmv(dtype):
    gen = torch.Generator().manual_seed(6)
    num_rows = 14
    # rows 0-1 in no segment, 2-4 slot 1, an empty segment of slot 0, 5-8 slot 3, 9-10 slot 2 (rank 0),
    # 11 slot 4, 12 slot 0, 13 after the last segment
    starts, seg_slots = [2, 5, 5, 9, 11, 12, 13], [1, 0, 3, 2, 4, 0]
    slots = [-1] * num_rows
    for g, s in enumerate(seg_slots):
        for t in range(starts[g], starts[g + 1]):
            slots[t] = s
    a, b, ranks_t, scales = lora_inputs(num_rows, RANKS, dtype, gen)
    starts_t, seg_t = torch.tensor(starts, dtype=torch.int32), torch.tensor(seg_slots, dtype=torch.int32)
    x = poisoned_rows(num_rows, a.shape[2], slots, RANKS, dtype, gen)
    got = reference.lora_shrink_sgmv(x, a, starts_t, seg_t, ranks_t)
    assert_matches(got, oracle_shrink(x, a, slots, RANKS), dtype)
    v = poisoned_rows(num_rows, a.shape[1], slots, RANKS, dtype, gen, past_rank=True)
    y = randn(num_rows, b.shape[1], dtype=dtype, gen=gen)
    got = reference.lora_expand_sgmv(y.clone(), v, b, starts_t, seg_t, ranks_t, scales)
    assert_matches(got, oracle_expand(y, v, b, slots, RANKS, scales), dtype)


# ---- RMSNorm, SiLU, RoPE --------------------------------------------------------------------------


@dtypes
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add-norm"])
def test_add_rms_norm(dtype, residual):
    """x (+= delta, in place) then x / sqrt(mean(x^2) + eps) * weight."""
    gen = torch.Generator().manual_seed(7)
    eps = 1e-5
    x = randn(9, 64, dtype=dtype, gen=gen) * 3
    delta = randn(9, 64, dtype=dtype, gen=gen) if residual else None
    weight = (torch.rand(64, generator=gen) + 0.5).to(dtype)
    s = x.double() + (delta.double() if residual else 0)
    want = weight.double() * s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    got = reference.add_rms_norm(x, delta, weight, eps)
    assert_matches(got, want, dtype)
    assert_matches(x, s, dtype)  # the residual sum, in place


@dtypes
def test_silu_mul(dtype):
    gen = torch.Generator().manual_seed(8)
    gate, up = randn(7, 96, dtype=dtype, gen=gen) * 4, randn(7, 96, dtype=dtype, gen=gen)
    g = gate.double()
    assert_matches(reference.silu_mul(gate, up), g / (1 + torch.exp(-g)) * up.double(), dtype)


@dtypes
def test_rotate_qk(dtype):
    """Pairs (i, i + D/2) rotated by pos * base^(-2i/D): (a, b) -> (a cos - b sin, b cos + a sin)."""
    gen = torch.Generator().manual_seed(9)
    head_dim, base, max_len = 32, 10_000.0, 80
    half = head_dim // 2
    angle = torch.arange(max_len, dtype=torch.float64)[:, None] * base ** (-torch.arange(half) * 2.0 / head_dim)
    cos = torch.cat([angle.cos(), angle.cos()], -1).to(dtype)  # the tables the model hands the op
    signed_sin = torch.cat([-angle.sin(), angle.sin()], -1).to(dtype)
    positions = torch.tensor([0, 1, 5, 17, 63, 40])
    q, k = randn(6, 4, head_dim, dtype=dtype, gen=gen), randn(6, 2, head_dim, dtype=dtype, gen=gen)

    def rotated(x):
        th = angle[positions][:, None]  # [T, 1, half]
        a, b = x.double()[..., :half], x.double()[..., half:]
        return torch.cat([a * th.cos() - b * th.sin(), b * th.cos() + a * th.sin()], -1)

    got_q, got_k = reference.rotate_qk(q, k, positions, cos, signed_sin)
    assert_matches(got_q, rotated(q), dtype, ROPE_UNITS)
    assert_matches(got_k, rotated(k), dtype, ROPE_UNITS)
    assert math.isclose(float(angle[63, 0]), 63.0)  # i = 0 turns by the position itself
