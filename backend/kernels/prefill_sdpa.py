"""Prefill attention by gathering each prefilling sequence's cached context and calling torch SDPA.

A step that mixes decodes with prefill chunks sends its one-token sequences through the
batched decode attention in one call, so only the prefilling sequences (a few per step,
bounded by the token budget) take the per-sequence loop. Which sequence is which comes from
the step's lengths on the host: the runner hands them over (``remember_host_lengths``), so
no layer reads a device tensor back; without them, the lengths are read once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from loraplex.kernels.reference import PerStepMemo

_PLANS = PerStepMemo()  # keyed by the step's cu_query_lens tensor: every layer asks the same


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


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first length tokens of one sequence's cache rows, contiguous: [length, Hkv, D]."""
    block_size = cache.shape[1]
    blocks = block_table[: -(-length // block_size)].long()
    return cache.index_select(0, blocks).flatten(0, 1)[:length]


def paged_attention_prefill_sdpa(q, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale):
    """New tokens [T, Hq, D] attend causally to themselves and their cached prefix (gather + SDPA)."""
    from loraplex.kernels import paged_attention_decode  # the package routes it to the decode kernel where one serves

    out = torch.empty_like(q)
    plan = _plan(cu_query_lens, context_lens)
    if plan.decode_rows is not None:
        if plan.decode_inputs is None:
            seqs = plan.decode_seqs
            plan.decode_inputs = (block_tables[seqs.to(block_tables.device)], context_lens[seqs.to(context_lens.device)])
        out[plan.decode_rows] = paged_attention_decode(q[plan.decode_rows], k_cache, v_cache, *plan.decode_inputs, scale)
    group = q.shape[1] // k_cache.shape[2]
    for lo, hi, n, b in plan.prefills:
        k = gather_context(k_cache, block_tables[b], n).transpose(0, 1)
        v = gather_context(v_cache, block_tables[b], n).transpose(0, 1)
        if group > 1:  # a K/V head per query head: the fused kernels (flash, memory-efficient) take no GQA here
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        qb = q[lo:hi].transpose(0, 1)
        causal = {"is_causal": True} if hi - lo == n else {"attn_mask": causal_lower_right(hi - lo, n)}
        o = F.scaled_dot_product_attention(qb[None], k[None], v[None], scale=scale, **causal)  # 4-D, as they need
        out[lo:hi] = o[0].transpose(0, 1)
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
