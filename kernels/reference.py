"""Torch reference of every kernel: the oracle for the CUDA sources and the CPU path.

Shapes (T tokens, B sequences, S adapter slots, R max rank, Hq/Hkv heads, D head dim):
  kv cache of one layer: k_cache, v_cache [num_blocks, block_size, Hkv, D]
  block_tables int32 [B, max_blocks_per_seq]; context_lens int32 [B] (tokens in cache,
  including the new ones); cu_query_lens int32 [B+1] (new tokens per sequence, prefix sums).
  LoRA stacks of one module: a_stack [S, R, H_in], b_stack [S, H_out, R]; ranks int32 [S];
  scales float32 [S]; token_slots int32 [T] (-1 = no adapter).
  Segments for prefill (SGMV): seg_starts int32 [G+1], seg_slots int32 [G]; tokens of
  segment g are rows seg_starts[g]:seg_starts[g+1], all with adapter seg_slots[g].
"""

from __future__ import annotations

import torch


def lora_shrink_bgmv(x, a_stack, token_slots, ranks):
    """Per-row gather shrink: out[t, :rank] = x[t] @ A[slot[t], :rank].T; zeros elsewhere."""
    out = torch.zeros(x.shape[0], a_stack.shape[1], dtype=torch.float32, device=x.device)
    for slot in torch.unique(token_slots).tolist():
        if slot < 0:
            continue
        rows = (token_slots == slot).nonzero(as_tuple=True)[0]
        r = int(ranks[slot])
        out[rows, :r] = x[rows].float() @ a_stack[slot, :r].float().T
    return out.to(x.dtype)


def lora_expand_bgmv(y, v, b_stack, token_slots, ranks, scales):
    """Per-row gather expand, in place: y[t] += scale[slot] * v[t, :rank] @ B[slot, :, :rank].T."""
    for slot in torch.unique(token_slots).tolist():
        if slot < 0:
            continue
        rows = (token_slots == slot).nonzero(as_tuple=True)[0]
        r = int(ranks[slot])
        delta = (v[rows, :r].float() @ b_stack[slot, :, :r].float().T) * float(scales[slot])
        y[rows] += delta.to(y.dtype)
    return y


def lora_shrink_sgmv(x, a_stack, seg_starts, seg_slots, ranks):
    """Segmented shrink: like lora_shrink_bgmv with one adapter per contiguous segment."""
    out = torch.zeros(x.shape[0], a_stack.shape[1], dtype=torch.float32, device=x.device)
    starts = seg_starts.tolist()
    for g, slot in enumerate(seg_slots.tolist()):
        lo, hi = starts[g], starts[g + 1]
        if slot < 0 or hi <= lo:
            continue
        r = int(ranks[slot])
        out[lo:hi, :r] = x[lo:hi].float() @ a_stack[slot, :r].float().T
    return out.to(x.dtype)


def lora_expand_sgmv(y, v, b_stack, seg_starts, seg_slots, ranks, scales):
    """Segmented expand, in place: y[seg] += scale * v[seg, :rank] @ B[slot, :, :rank].T."""
    starts = seg_starts.tolist()
    for g, slot in enumerate(seg_slots.tolist()):
        lo, hi = starts[g], starts[g + 1]
        if slot < 0 or hi <= lo:
            continue
        r = int(ranks[slot])
        delta = (v[lo:hi, :r].float() @ b_stack[slot, :, :r].float().T) * float(scales[slot])
        y[lo:hi] += delta.to(y.dtype)
    return y


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """Store new keys/values [T, Hkv, D] at flat slots (block * block_size + offset); slot < 0 skips."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots % block_size
    k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)


def copy_blocks(kv_cache, src, dst):
    """Copy-on-write: kv_cache[..., dst[i], ...] = kv_cache[..., src[i], ...] for all layers.

    kv_cache is [num_layers, 2, num_blocks, block_size, Hkv, D].
    """
    if len(src):
        kv_cache[:, :, dst.long()] = kv_cache[:, :, src.long()]


def _gather_context(cache, block_table, ctx_len):
    block_size = cache.shape[1]
    n_blocks = (ctx_len + block_size - 1) // block_size
    return cache[block_table[:n_blocks].long()].reshape(-1, *cache.shape[2:])[:ctx_len]


def _attend(q, k, v, scale, q_positions):
    """q [Lq, Hq, D], k/v [Lk, Hkv, D]; query at position p sees keys 0..p."""
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


def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    """One query per sequence [B, Hq, D] over its whole cached context -> [B, Hq, D]."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        k = _gather_context(k_cache, block_tables[b], n)
        v = _gather_context(v_cache, block_tables[b], n)
        pos = torch.tensor([n - 1], device=q.device)
        out[b : b + 1] = _attend(q[b : b + 1], k, v, scale, pos)
    return out


def paged_attention_prefill(q, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale):
    """New tokens [T, Hq, D] attend causally to themselves and their cached prefix."""
    out = torch.empty_like(q)
    cu = cu_query_lens.tolist()
    for b in range(len(cu) - 1):
        lo, hi = cu[b], cu[b + 1]
        if hi <= lo:
            continue
        n = int(context_lens[b])
        k = _gather_context(k_cache, block_tables[b], n)
        v = _gather_context(v_cache, block_tables[b], n)
        pos = torch.arange(n - (hi - lo), n, device=q.device)
        out[lo:hi] = _attend(q[lo:hi], k, v, scale, pos)
    return out
