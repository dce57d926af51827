"""Sliding-window attention and logit soft-capping in every paged-attention implementation (the torch reference's
CPU ways, gather + SDPA, the native CPU op and decode forward, the .cu kernels on the CPU shim) against a dense
oracle: plain torch in float64, one sequence at a time, over only the keys its window shows.

Every case poisons what no query of the call may see: the cache rows before the earliest query's window hold
NaN, and the block-table entries of blocks wholly before it are -1 or a NaN block, so reading one shows.
"""

from __future__ import annotations

import math

import pytest
import torch

import loraplex.kernels as kernels
from kernel_cases import assert_close, paged_cache, randn
from loraplex.kernels import cpu_native, decode_launch, dispatch, prefill_launch, reference
from loraplex.kernels.prefill_sdpa import paged_attention_prefill_sdpa

BLOCK = 4
# decode: contexts 1, 7 and 8 are shorter than or equal to the window 8, 9 and 20 longer
DECODE_CONTEXTS = [1, 7, 8, 9, 20]
DECODE_WINDOWS = [1, 3, 8, 64, None]
# prefill: a whole prompt, chunks after a cached prefix (one ending mid-block), one new token
PREFILL_QUERIES, PREFILL_CONTEXTS = [7, 5, 1, 12], [7, 14, 9, 29]
PREFILL_WINDOWS = [1, 5, 9, 64, None]
SOFTCAP = 1.5  # scores here are about N(0, 1): the cap changes every result
softcaps = pytest.mark.parametrize("softcap", [None, SOFTCAP], ids=["plain", "softcap"])
head_dims = pytest.mark.parametrize("head_dim", [64, 256])


def first_key(n: int, num_new: int, window: int | None) -> int:
    """The first position the earliest of a sequence's num_new queries (its last positions of n) sees."""
    return 0 if window is None else max(0, n - num_new - window + 1)


