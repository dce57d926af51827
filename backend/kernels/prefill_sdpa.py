"""Prefill attention by gathering each prefilling sequence's cached context and calling torch SDPA.

A step that mixes decodes with prefill chunks sends its one-token sequences through the
batched decode attention in one call, so only the prefilling sequences (a few per step,
bounded by the token budget) take the per-sequence loop. Which sequence is which comes from
the step's lengths on the host: the runner hands them over (``remember_host_lengths``), so
no layer reads a device tensor back; without them, the lengths are read once per step.
A sliding window gathers only the keys some query of the chunk sees and masks the rest;
soft-capped scores take the eager matmuls (SDPA has no cap), a slice of queries at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from loraplex.kernels.reference import PerStepMemo, sdpa

_PLANS = PerStepMemo()  # keyed by the step's cu_query_lens tensor: every layer asks the same
# Soft-capped chunks are attended a slice of queries at a time, each slice's fp32 scores at most this many elements.
_CAPPED_SCORES = 1 << 25


@dataclass(slots=True)
class _Plan:
    """A step's sequences split by what attends them."""

    decode_rows: torch.Tensor | None  # int64 [D]: the token of each one-token sequence
    decode_seqs: torch.Tensor | None  # int64 [D]: those sequences' indices
    prefills: list[tuple[int, int, int, int]]  # (first token, end token, context length, sequence) of the others
    decode_inputs: tuple | None = None  # (block tables, context lens) of the one-token sequences, from the first layer
    max_query: int = 0  # the step's most new tokens of one sequence, and its longest context (for varlen_attn)
    max_context: int = 0


def _make_plan(starts: list[int], lengths: list[int], device) -> _Plan:
    single, prefills = [], []
    for b in range(len(starts) - 1):
        lo, hi = starts[b], starts[b + 1]
        if hi - lo == 1:
            single.append((lo, b))
        elif hi > lo:
            prefills.append((lo, hi, int(lengths[b]), b))
    longest = (max((hi - lo for lo, hi, _, _ in prefills), default=1), max(map(int, lengths), default=0))
    if len(single) < 2:  # one query alone gains nothing from the batched call
        prefills = sorted(prefills + [(lo, lo + 1, int(lengths[b]), b) for lo, b in single])
        return _Plan(None, None, prefills, None, *longest)
    rows, seqs = (torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True) for values in zip(*single))
    return _Plan(rows, seqs, prefills, None, *longest)


def remember_host_lengths(cu_query_lens: torch.Tensor, context_lens: torch.Tensor, starts, lengths) -> None:
    """The host values of a step's cu_query_lens and context_lens (the runner's arrays): no device read-back."""
    _PLANS.get(cu_query_lens, id(context_lens), lambda: _make_plan(list(starts), list(lengths), cu_query_lens.device))


def _plan(cu_query_lens: torch.Tensor, context_lens: torch.Tensor) -> _Plan:
    return _PLANS.get(cu_query_lens, id(context_lens),
                      lambda: _make_plan(cu_query_lens.tolist(), context_lens.tolist(), cu_query_lens.device))


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int, first: int = 0) -> torch.Tensor:
    """Tokens first..length-1 of one sequence's cache rows, contiguous: [length - first, Hkv, D] (the blocks
    wholly before first are not read)."""
    block_size = cache.shape[1]
    blocks = block_table[first // block_size : -(-length // block_size)].long()
    offset = first % block_size
    return cache.index_select(0, blocks).flatten(0, 1)[offset : offset + length - first]


def _attend_chunk(q, k, v, scale, first, window, softcap):
    """One sequence's new tokens q [Hq, L, D] over its keys k, v [Hq, n - first, D] (positions first..n-1, the
    chunk the last L of them): causal, within the window when given -> [Hq, L, D]."""
    num_q, num_k = q.shape[1], k.shape[1]
    if window is None and softcap is None and first == 0:
        causal = {"is_causal": True} if num_q == num_k else {"attn_mask": causal_lower_right(num_q, num_k)}
        return F.scaled_dot_product_attention(q[None], k[None], v[None], scale=scale, **causal)[0]  # 4-D, as they need
    q_pos = torch.arange(num_k + first - num_q, num_k + first, device=q.device)[:, None]
    key = torch.arange(first, first + num_k, device=q.device)
    visible = key <= q_pos
    if window is not None:
        visible &= key > q_pos - window
    if softcap is None:
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=visible, scale=scale)[0]
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=q.device).masked_fill_(~visible, float("-inf"))
    out = torch.empty_like(q)
    step = max(1, _CAPPED_SCORES // max(1, q.shape[0] * num_k))
    kf, vf = k.float()[None], v.float()[None]
    for lo in range(0, num_q, step):
        rows = slice(lo, lo + step)
        out[:, rows] = sdpa(q[None, :, rows].float(), kf, vf, bias[None, None, rows], scale, softcap)[0].to(q.dtype)
    return out


def paged_attention_prefill_sdpa(q, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale, window=None,
                                 softcap=None):
    """New tokens [T, Hq, D] attend causally to themselves and their cached prefix (with a window, each to the
    last window positions up to its own): gather + SDPA."""
    from loraplex.kernels import paged_attention_decode  # the package routes it to the decode kernel where one serves

    out = torch.empty_like(q)
    plan = _plan(cu_query_lens, context_lens)
    if plan.decode_rows is not None:
        if plan.decode_inputs is None:
            seqs = plan.decode_seqs
            plan.decode_inputs = (block_tables[seqs.to(block_tables.device)], context_lens[seqs.to(context_lens.device)])
        out[plan.decode_rows] = paged_attention_decode(q[plan.decode_rows], k_cache, v_cache, *plan.decode_inputs, scale,
                                                       window, softcap)
    group = q.shape[1] // k_cache.shape[2]
    for lo, hi, n, b in plan.prefills:
        seen = window if window is not None and window < n else None  # a window of n or more hides nothing here
        first = max(0, n - (hi - lo) - seen + 1) if seen is not None else 0  # the earliest query's first key
        k = gather_context(k_cache, block_tables[b], n, first).transpose(0, 1)
        v = gather_context(v_cache, block_tables[b], n, first).transpose(0, 1)
        if group > 1:  # a K/V head per query head: the fused kernels (flash, memory-efficient) take no GQA here
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        out[lo:hi] = _attend_chunk(q[lo:hi].transpose(0, 1), k, v, scale, first, seen, softcap).transpose(0, 1)
    return out


def paged_attention_prefill_varlen(q, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale):
    """The same attention by Flash Attention's variable-length call over the paged cache (torch's varlen_attn,
    CUDA, fp16/bf16): every sequence of the step in one call per layer, nothing gathered, the causal mask
    aligned to each sequence's last key. A candidate until benchmarks/gpu_kernels.py has measured it."""
    from torch.nn.attention.varlen import varlen_attn

    plan = _plan(cu_query_lens, context_lens)
    return varlen_attn(q, k_cache, v_cache, cu_query_lens, None, plan.max_query, plan.max_context, scale=scale,
                       window_size=(-1, 0), enable_gqa=q.shape[1] != k_cache.shape[2], seqused_k=context_lens,
                       block_table=block_tables)
