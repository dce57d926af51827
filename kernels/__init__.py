"""Loraplex kernels: dispatch to CuPy CUDA kernels on CUDA tensors, torch reference on CPU.

The backend calls only the functions exported here. CuPy is imported only when a CUDA
tensor arrives, so CPU-only users never need it.
"""

from __future__ import annotations

from . import reference


def lora_shrink_bgmv(x, a_stack, token_slots, ranks):
    """Per-row gather shrink: out[t, :rank] = x[t] @ A[slot[t], :rank].T; zeros elsewhere."""
    if x.is_cuda:
        from .lora_launch import lora_shrink_bgmv as launch

        return launch(x, a_stack, token_slots, ranks)
    return reference.lora_shrink_bgmv(x, a_stack, token_slots, ranks)


def lora_expand_bgmv(y, v, b_stack, token_slots, ranks, scales):
    """Per-row gather expand, in place: y[t] += scale[slot] * v[t, :rank] @ B[slot, :, :rank].T."""
    if y.is_cuda:
        from .lora_launch import lora_expand_bgmv as launch

        return launch(y, v, b_stack, token_slots, ranks, scales)
    return reference.lora_expand_bgmv(y, v, b_stack, token_slots, ranks, scales)


def lora_shrink_sgmv(x, a_stack, seg_starts, seg_slots, ranks):
    """Segmented shrink: like lora_shrink_bgmv with one adapter per contiguous segment."""
    if x.is_cuda:
        from .lora_launch import lora_shrink_sgmv as launch

        return launch(x, a_stack, seg_starts, seg_slots, ranks)
    return reference.lora_shrink_sgmv(x, a_stack, seg_starts, seg_slots, ranks)


def lora_expand_sgmv(y, v, b_stack, seg_starts, seg_slots, ranks, scales):
    """Segmented expand, in place: y[seg] += scale * v[seg, :rank] @ B[slot, :, :rank].T."""
    if y.is_cuda:
        from .lora_launch import lora_expand_sgmv as launch

        return launch(y, v, b_stack, seg_starts, seg_slots, ranks, scales)
    return reference.lora_expand_sgmv(y, v, b_stack, seg_starts, seg_slots, ranks, scales)


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """Store new keys/values [T, Hkv, D] at flat slots (block * block_size + offset); slot < 0 skips."""
    if k_cache.is_cuda:
        from .cache_launch import write_kv as launch

        return launch(k_cache, v_cache, k, v, slot_mapping)
    return reference.write_kv(k_cache, v_cache, k, v, slot_mapping)


def copy_blocks(kv_cache, src, dst):
    """Copy-on-write: kv_cache[:, :, dst[i]] = kv_cache[:, :, src[i]] for all layers."""
    if kv_cache.is_cuda:
        from .cache_launch import copy_blocks as launch

        return launch(kv_cache, src, dst)
    return reference.copy_blocks(kv_cache, src, dst)


def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    """One query per sequence [B, Hq, D] over its whole cached context -> [B, Hq, D]."""
    if q.is_cuda:
        from .decode_launch import paged_attention_decode as launch

        return launch(q, k_cache, v_cache, block_tables, context_lens, scale)
    return reference.paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale)


def paged_attention_prefill(q, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale):
    """New tokens [T, Hq, D] attend causally to themselves and their cached prefix."""
    if q.is_cuda:
        from .prefill_launch import paged_attention_prefill as launch

        return launch(q, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale)
    return reference.paged_attention_prefill(q, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale)


__all__ = [
    "copy_blocks",
    "lora_expand_bgmv",
    "lora_expand_sgmv",
    "lora_shrink_bgmv",
    "lora_shrink_sgmv",
    "paged_attention_decode",
    "paged_attention_prefill",
    "write_kv",
]