def oracle(q, k_cache, v_cache, block_tables, cu, context_lens, scale, window, softcap):
    """Each sequence's new tokens over its visible keys, gathered position by position, in float64."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[2]
    for b, n in enumerate(context_lens.tolist()):
        lo, hi = int(cu[b]), int(cu[b + 1])
        if hi == lo:
            continue
        keys = torch.arange(first_key(n, hi - lo, window), n)
        rows = block_tables[b, keys // BLOCK].long() * BLOCK + keys % BLOCK
        k, v = (c.flatten(0, 1)[rows].double().repeat_interleave(group, 1) for c in (k_cache, v_cache))
        scores = torch.einsum("lhd,mhd->hlm", q[lo:hi].double(), k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(n - (hi - lo), n)[:, None]
        visible = keys <= q_pos
        if window is not None:
            visible &= keys > q_pos - window
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[lo:hi] = torch.einsum("hlm,mhd->lhd", probs, v)
    return out


def poison(cache, cu, window):
    """NaN in the rows before each sequence's first visible key; -1 or a NaN block in the entries of the blocks
    wholly before it."""
    nan_block = int(cache.block_tables[0, -1])  # paged_cache's spare entries all point at its NaN block
    for b, n in enumerate(cache.context_lens.tolist()):
        first = first_key(n, int(cu[b + 1] - cu[b]), window)
        for position in range(first - first % BLOCK, first):
            block = int(cache.block_tables[b, position // BLOCK])
            cache.k_cache[block, position % BLOCK] = float("nan")
            cache.v_cache[block, position % BLOCK] = float("nan")
        for i in range(first // BLOCK):
            cache.block_tables[b, i] = -1 if i % 2 == 0 else nan_block


def case(contexts, queries, window, head_dim, dtype=torch.float32, num_q_heads=4, num_kv_heads=2, seed=0):
    """(q, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale), poisoned for window."""
    gen = torch.Generator().manual_seed(seed)
    cache = paged_cache(contexts, num_kv_heads, head_dim, BLOCK, dtype, gen)
    cu = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
    poison(cache, cu, window)
    q = randn(int(cu[-1]), num_q_heads, head_dim, dtype=dtype, gen=gen)
    return q, cache.k_cache, cache.v_cache, cache.block_tables, cu, cache.context_lens, head_dim**-0.5


def decode_case(window, head_dim, contexts=DECODE_CONTEXTS, **kw):
    q, k_cache, v_cache, tables, _cu, lens, scale = case(contexts, [1] * len(contexts), window, head_dim, **kw)
    return q, k_cache, v_cache, tables, lens, scale


def check_decode(attend, head_dim, softcap, windows=DECODE_WINDOWS, dtype=torch.float32, **kw):
    for window in windows:
        q, k_cache, v_cache, tables, lens, scale = decode_case(window, head_dim, dtype=dtype, **kw)
        want = oracle(q, k_cache, v_cache, tables, torch.arange(len(lens) + 1), lens, scale, window, softcap)
        got = attend(q, k_cache, v_cache, tables, lens, scale, window, softcap)
        assert_close(got, want.to(dtype), dtype)


def check_prefill(attend, head_dim, softcap, windows=PREFILL_WINDOWS, dtype=torch.float32, **kw):
    for window in windows:
        args = case(PREFILL_CONTEXTS, PREFILL_QUERIES, window, head_dim, dtype=dtype, **kw)
        want = oracle(*args, window, softcap)
        assert_close(attend(*args, window, softcap), want.to(dtype), dtype)


# ---- decode ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("way", ["each", "buckets", "padded"])
@softcaps
@head_dims
def test_reference_decode_every_cpu_way(monkeypatch, way, softcap, head_dim):
    monkeypatch.setattr(reference, "CPU_DECODE", way)
    check_decode(reference.paged_attention_decode, head_dim, softcap)


@pytest.mark.parametrize("way", ["each", "buckets", "padded"])
def test_reference_decode_layers_of_one_step_with_different_windows(monkeypatch, way):
    # Gemma's interleaved layers: one step's tensors, windows changing layer by layer (the per-step memos)
    monkeypatch.setattr(reference, "CPU_DECODE", way)
    q, k_cache, v_cache, tables, lens, scale = decode_case(None, 64)
    for window in (3, None, 8, 3):
        want = oracle(q, k_cache, v_cache, tables, torch.arange(len(lens) + 1), lens, scale, window, None)
        assert_close(reference.paged_attention_decode(q, k_cache, v_cache, tables, lens, scale, window), want.float(),
                     torch.float32)


@softcaps
def test_reference_decode_one_stream(softcap):
    # one sequence always takes the per-sequence way's single-stream branch
    for n in (5, 20):
        check_decode(reference.paged_attention_decode, 64, softcap, contexts=[n])


@softcaps
@head_dims
def test_native_decode(softcap, head_dim):
    if cpu_native.library() is None:
        pytest.fail("the native CPU ops did not build (a C compiler is part of the test environment)")
    check_decode(cpu_native.paged_attention_decode, head_dim, softcap, num_q_heads=8, num_kv_heads=2)


@pytest.mark.parametrize("splits", [1, 3])
@softcaps
@head_dims
def test_decode_kernel_on_the_shim(cpu, splits, softcap, head_dim):
    # 3 splits of 8 tokens: a window of 3 leaves the first splits of the longest context empty
    def attend(*args):
        return decode_launch.paged_attention_decode(*args, num_splits=splits, runner=cpu)

    check_decode(attend, head_dim, softcap)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_decode_kernel_half_types_on_the_shim(cpu, dtype):
    def attend(*args):
        return decode_launch.paged_attention_decode(*args, num_splits=2, runner=cpu)

    check_decode(attend, 256, SOFTCAP, windows=[3, None], dtype=dtype)


# ---- prefill -----------------------------------------------------------------------------------------------


@softcaps
@head_dims
def test_reference_prefill(softcap, head_dim):
    check_prefill(reference.paged_attention_prefill, head_dim, softcap)


@softcaps
@head_dims
def test_gather_sdpa_prefill(softcap, head_dim):
    check_prefill(paged_attention_prefill_sdpa, head_dim, softcap)


@softcaps
def test_gather_sdpa_prefill_with_decodes_in_the_step(softcap):
    # one-token sequences go through the batched decode attention, which must get the window and cap too
    queries, contexts = [1, 6, 1, 1], [9, 13, 20, 3]
    for window in (4, None):
        args = case(contexts, queries, window, 64)
        assert_close(paged_attention_prefill_sdpa(*args, window, softcap), oracle(*args, window, softcap).float(),
                     torch.float32)


@softcaps
@head_dims
def test_prefill_kernel_on_the_shim(cpu, softcap, head_dim):
    def attend(*args):
        return prefill_launch.paged_attention_prefill_kernel(*args, runner=cpu)

    check_prefill(attend, head_dim, softcap)


def test_prefill_kernel_long_chunk_on_the_shim(cpu):
    # 40 new tokens after 30 cached, window 9: later query tiles skip whole key tiles before their window
    args = case([70], [40], 9, 64, dtype=torch.float16)
    want = oracle(*args, 9, SOFTCAP).half()
    assert_close(prefill_launch.paged_attention_prefill_kernel(*args, 9, SOFTCAP, runner=cpu), want, torch.float16)


# ---- on CUDA: what the engine runs there (benchmarks/gpu_session.sh's cuda_kernel_tests; skipped without a GPU) --

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (benchmarks/gpu_session.sh: cuda_kernel_tests)")


def on_cuda(attend, **options):
    """attend on CUDA copies of a case's tensors, its result back on the CPU for the oracle."""
    def run(*args):
        return attend(*(a.cuda() if isinstance(a, torch.Tensor) else a for a in args), **options).cpu()

    return run


