"""The native CPU ops (cpu_native.c) against the torch reference, and how dispatch routes to them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import loraplex.kernels as kernels
from kernel_cases import assert_close, paged_cache, randn
from loraplex.kernels import cpu_native, dispatch, reference


@pytest.fixture(scope="module", autouse=True)
def built():
    if cpu_native.library() is None:
        pytest.fail("the native CPU ops did not build (a C compiler is part of the test environment)")


def test_add_rms_norm_adds_in_place_and_matches_reference():
    gen = torch.Generator().manual_seed(0)
    fused = randn(5, 3 * 96, dtype=torch.float32, gen=gen) * 3
    x, delta = fused[:, :96], fused[:, 96:192]  # strided rows, as views of a fused projection's output
    weight = randn(96, dtype=torch.float32, gen=gen)
    x_ref = x.clone()
    want = reference.add_rms_norm(x_ref, delta.clone(), weight, 1e-6)
    got = cpu_native.add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(x, x_ref)  # the residual add, in place, rounds as torch's add
    assert_close(got, want, torch.float32)
    assert_close(cpu_native.add_rms_norm(x, None, weight, 1e-6), reference.add_rms_norm(x, None, weight, 1e-6),
                 torch.float32)


def test_silu_mul_matches_torch_over_the_whole_range():
    gate = torch.cat([torch.linspace(-120, 120, 4001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0])])
    gate = torch.stack([gate, gate.flip(0)])
    up = torch.linspace(-3, 3, gate.shape[1]).expand(2, -1).contiguous()
    got = cpu_native.silu_mul(gate, up)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=4e-7, atol=1e-30)


def test_silu_mul_propagates_nan():
    got = cpu_native.silu_mul(torch.tensor([[float("nan"), 1.0]]), torch.ones(1, 2))
    assert got[0, 0].isnan() and got[0, 1] == F.silu(torch.tensor(1.0))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotate_qk_in_place_gives_the_reference_values(head_dim):
    gen = torch.Generator().manual_seed(1)
    hq, hkv, t = 9, 3, 7
    fused = randn(t, (hq + 2 * hkv) * head_dim, dtype=torch.float32, gen=gen)
    q, k, _ = fused.split([hq * head_dim, hkv * head_dim, hkv * head_dim], dim=1)
    q, k = q.view(t, hq, head_dim), k.view(t, hkv, head_dim)
    angles = torch.outer(torch.arange(50.0), torch.rand(head_dim // 2, generator=gen))
    cos = torch.cat([angles.cos(), angles.cos()], dim=1)
    signed_sin = torch.cat([-angles.sin(), angles.sin()], dim=1)
    positions = torch.tensor([0, 3, 49, 7, 7, 20, 1])
    want_q, want_k = reference.rotate_qk(q.clone(), k.clone(), positions, cos, signed_sin)
    got_q, got_k = cpu_native.rotate_qk(q, k, positions, cos, signed_sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)  # no FMA contraction: torch's rounding


def test_rotate_qk_rejects_a_position_outside_the_tables():
    q, k = torch.ones(2, 2, 8), torch.ones(2, 1, 8)
    cos = signed_sin = torch.ones(4, 8)
    with pytest.raises(IndexError, match="outside the rotary tables"):
        cpu_native.rotate_qk(q, k, torch.tensor([1, 4]), cos, signed_sin)
    assert torch.equal(q, torch.ones(2, 2, 8))  # nothing rotated


def test_write_kv_skips_negative_slots_and_rejects_slots_past_the_cache():
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
    kv = randn(4, 2 * 2 * 8, dtype=torch.float32, gen=gen)
    k, v = (part.view(4, 2, 8) for part in kv.split(16, dim=1))
    slots = torch.tensor([5, -1, 0, 11])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(want_k, want_v, k, v, slots)
    cpu_native.write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    with pytest.raises(IndexError, match="past the cache"):
        cpu_native.write_kv(k_cache, v_cache, k, v, torch.tensor([0, 1, 2, 12]))
    assert torch.equal(k_cache, want_k)  # nothing written


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("threads", [1, 2])
def test_paged_decode_matches_reference_and_reads_only_the_context(group, threads):
    gen = torch.Generator().manual_seed(3)
    lens = [1, 15, 16, 17, 0, 90, 5]
    cache = paged_cache(lens, 2, 64, 16, torch.float32, gen)  # NaN everywhere outside the contexts
    q = randn(len(lens), 2 * group, 64, dtype=torch.float32, gen=gen)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.125)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_native.paged_attention_decode(*args)
    finally:
        torch.set_num_threads(before)
    assert not got.isnan().any()
    assert torch.equal(got[4], torch.zeros_like(got[4]))  # an empty context sees nothing
    assert_close(got, reference.paged_attention_decode(*args), torch.float32)


def test_paged_decode_takes_strided_queries():
    gen = torch.Generator().manual_seed(4)
    cache = paged_cache([9, 33], 1, 64, 8, torch.float32, gen)
    fused = randn(2, 4 * 64 + 10, dtype=torch.float32, gen=gen)
    q = fused[:, :256].view(2, 4, 64)
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.context_lens, 0.125)
    assert_close(cpu_native.paged_attention_decode(*args), reference.paged_attention_decode(*args), torch.float32)


def test_paged_decode_rejects_a_block_outside_the_cache():
    cache = paged_cache([5], 1, 64, 4, torch.float32, torch.Generator().manual_seed(5))
    tables = cache.block_tables.clone()
    tables[0, 1] = cache.k_cache.shape[0]
    with pytest.raises(IndexError, match="block table"):
        cpu_native.paged_attention_decode(torch.ones(1, 1, 64), cache.k_cache, cache.v_cache, tables,
                                          cache.context_lens, 1.0)


def test_dispatch_routes_fp32_cpu_calls_native_and_others_to_the_reference(monkeypatch):
    calls = []
    native = cpu_native.silu_mul
    monkeypatch.setattr(cpu_native, "silu_mul", lambda *a: calls.append(a) or native(*a))
    gate = torch.randn(2, 8)
    kernels.silu_mul(gate, gate)
    assert len(calls) == 1
    kernels.silu_mul(gate.half(), gate.half())  # fp16: not served natively
    kernels.silu_mul(gate.t(), gate.t())  # columns not contiguous
    assert len(calls) == 1
    monkeypatch.setattr(dispatch, "MODE", "reference")
    kernels.silu_mul(gate, gate)
    assert len(calls) == 1


@pytest.mark.parametrize(("cc", "why"), [("no-such-compiler-here", "no C compiler"), ("false", "false failed for")])
def test_build_failure_falls_back_to_the_reference(monkeypatch, caplog, cc, why):
    monkeypatch.setenv("CC", cc)  # none on PATH, or one whose compile fails
    cpu_native.library.cache_clear()
    try:
        assert cpu_native.library() is None
        assert "native CPU ops unavailable" in caplog.text and why in caplog.text
        gate = torch.randn(2, 8)
        torch.testing.assert_close(kernels.silu_mul(gate, gate), F.silu(gate) * gate)
    finally:
        cpu_native.library.cache_clear()
        monkeypatch.undo()
        assert cpu_native.library() is not None


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("half", [True, False], ids=["fp16", "fp32"])
def test_panel_gemm_matches_the_stored_weights(rows, threads, half):
    if not cpu_native.panels_native():
        pytest.skip("this CPU has no vector path for the native GEMM (FBGEMM and MKL serve it)")
    gen = torch.Generator().manual_seed(6)
    n, k = 3 * cpu_native.library().lp_gemm_panel_width() + 5, 200  # a partial last panel
    weight, bias = randn(n, k, dtype=torch.float32, gen=gen), randn(n, dtype=torch.float32, gen=gen)
    stored = (weight.half() if half else weight).double()  # the values the GEMM reads
    x = randn(rows, k + 3, dtype=torch.float32, gen=gen)[:, :k]  # strided rows
    packed = kernels.linear_pack(weight, bias, half=half)
    assert isinstance(packed, cpu_native.Panels)
    before = cpu_native.threads()
    cpu_native.set_threads(threads)
    try:
        got = kernels.packed_linear(x, packed)
    finally:
        cpu_native.set_threads(before)
    assert_close(got, torch.addmm(bias.double(), x.double(), stored.T).float(), torch.float32)
    no_bias = kernels.packed_linear(x.contiguous(), kernels.linear_pack(weight, half=half))
    assert_close(no_bias, (x.double() @ stored.T).float(), torch.float32)


def test_fp32_packing_needs_the_native_gemm(monkeypatch):
    monkeypatch.setattr(dispatch, "MODE", "reference")
    assert not isinstance(kernels.linear_pack(torch.ones(4, 4)), cpu_native.Panels)  # FBGEMM's fp16 packing
    with pytest.raises(ValueError, match="fp32 packing needs the native GEMM"):
        kernels.linear_pack(torch.ones(4, 4), half=False)


def _lora_stacks(num_slots, max_rank, k, n, ranks, gen):
    """Slot stacks as LoraSlots keeps them on the CPU: A [S, R, in], B.T [S, R, out], NaN past each rank."""
    a = randn(num_slots, max_rank, k, dtype=torch.float32, gen=gen)
    b_t = randn(num_slots, max_rank, n, dtype=torch.float32, gen=gen)
    for s, r in enumerate(ranks):
        a[s, r:], b_t[s, r:] = float("nan"), float("nan")  # never read
    scales = torch.rand(num_slots, generator=gen) + 0.5
    return a, b_t, torch.tensor(ranks, dtype=torch.int32), scales


@pytest.mark.parametrize("rows", [1, 6, 7, 48])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("k", "n"), [(64, 80), (37, 19)], ids=["vectors", "tails"])
@pytest.mark.parametrize("half", [False, True], ids=["fp32", "fp16"])
def test_lora_add_matches_the_reference_bgmv(rows, threads, k, n, half):
    """Each row's delta from its slot at its rank (stacks in fp32, or fp16 read as their fp32 values); base rows
    (-1) and rank-0 slots get exactly nothing."""
    gen = torch.Generator().manual_seed(7)
    ranks = [8, 0, 3, 16, 5]
    a, b_t, rank_t, scales = _lora_stacks(len(ranks), 16, k, n, ranks, gen)
    if half:
        if not cpu_native.panels_native():
            pytest.skip("fp16 stacks need the vector path (F16C)")
        a, b_t = a.half(), b_t.half()
    assert cpu_native.lora_stacks_native(a, b_t, rank_t, scales)
    token_slots = torch.randint(-1, len(ranks), (rows,), generator=gen, dtype=torch.int32)
    token_slots[0] = 3
    x = randn(rows, k + 5, dtype=torch.float32, gen=gen)[:, :k]  # strided rows
    y = randn(rows, n + 3, dtype=torch.float32, gen=gen)[:, :n]  # a view of a wider output, as q of q/k/v
    want = y.clone()
    v = reference.lora_shrink_bgmv(x.contiguous(), a.float(), token_slots, rank_t)
    reference.lora_expand_bgmv(want, v, b_t.float().transpose(1, 2), token_slots, rank_t, scales)
    before = cpu_native.threads()
    cpu_native.set_threads(threads)
    try:
        cpu_native.lora_add(y, x, token_slots, a, b_t, rank_t, scales)
    finally:
        cpu_native.set_threads(before)
    assert_close(y, want, torch.float32)
    untouched = (token_slots < 0) | (rank_t[token_slots.clamp(min=0).long()] == 0)
    assert torch.equal(y[untouched], want[untouched])


def test_lora_add_rejects_a_slot_past_the_stacks():
    gen = torch.Generator().manual_seed(8)
    a, b_t, ranks, scales = _lora_stacks(2, 4, 16, 16, [4, 4], gen)
    y = torch.zeros(2, 16)
    with pytest.raises(IndexError, match="past the 2 slots"):
        cpu_native.lora_add(y, torch.ones(2, 16), torch.tensor([0, 2], dtype=torch.int32), a, b_t, ranks, scales)
    assert not y.any()  # nothing written


@pytest.mark.parametrize(("rows", "vocab"), [(1, 1), (5, 33), (64, 300), (24, 49152)])
def test_argmax_rows_takes_the_first_largest_and_flags_non_finite_rows(rows, vocab):
    gen = torch.Generator().manual_seed(9)
    logits = randn(rows, vocab + 3, dtype=torch.float32, gen=gen)[:, :vocab]  # strided rows
    if vocab > 9:
        logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # a tie: the first wins
    assert dispatch.native_serves("argmax_rows", (logits,))
    tokens, finite = cpu_native.argmax_rows(logits)
    assert finite and tokens.tolist() == reference.argmax_rows(logits)[0].tolist()
    assert tokens.tolist() == torch.argmax(logits, dim=-1).tolist()
    if rows > 2:
        logits[1, vocab // 2] = float("inf")
        logits[2, vocab - 1] = float("nan")  # NaN counts as the largest, as numpy's argmax
        tokens, finite = cpu_native.argmax_rows(logits)
        assert not finite and tokens.tolist() == reference.argmax_rows(logits)[0].tolist()
        assert tokens[1] == vocab // 2 and tokens[2] == vocab - 1
        assert reference.argmax_rows(logits)[1] is False


def test_the_forwards_lora_order_is_the_slots_module_order():
    from loraplex.lora.shapes import MODULES

    assert cpu_native.LORA_MODULES == MODULES  # lp_decode_forward reads each layer's stacks in this order


def test_advance_decode_moves_each_row_on_one_token_as_the_reference_does():
    import numpy as np

    rng = np.random.default_rng(3)
    block_size, rows, width = 16, 37, 5
    positions = rng.integers(0, width * block_size - 1, rows).astype(np.int64)
    positions[:3] = [14, 15, 31]  # the next token opens a new block, or stays in the last slot of one
    tables = rng.permutation(1000)[: rows * width].astype(np.int32).reshape(rows, width)
    got = [positions.copy(), np.zeros(rows, np.int64), np.zeros(rows, np.int32)]
    want = [positions.copy(), np.zeros(rows, np.int64), np.zeros(rows, np.int32)]
    cpu_native.advance_decode(*got, tables, block_size)
    reference.advance_decode(*want, tables, block_size)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.tolist() == b.tolist()
    p = positions + 1
    assert got[0].tolist() == p.tolist() and got[2].tolist() == (p + 1).tolist()
    assert got[1].tolist() == (tables[np.arange(rows), p // block_size] * block_size + p % block_size).tolist()
    assert got[1][:3].tolist() == [tables[0, 0] * 16 + 15, tables[1, 1] * 16, tables[2, 2] * 16]
    last = np.array([width * block_size - 1], np.int64)  # its next token needs a block the table lacks
    with pytest.raises(IndexError):
        cpu_native.advance_decode(last, np.zeros(1, np.int64), np.zeros(1, np.int32), tables[:1], block_size)
    with pytest.raises(IndexError):
        reference.advance_decode(last.copy(), np.zeros(1, np.int64), np.zeros(1, np.int32), tables[:1], block_size)
