"""Prefill attention by gathering each sequence's cached context and calling torch SDPA."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first length tokens of one sequence's cache rows, contiguous: [length, Hkv, D]."""
    block_size = cache.shape[1]
    blocks = block_table[: -(-length // block_size)].long()
    return cache.index_select(0, blocks).flatten(0, 1)[:length]


def paged_attention_prefill_sdpa(q, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale):
    """New tokens [T, Hq, D] attend causally to themselves and their cached prefix (gather + SDPA)."""
    out = torch.empty_like(q)
    starts = cu_query_lens.tolist()
    lengths = context_lens.tolist()
    gqa = q.shape[1] != k_cache.shape[2]
    for b in range(len(starts) - 1):
        lo, hi = starts[b], starts[b + 1]
        if hi <= lo:
            continue
        n = int(lengths[b])
        k = gather_context(k_cache, block_tables[b], n).transpose(0, 1)
        v = gather_context(v_cache, block_tables[b], n).transpose(0, 1)
        qb = q[lo:hi].transpose(0, 1)
        mask = causal_lower_right(hi - lo, n)
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[lo:hi] = o.transpose(0, 1)
    return out