@needs_cuda
@pytest.mark.parametrize("splits", [1, 3, None], ids=["1-split", "3-splits", "auto-splits"])
@softcaps
@head_dims
def test_decode_kernel_on_cuda(splits, softcap, head_dim):
    check_decode(on_cuda(decode_launch.paged_attention_decode, num_splits=splits), head_dim, softcap)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@head_dims
def test_decode_kernel_half_types_on_cuda(dtype, head_dim):
    check_decode(on_cuda(decode_launch.paged_attention_decode), head_dim, SOFTCAP, windows=[3, None], dtype=dtype)


@needs_cuda
@pytest.mark.parametrize("attend", [prefill_launch.paged_attention_prefill_kernel, paged_attention_prefill_sdpa,
                                    reference.paged_attention_prefill], ids=["kernel", "gather-sdpa", "reference"])
@softcaps
@head_dims
def test_prefill_on_cuda(attend, softcap, head_dim):
    check_prefill(on_cuda(attend), head_dim, softcap)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_prefill_half_types_on_cuda(dtype):
    for attend in (prefill_launch.paged_attention_prefill_kernel, paged_attention_prefill_sdpa):
        check_prefill(on_cuda(attend), 256, SOFTCAP, windows=[5, None], dtype=dtype)


@needs_cuda
@softcaps
def test_reference_decode_and_entry_points_on_cuda(softcap):
    # LORAPLEX_KERNELS=reference (the Triton stage on the GPU) decodes with the reference; auto with the kernel
    for attend in (reference.paged_attention_decode, kernels.paged_attention_decode):
        check_decode(on_cuda(attend), 256, softcap)
    check_prefill(on_cuda(kernels.paged_attention_prefill), 256, softcap)


# ---- the package's entry points, and the native decode forward -----------------------------------------------


@pytest.mark.parametrize("mode", ["auto", "reference", "shim"])
def test_package_entry_points_pass_window_and_softcap_on(monkeypatch, cpu, mode):
    monkeypatch.setattr(dispatch, "MODE", mode)
    check_decode(kernels.paged_attention_decode, 64, SOFTCAP, windows=[3])
    check_prefill(kernels.paged_attention_prefill, 64, SOFTCAP, windows=[5])


@pytest.mark.parametrize("window,softcap,match", [
    (0, None, "window"), (-4, None, "window"), (2.5, None, "window"), (True, None, "window"),
    (None, 0.0, "softcap"), (None, -1.0, "softcap"), (None, math.inf, "softcap"), (None, math.nan, "softcap"),
])
def test_a_bad_window_or_softcap_is_refused(window, softcap, match):
    q, k_cache, v_cache, tables, lens, scale = decode_case(None, 64)
    with pytest.raises(ValueError, match=match):
        kernels.paged_attention_decode(q, k_cache, v_cache, tables, lens, scale, window, softcap)
    with pytest.raises(ValueError, match=match):
        cpu_native.paged_attention_decode(q, k_cache, v_cache, tables, lens, scale, window, softcap)


def test_head_dim_256_keeps_every_kernel_and_the_native_ops(caplog):
    assert kernels.check_model(256, 8, 4, torch.float32, "cpu") == {}
    assert kernels.native_layer_ops("cpu", torch.float32, 256) == (dispatch.MODE == "auto")
    from loraplex.kernels import preconditions
    from loraplex.kernels.preconditions import KernelShapes

    assert preconditions.decisions(KernelShapes(torch.bfloat16, 256, 8, 4, (9, 0))) == dict.fromkeys(preconditions.OPS)
    assert "head_dim 96" in preconditions.reason(preconditions.DECODE, KernelShapes(torch.float16, 96, 8, 4, (9, 0)))


def test_native_decode_forward_takes_each_layers_window_and_softcap():
    """lp_decode_forward with a sliding layer and a soft-capped one gives what the same native ops give one by one;
    without the variants it gives something else."""
    if cpu_native.library() is None or not cpu_native.panels_native():
        pytest.skip("no native GEMM on this CPU")
    gen = torch.Generator().manual_seed(3)
    hidden, heads, kv_heads, d, inter, eps = 64, 4, 2, 32, 96, 1e-6
    variants = [{"window": 3}, {"softcap": SOFTCAP}]
    layers = []
    for variant in variants:
        def pack(n, k):
            return cpu_native.Panels(randn(n, k, dtype=torch.float32, gen=gen) * k**-0.5, half=False)

        layers.append({"input_norm": 1 + 0.1 * randn(hidden, dtype=torch.float32, gen=gen),
                       "post_norm": 1 + 0.1 * randn(hidden, dtype=torch.float32, gen=gen),
                       "qkv": pack((heads + 2 * kv_heads) * d, hidden), "o_proj": pack(hidden, heads * d),
                       "gate_up": pack(2 * inter, hidden), "down_proj": pack(hidden, inter), **variant})
    final_norm = torch.ones(hidden)
    angles = torch.outer(torch.arange(64.0), 10000 ** (-torch.arange(0, d, 2) / d))
    cos, signed_sin = torch.cat([angles.cos()] * 2, 1), torch.cat([-angles.sin(), angles.sin()], 1)
    contexts = [9, 2, 17]
    tables = torch.tensor([[0, 1, 2, -1, -1], [3, -1, -1, -1, -1], [4, 5, 6, 7, 8]], dtype=torch.int32)
    lens = torch.tensor(contexts, dtype=torch.int32)
    positions = lens.long() - 1
    slots = torch.stack([tables[b, p // BLOCK].long() * BLOCK + p % BLOCK for b, p in enumerate(positions)])
    kv = randn(len(layers), 2, 9, BLOCK, kv_heads, d, dtype=torch.float32, gen=gen)
    h = randn(3, hidden, dtype=torch.float32, gen=gen)

    def per_op(kv, with_variants=True):
        x, delta = h.clone(), None
        for i, layer in enumerate(layers):
            normed = cpu_native.add_rms_norm(x, delta, layer["input_norm"], eps)
            q, k, v = cpu_native.packed_linear(normed, layer["qkv"]).split([heads * d, kv_heads * d, kv_heads * d], 1)
            q, k, v = q.view(3, heads, d), k.view(3, kv_heads, d), v.view(3, kv_heads, d)
            cpu_native.rotate_qk(q, k, positions, cos, signed_sin)
            cpu_native.write_kv(kv[i, 0], kv[i, 1], k, v, slots)
            variant = {name: layer.get(name) for name in ("window", "softcap")} if with_variants else {}
            o = cpu_native.paged_attention_decode(q, kv[i, 0], kv[i, 1], tables, lens, d**-0.5, **variant)
            proj = cpu_native.packed_linear(o.reshape(3, -1), layer["o_proj"])
            normed = cpu_native.add_rms_norm(x, proj, layer["post_norm"], eps)
            gate, up = cpu_native.packed_linear(normed, layer["gate_up"]).split([inter, inter], 1)
            delta = cpu_native.packed_linear(cpu_native.silu_mul(gate, up), layer["down_proj"])
        return cpu_native.add_rms_norm(x, delta, final_norm, eps)

    forward = cpu_native.DecodeForward(layers, final_norm, cos, signed_sin, heads, kv_heads, d, eps, d**-0.5)
    one_call_kv, per_op_kv = kv.clone(), kv.clone()
    got = forward(h.clone(), positions, slots, tables, lens, one_call_kv)
    assert torch.equal(got, per_op(per_op_kv)) and torch.equal(one_call_kv, per_op_kv)
    assert (got - per_op(kv.clone(), with_variants=False)).abs().max() > 1e-3
