"""Torch reference of every kernel: the oracle for the CUDA sources and the CPU path.

Shapes (T tokens, B sequences, S adapter slots, R max rank, Hq/Hkv heads, D head dim):
  kv cache of one layer: k_cache, v_cache [num_blocks, block_size, Hkv, D]
  block_tables int32 [B, max_blocks_per_seq]; context_lens int32 [B] (tokens in cache,
  including the new ones); cu_query_lens int32 [B+1] (new tokens per sequence, prefix sums).
  LoRA stacks of one module: a_stack [S, R, H_in], b_stack [S, H_out, R]; ranks int32 [S];
  scales float32 [S]; token_slots int32 [T] (-1 = no adapter).
  Segments for prefill (SGMV): seg_starts int32 [G+1] (non-decreasing), seg_slots int32 [G];
  tokens of segment g are rows seg_starts[g]:seg_starts[g+1], all with adapter seg_slots[g].

Everything accumulates in fp32 and is returned in the input dtype. The functions are
vectorized: no Python loop per sequence or per adapter slot, only over a few groups (distinct
LoRA ranks, KV heads, padded chunks of sequences). Values that must not be read never reach a
result, even when they are NaN (NaN * 0 is NaN, so masking by multiplication is not enough):
  - LoRA: rows are grouped by (rank, slot) into tiles and A[:, :rank] / B[:, :, :rank] are
    sliced, so entries at or beyond a slot's rank are never read. Rows without an adapter
    (slot -1, or rank 0 for this module) are in no tile: their shrink output is exactly zero
    and expand leaves them untouched. What tile padding computes is dropped.
  - Attention: block-table entries past a context, and with a sliding window those of blocks
    before the first key any query of the call sees, are not followed; gathered K/V rows at
    positions >= the context length or before that first key are overwritten with zeros before
    any arithmetic; keys beyond a query's position or outside its window get an additive -inf
    score.

Attention variants (every paged-attention function takes them): ``window`` (None or a positive
int): a query at position p sees the keys at positions k with p - window < k <= p (transformers'
sliding_window_overlay); ``softcap`` (None or a positive float): scores = softcap * tanh(scores /
softcap), scores already scaled, before the mask and the softmax (Gemma 2's attn_logit_softcapping,
in the order of its eager_attention_forward).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from loraplex.kernels import quant_args

# ---------------------------------------------------------------------------------------------
# LoRA: BGMV (one adapter slot per token) and SGMV (one per contiguous segment of tokens)
# ---------------------------------------------------------------------------------------------


class PerStepMemo:
    """Results derived from one step's slot tensor, reused by every layer and module of that step.

    Keyed by the tensor's identity and version (it holds the tensor, so the identity cannot be
    reused while cached; inference tensors have no version, and the runner never changes a
    step's slots) and by the values of the other inputs; a new tensor starts afresh. While a
    CUDA graph is captured nothing is reused: the graph must compute it itself, since its static
    inputs change in place between replays (a result reused from the eager warm-up would be
    replayed as a constant).
    """

    def __init__(self):
        self.tensor, self.version, self.results = None, None, {}

    def get(self, tensor, key, compute):
        if _capturing(tensor):
            return compute()
        version = None if tensor.is_inference() else tensor._version  # inference tensors keep no version
        if tensor is not self.tensor or version != self.version:
            self.tensor, self.version, self.results = tensor, version, {}
        if key not in self.results:
            self.results[key] = compute()
        return self.results[key]


def _capturing(tensor) -> bool:
    """Whether tensor's CUDA stream is being captured into a graph."""
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


_TILES, _SEGMENT_SLOTS, _DECODE_LAYOUTS, _WRITE_ROWS = PerStepMemo(), PerStepMemo(), PerStepMemo(), PerStepMemo()


def _adapter_tiles(token_slots, ranks):
    """``_find_adapter_tiles`` once per step and rank layout: 7 modules x 2 ops x layers ask the same."""
    return _TILES.get(token_slots, tuple(ranks.tolist()), lambda: _find_adapter_tiles(token_slots, ranks))


def _find_adapter_tiles(token_slots, ranks):
    """The rows that use an adapter, as tiles of rows of one slot, grouped by rank.

    Returns [(rank, tile_slots int64 [n], tile_rows int64 [n, size])], one entry per distinct
    rank > 0 among the slots in use. Every row whose slot is >= 0 and has rank > 0 is in exactly
    one tile; other rows are in none (they get nothing). Unused tile entries hold T (padding:
    callers drop what it computes). size is the mean number of rows per run of equal slots, so
    a batched matmul over the tiles does at most about twice the useful work even when one
    adapter owns most rows (a prefill chunk next to decodes). Grouping by rank lets the callers
    slice A[:, :rank] and B[:, :, :rank]: entries at or beyond a slot's rank are never read.
    """
    dev = token_slots.device
    num_rows, num_slots = token_slots.shape[0], ranks.shape[0]
    slots = token_slots.long()
    rank = ranks.to(dev).long().index_select(0, slots.clamp(min=0))
    # sort the rows by (rank, slot): each adapter's rows become one run, runs of equal rank are
    # adjacent; rows without an adapter get key -1 (a run of rank -1, skipped below)
    key, rows = torch.sort(torch.where(slots >= 0, rank * num_slots + slots, -1), stable=True)
    pos = torch.arange(num_rows, device=dev) - torch.searchsorted(key, key)  # index within the run
    num_runs = int((pos == 0).sum())
    if num_runs == 0:
        return []
    size = -(-num_rows // num_runs)
    in_tile = pos % size  # runs are cut into tiles of size rows
    first_in_tile = in_tile == 0
    tile = first_in_tile.cumsum(0) - 1  # the tile of each row
    tile_rows = torch.full((int(tile[-1]) + 1, size), num_rows, dtype=torch.long, device=dev)
    tile_rows.view(-1).index_copy_(0, tile * size + in_tile, rows)
    tile_key = key.masked_select(first_in_tile)
    tile_rank, tile_slots = tile_key // num_slots, tile_key % num_slots
    groups, first = [], 0
    for rank, count in zip(*(t.tolist() for t in torch.unique_consecutive(tile_rank, return_counts=True))):
        if rank > 0:  # rank 0: the adapter does not adapt this module; -1: no adapter
            groups.append((rank, tile_slots[first : first + count], tile_rows[first : first + count]))
        first += count
    return groups


def _gather_tiles(rows, tile_rows):
    """rows [T, K] gathered into tiles [n, size, K] in fp32; padding entries (index T) read row 0.

    What padding entries compute is never used: it goes to a scratch row or is filtered out.
    """
    index = tile_rows.clamp(max=rows.shape[0] - 1).flatten()
    return rows.index_select(0, index).view(*tile_rows.shape, rows.shape[1]).float()


def lora_shrink_bgmv(x, a_stack, token_slots, ranks):
    """Per-row gather shrink: out[t, :rank] = x[t] @ A[slot[t], :rank].T; zeros elsewhere."""
    num_rows = x.shape[0]
    out = torch.zeros(num_rows + 1, a_stack.shape[1], dtype=torch.float32, device=x.device)  # row T: scratch
    for rank, tile_slots, tile_rows in _adapter_tiles(token_slots, ranks):
        a = a_stack[:, :rank].index_select(0, tile_slots).float()  # [n, rank, H_in]
        prod = torch.bmm(_gather_tiles(x, tile_rows), a.transpose(1, 2))  # [n, size, rank]
        out[:, :rank].index_copy_(0, tile_rows.flatten(), prod.flatten(0, 1))  # padding -> scratch row
    return out[:num_rows].to(x.dtype)


def lora_expand_bgmv(y, v, b_stack, token_slots, ranks, scales):
    """Per-row gather expand, in place: y[t] += scale[slot] * v[t, :rank] @ B[slot, :, :rank].T."""
    num_rows = v.shape[0]
    scales = scales.to(y.device).float()
    for rank, tile_slots, tile_rows in _adapter_tiles(token_slots, ranks):
        b = b_stack[:, :, :rank].index_select(0, tile_slots).float()  # [n, H_out, rank]
        vt = _gather_tiles(v[:, :rank], tile_rows) * scales[tile_slots][:, None, None]  # [n, size, rank]
        delta = torch.bmm(vt, b.transpose(1, 2)).flatten(0, 1)  # [n * size, H_out]
        rows = tile_rows.flatten()
        if rows.max() >= num_rows:  # drop the padding entries
            real = (rows < num_rows).nonzero().squeeze(1)
            delta, rows = delta.index_select(0, real), rows.index_select(0, real)
        y.index_add_(0, rows, delta.to(y.dtype))  # each row once: y[row] += delta in y's dtype
    return y


def lora_shrink_bgmv_group(x, a_stacks, token_slots, ranks):
    """The shrinks of a fused group (one max rank R): [T, G * R], module g's lora_shrink_bgmv in columns
    [g * R, (g + 1) * R)."""
    return torch.cat([lora_shrink_bgmv(x, a, token_slots, r) for a, r in zip(a_stacks, ranks)], dim=1)


def lora_expand_bgmv_group(v, ys, b_stacks, token_slots, ranks, scales):
    """The expands of a fused group, in place: ys[g] += scale_g * v[:, g*R : g*R + rank] @ B_g[slot].T."""
    max_rank = b_stacks[0].shape[2]
    for g, (y, b, r, s) in enumerate(zip(ys, b_stacks, ranks, scales)):
        lora_expand_bgmv(y, v[:, g * max_rank:(g + 1) * max_rank], b, token_slots, r, s)
    return ys


def _segment_token_slots(seg_starts, seg_slots, num_rows):
    """Per-row slots of a segment layout: seg_slots[g] on rows seg_starts[g]:seg_starts[g+1], -1 elsewhere."""
    num_segs = seg_slots.numel()
    row = torch.arange(num_rows, device=seg_slots.device)
    if num_segs == 0:
        return torch.full_like(row, -1)
    starts = seg_starts.to(seg_slots.device).long()
    seg = torch.searchsorted(starts, row, right=True) - 1  # the last segment that starts at or before the row
    inside = (seg >= 0) & (seg < num_segs)  # not before the first start, not at or after the last end
    return torch.where(inside, seg_slots.long()[seg.clamp(0, num_segs - 1)], -1)


def _step_token_slots(seg_starts, seg_slots, num_rows):
    """_segment_token_slots once per step: the same tensor each time, so the tiles memo hits too."""
    key = (seg_slots.data_ptr(), num_rows)
    return _SEGMENT_SLOTS.get(seg_starts, key, lambda: _segment_token_slots(seg_starts, seg_slots, num_rows))


def lora_shrink_sgmv(x, a_stack, seg_starts, seg_slots, ranks):
    """Segmented shrink: like lora_shrink_bgmv with one adapter per contiguous segment."""
    return lora_shrink_bgmv(x, a_stack, _step_token_slots(seg_starts, seg_slots, x.shape[0]), ranks)


def lora_expand_sgmv(y, v, b_stack, seg_starts, seg_slots, ranks, scales):
    """Segmented expand, in place: y[seg] += scale * v[seg, :rank] @ B[slot, :, :rank].T."""
    token_slots = _step_token_slots(seg_starts, seg_slots, v.shape[0])
    return lora_expand_bgmv(y, v, b_stack, token_slots, ranks, scales)


# ---------------------------------------------------------------------------------------------
# Layer ops without a .cu kernel (CUDA takes these; fp32 CPU tensors take cpu_native's)
# ---------------------------------------------------------------------------------------------

_ROPE_ROWS = PerStepMemo()


def fp16_linear_pack(weight, bias=None):
    """A linear layer's weight (and bias) in fp16 for FBGEMM's fp16-weight GEMM (CPU, fp32 compute)."""
    return torch.ops.quantized.linear_prepack_fp16(weight.float(), None if bias is None else bias.float())


def fp16_linear(x, packed):
    """x @ W.T + b with W packed by fp16_linear_pack: each weight read as its fp16 value, products summed in fp32."""
    return torch.ops.quantized.linear_dynamic_fp16(x, packed)


class Int8Linear(NamedTuple):
    """An int8 linear layer for int8_linear: W = qweight * scale[:, None] (per output channel), bias or None."""

    qweight: torch.Tensor  # int8 [N, K], contiguous
    scale: torch.Tensor  # fp32 [N]
    bias: torch.Tensor | None  # fp32 [N]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]


def int8_linear_pack(qweight, scale, bias=None) -> Int8Linear:
    """qweight int8 [N, K] with per-output-channel scales [N] (and a bias [N]) for int8_linear."""
    return Int8Linear(qweight.contiguous(), scale.float().contiguous(), None if bias is None else bias.float())


def int8_linear(x, packed: Int8Linear, out=None):
    """x [M, K] fp32 @ (qweight * scale[:, None]).T + bias in fp32, the weights kept in int8 (torch's
    weight-only int8 GEMM)."""
    y = torch._weight_int8pack_mm(x.float().contiguous(), packed.qweight, packed.scale)
    if packed.bias is not None:
        y += packed.bias
    if out is not None:
        out.copy_(y)
        return out
    return y



# ---------------------------------------------------------------------------------------------
# Quantized linear layers: FP8 and INT4 W4A16 (layouts: quant_args; the .cu kernels in quant_linear.cu)
# ---------------------------------------------------------------------------------------------


def fp8_dequantize(weight, scale, block=None):
    """W [N, K] in fp32 of an FP8 weight: float(weight[n, k]) * scale[n // bn, k // bk] (quant_args)."""
    n, k = weight.shape
    rows, inputs, cols = quant_args.fp8_layout(weight.new_empty((1, k), dtype=torch.float32), weight, scale, block)
    grid = scale.float().reshape(-1, cols)
    full = grid.repeat_interleave(rows, 0)[:n].repeat_interleave(inputs, 1)[:, :k]
    return weight.float() * full


def int4_dequantize(qweight, scales, zeros, group_size, in_features):
    """W [N, K] in fp32 of an INT4 weight with K = in_features: (q[n, k] - zeros[n, k // G]) * scales[n, k // G]."""
    quant_args.check_w4a16(qweight.new_empty((1, in_features), dtype=torch.float32), qweight, scales, zeros,
                           group_size)
    n = qweight.shape[0]
    q = torch.stack([qweight & 15, qweight >> 4], dim=-1).reshape(n, -1)[:, :in_features]
    group = torch.arange(in_features, device=qweight.device) // group_size
    return (q.float() - zeros.float()[:, group]) * scales.float()[:, group]


def quantized_linear(x, w32, bias=None):
    """x [..., K] @ W.T + bias for a dequantized W [N, K] (fp32): W rounded to x's dtype (the weights a model in
    that dtype holds), products and sums in fp32, the bias added in fp32, the result rounded once to x's dtype."""
    w = w32.to(x.dtype).float()
    y = x.reshape(-1, x.shape[-1]).float() @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def fp8_linear(x, weight, scale, block=None, bias=None):
    """x [..., K] @ W.T + bias with W from an FP8 weight (float8_e4m3fn [N, K]; scale per tensor [1], per output
    channel [N], or per block [ceil(N / bn), ceil(K / bk)] with block = (bn, bk)): dequantize, then
    quantized_linear."""
    quant_args.fp8_layout(x, weight, scale, block, bias)
    return quantized_linear(x, fp8_dequantize(weight, scale, block), bias)


def w4a16_linear(x, qweight, scales, zeros, group_size, bias=None):
    """x [..., K] @ W.T + bias with W from an INT4 weight (qweight uint8 [N, ceil(K / 2)], even k in the low nibble;
    scales and zeros [N, ceil(K / G)]): dequantize, then quantized_linear."""
    quant_args.check_w4a16(x, qweight, scales, zeros, group_size, bias)
    return quantized_linear(x, int4_dequantize(qweight, scales, zeros, group_size, x.shape[-1]), bias)

def add_rms_norm(x, delta, weight, eps):
    """x += delta in place (when given: the residual add), then RMSNorm(x) * weight in fp32, as HF computes it."""
    if delta is not None:
        x.add_(delta)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # the same values in fewer ops
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_mul(gate, up):
    """silu(gate) * up (LLaMA's MLP activation)."""
    return F.silu(gate) * up


def rotate_qk(q, k, positions, cos, signed_sin):
    """q [T, Hq, D] and k [T, Hkv, D] rotated by positions [T] through tables [max_len, D]: HF's
    x * cos + rotate_half(x) * sin, as x * cos + roll(x, D/2) * signed_sin (new tensors; the native op
    rotates in place). The table rows are gathered once per step's positions tensor."""
    c, s = _ROPE_ROWS.get(positions, (cos.data_ptr(),),
                          lambda: (cos[positions][:, None], signed_sin[positions][:, None]))
    half = q.shape[-1] // 2
    return q * c + q.roll(half, -1) * s, k * c + k.roll(half, -1) * s


# ---------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------


def _write_rows(slot_mapping):
    """(flat slots to write int64, the rows they take: None for all of them)."""
    keep = slot_mapping >= 0
    if bool(keep.all()):
        return slot_mapping.long(), None
    return slot_mapping[keep].long(), keep.nonzero().squeeze(1)


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """Store new keys/values [T, Hkv, D] at flat slots (block * block_size + offset); slot < 0 skips."""
    slots, rows = _WRITE_ROWS.get(slot_mapping, (), lambda: _write_rows(slot_mapping.to(k_cache.device)))
    for cache, new in ((k_cache, k), (v_cache, v)):
        if rows is not None:
            new = new.index_select(0, rows)
        if new.dtype != cache.dtype:
            new = new.to(cache.dtype)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, new)  # [num_blocks * block_size, Hkv, D]: a slot a row


def copy_blocks(kv_cache, src, dst):
    """Copy-on-write: kv_cache[..., dst[i], ...] = kv_cache[..., src[i], ...] for all layers.

    kv_cache is [num_layers, 2, num_blocks, block_size, Hkv, D].
    """
    if len(src):
        kv_cache[:, :, dst.long()] = kv_cache[:, :, src.long()]


# ---------------------------------------------------------------------------------------------
# Paged attention
# ---------------------------------------------------------------------------------------------

# Sequences are attended in chunks whose padded per-KV-head tensors (gathered K, gathered V,
# scores) stay under this many elements each: large enough that chunks are few, small enough
# that the temporaries stay in cache and in memory the allocator reuses.
_CHUNK_ELEMENTS = 1 << 18


def _context_rows(block_tables, context_lens, block_size, first=None):
    """Where each sequence's cached tokens are: (blocks [B, n] int64, outside [m] int64).

    blocks lists each sequence's first n = ceil(max context / block_size) blocks, with entries
    past its context, or wholly before first[b] (its first visible key, when given), replaced by
    block 0 (they may be stale or invalid: they are never followed); gathered rows are [B, L =
    n * block_size], and outside holds the flat indices b * L + p of the rows at positions
    p >= context_lens[b] or p < first[b], which must be zeroed.
    """
    dev = block_tables.device
    num_blocks = -(-int(context_lens.max()) // block_size) if block_tables.shape[0] else 0
    ctx = context_lens.to(dev).long()[:, None]
    start = torch.arange(num_blocks, device=dev) * block_size
    used = start < ctx
    position = torch.arange(num_blocks * block_size, device=dev)
    outside = position >= ctx  # [B, L]
    if first is not None:
        first = first.to(dev).long()[:, None]
        used &= start + block_size > first
        outside |= position < first
    blocks = torch.where(used, block_tables[:, :num_blocks].long(), 0)
    return blocks, outside.flatten().nonzero().squeeze(1)


def _gather_head(cache, h, blocks, outside):
    """KV head h of the cached tokens [B, L, D] in fp32, zero at positions outside each context.

    The cache rows past a context (the tail of its last block) may hold anything, NaN included:
    they are overwritten with zeros (a select, not a multiplication) before any arithmetic.
    """
    rows = cache[:, :, h].index_select(0, blocks.flatten().to(cache.device))  # [B * n, block_size, D]
    rows = rows.flatten(0, 1).index_fill_(0, outside.to(cache.device), 0)  # [B * L, D]
    return rows.view(blocks.shape[0], blocks.shape[1] * cache.shape[1], cache.shape[-1]).float()


# Up to this many gathered K elements (all KV heads of a chunk), one batched matmul serves every
# KV head: fewer, larger ops, which wins while op overhead dominates (a decode stream, a few short
# ones, a short prefill). Beyond it the head-major copy of K and V costs more than it saves, so each
# KV head takes its own matmuls (decision 042).
_ALL_HEADS_ELEMENTS = 1 << 19


def _layout(q_pos, block_tables, context_lens, block_size, window=None):
    """What _attend needs besides q and the caches: (blocks, outside, bias [B, Lq, L], answered [B, Lq, 1, 1])."""
    q_pos, first = q_pos.long(), None
    if window is not None:  # nothing before the window of a sequence's earliest query is read
        earliest = torch.where(q_pos >= 0, q_pos, torch.iinfo(torch.int64).max).amin(1)
        first = (earliest - window + 1).clamp(min=0)
    blocks, outside = _context_rows(block_tables, context_lens, block_size, first)
    length = blocks.shape[1] * block_size
    key = torch.arange(length, device=q_pos.device)
    visible = key <= q_pos[:, :, None]  # [B, Lq, L]
    if window is not None:
        visible &= key > q_pos[:, :, None] - window
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=q_pos.device).masked_fill_(~visible, float("-inf"))
    return blocks, outside, bias, (q_pos >= 0)[:, :, None, None]


def _cap(scores, softcap):
    """Logit soft-capping in place (None: none): softcap * tanh(scores / softcap), as Gemma 2 computes it."""
    if softcap is not None:
        scores.div_(softcap).tanh_().mul_(softcap)
    return scores


def _attend(q, q_pos, k_cache, v_cache, block_tables, context_lens, scale, layout=None, window=None, softcap=None):
    """Attention of a padded batch of queries over paged KV, in fp32: [B, Lq, Hq, D].

    q [B, Lq, Hq, D]; q_pos [B, Lq]: the cache position of each query, which sees the keys at
    positions 0..q_pos (its own included; with a window only the last window of them). q_pos = -1
    sees nothing and gives zeros (padding queries, empty contexts). Query heads h*G..h*G+G-1 use
    KV head h, G = Hq // Hkv (GQA). ``layout``: _layout's result for these arguments (and window),
    when the caller has it already.
    """
    num_seqs, num_q, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    if layout is None:
        layout = _layout(q_pos.to(q.device), block_tables, context_lens, k_cache.shape[1], window)
    blocks, outside, bias, answered = layout
    length = bias.shape[-1]
    q = q.float()
    if num_seqs == 1 and num_q == 1:  # one decode stream: torch's fused attention (fewest ops)
        out = _attend_sdpa(q, k_cache, v_cache, blocks, outside, bias, scale, softcap)
    elif num_seqs * length * hkv * d <= _ALL_HEADS_ELEMENTS:
        out = _attend_all_heads(q, k_cache, v_cache, blocks, outside, bias, scale, softcap)
    else:
        out = torch.empty(num_seqs, num_q, hq, d, dtype=torch.float32, device=q.device)
        for h in range(hkv):  # the group of query heads that shares KV head h: one batched matmul each
            k, v = _gather_head(k_cache, h, blocks, outside), _gather_head(v_cache, h, blocks, outside)
            heads = slice(h * group, (h + 1) * group)
            qh = q[:, :, heads].reshape(num_seqs, num_q * group, d)
            scores = _cap(torch.bmm(qh, k.transpose(1, 2)).view(num_seqs, num_q, group, length) * scale, softcap)
            scores += bias[:, :, None]  # -inf where the key is not visible (keys there are zero, not NaN)
            probs = torch.softmax(scores, dim=-1)  # NaN for a query that sees no key; replaced below
            o = torch.bmm(probs.view(num_seqs, num_q * group, length), v)
            out[:, :, heads] = o.view(num_seqs, num_q, group, d)
    return torch.where(answered, out, 0.0)


def _gather_all_heads(cache, blocks, outside):
    """Like _gather_head for every KV head at once: [B, Hkv, L, D] in fp32 (a view), zero outside each context."""
    rows = cache.index_select(0, blocks.flatten().to(cache.device)).flatten(0, 1)  # [B * L, Hkv, D]
    rows.index_fill_(0, outside.to(cache.device), 0)
    return rows.view(blocks.shape[0], -1, *cache.shape[2:]).float().transpose(1, 2)


def _attend_all_heads(q, k_cache, v_cache, blocks, outside, bias, scale, softcap=None):
    """_attend's matmuls for every KV head at once: K and V gathered once, head-major [B * Hkv, L, D]."""
    num_seqs, num_q, hq, d = q.shape
    hkv = k_cache.shape[2]
    group, length = hq // hkv, bias.shape[-1]
    k, v = (_gather_all_heads(c, blocks, outside).reshape(num_seqs * hkv, length, d) for c in (k_cache, v_cache))
    qh = q.view(num_seqs, num_q, hkv, group, d).transpose(1, 2).reshape(num_seqs * hkv, num_q * group, d)
    scores = _cap(torch.bmm(qh, k.transpose(1, 2)).view(num_seqs, hkv, num_q, group, length) * scale, softcap)
    scores += bias[:, None, :, None]
    probs = torch.softmax(scores, dim=-1)
    o = torch.bmm(probs.view(num_seqs * hkv, num_q * group, length), v)
    return o.view(num_seqs, hkv, num_q, group, d).transpose(1, 2).reshape(num_seqs, num_q, hq, d)


def _attend_sdpa(q, k_cache, v_cache, blocks, outside, bias, scale, softcap=None):
    """_attend_all_heads through torch's fused CPU attention: K and V gathered once, no head-major copy."""
    k, v = _gather_all_heads(k_cache, blocks, outside), _gather_all_heads(v_cache, blocks, outside)
    return sdpa(q.transpose(1, 2), k, v, bias[:, None], scale, softcap).transpose(1, 2)


def sdpa(q, k, v, bias, scale, softcap=None):
    """Attention of q [B, Hq, Lq, D] over k, v [B, Hkv, L, D] (GQA: query head h uses KV head h // (Hq / Hkv))
    with an additive bias broadcast to [B, 1, Lq, L] (None: every key): torch's fused attention, or without it
    when scores are soft-capped (it has no such option): matmul, scale, cap, bias, softmax, as transformers'
    eager attention."""
    gqa = q.shape[1] != k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=gqa)
    num_seqs, hq, num_q, d = q.shape
    hkv = k.shape[1]
    qh = q.reshape(num_seqs, hkv, hq // hkv * num_q, d)  # each KV head's query heads, one after another
    scores = _cap(torch.matmul(qh, k.transpose(-1, -2)) * scale, softcap).view(num_seqs, hkv, hq // hkv, num_q, -1)
    if bias is not None:
        scores += bias.view(bias.shape[0], 1, 1, num_q, -1)
    probs = torch.softmax(scores, dim=-1).view(num_seqs, hkv, -1, scores.shape[-1])
    return torch.matmul(probs, v).view(num_seqs, hq, num_q, d)


def _chunk(per_seq_elements):
    """Sequences per batched step so that no padded tensor exceeds _CHUNK_ELEMENTS."""
    return max(1, _CHUNK_ELEMENTS // max(1, per_seq_elements))


def _decode_each(q, k_cache, v_cache, block_tables, context_lens, scale, window=None, softcap=None):
    """paged_attention_decode one sequence at a time, each over exactly its visible keys: the rows of its
    context (with a window, of its last window positions) gathered by blocks and cut to them (no padding, so
    no mask and no zeroing), then torch's fused attention."""
    block_size = k_cache.shape[1]

    def contexts():  # per sequence: (its blocks from the first visible key's, that key's offset in them, count)
        tables, seqs = block_tables.to(k_cache.device).long(), []
        for b, n in enumerate(context_lens.tolist()):
            first = max(0, n - window) if window is not None else 0
            seqs.append((tables[b, first // block_size : -(-n // block_size)], first % block_size, n - first))
        return seqs

    def attend(b, blocks, offset, length):  # [1, Hq, 1, D] in fp32
        k, v = (c.index_select(0, blocks).flatten(0, 1)[offset : offset + length].transpose(0, 1)[None]
                for c in (k_cache, v_cache))
        qb = q[b, None, :, None]
        if k.dtype != torch.float32:
            qb, k, v = qb.float(), k.float(), v.float()
        return sdpa(qb, k, v, None, scale, softcap)

    seqs = _DECODE_LAYOUTS.get(context_lens, ("each", block_size, block_tables.data_ptr(), window), contexts)
    if len(seqs) == 1 and seqs[0][2] > 0:  # one stream: the fewest ops
        return attend(0, *seqs[0])[:, :, 0].to(q.dtype)
    out = torch.zeros_like(q)  # a sequence with an empty context sees nothing: zeros
    for b, (blocks, offset, length) in enumerate(seqs):
        if length > 0:
            out[b] = attend(b, blocks, offset, length)[0, :, 0].to(q.dtype)
    return out


def _decode_buckets(q, k_cache, v_cache, block_tables, context_lens, scale, window=None, softcap=None):
    """paged_attention_decode over buckets of sequences of similar context lengths, each bucket one fused
    SDPA call for every head with a padding mask (after _gather_all_heads zeroed the padding rows)."""
    block_size = k_cache.shape[1]
    key = ("buckets", block_size, block_tables.data_ptr(), tuple(block_tables.shape), window)
    plan = _DECODE_LAYOUTS.get(context_lens, key, lambda: _bucket_plan(block_tables, context_lens, block_size,
                                                                        k_cache.shape[2] * k_cache.shape[3], window))
    out = torch.zeros_like(q)  # a sequence with an empty context sees nothing: zeros
    for seqs, blocks, outside, bias in plan:
        o = _attend_sdpa(q.index_select(0, seqs)[:, None].float(), k_cache, v_cache, blocks, outside, bias, scale,
                         softcap)
        out.index_copy_(0, seqs, o[:, 0].to(q.dtype))
    return out


def _bucket_plan(block_tables, context_lens, block_size, row_elements, window=None):
    """[(sequences int64, blocks, outside, bias)] per bucket: sequences sorted by context length and cut where
    the longest would pass BUCKET_SLACK times the shortest plus a block, or the bucket's K BUCKET_ELEMENTS."""
    order = sorted((n, b) for b, n in enumerate(context_lens.tolist()) if n > 0)
    plan, first = [], 0
    while first < len(order):
        shortest, end = order[first][0], first + 1
        while (end < len(order) and order[end][0] <= BUCKET_SLACK * shortest + block_size
               and (end + 1 - first) * order[end][0] * row_elements <= BUCKET_ELEMENTS):
            end += 1
        seqs = torch.tensor([b for _, b in order[first:end]], device=block_tables.device)
        lens = context_lens.index_select(0, seqs.to(context_lens.device))
        blocks, outside, bias, _answered = _layout(lens.long()[:, None] - 1, block_tables[seqs], lens, block_size,
                                                   window)
        plan.append((seqs, blocks, outside, bias))
        first = end
    return plan


def _cpu_decode_way(context_lens, k_cache) -> str:
    """How the CPU attends this decode batch: one stream always "each" (the fewest ops), else CPU_DECODE,
    whose "auto" is decided once per step by _decode_each_pays."""
    if context_lens.shape[0] == 1:
        return "each"
    if CPU_DECODE != "auto":
        return CPU_DECODE
    pays = _DECODE_LAYOUTS.get(context_lens, "each pays", lambda: _decode_each_pays(context_lens, k_cache))
    return "each" if pays else "buckets"


def _decode_each_pays(context_lens, k_cache) -> bool:
    """Whether _decode_each beats the buckets: on one thread, contexts of EACH_MIN_BYTES of K/V on average."""
    if torch.get_num_threads() != 1:
        return False
    row_bytes = 2 * k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()  # K and V of one token
    return sum(context_lens.tolist()) * row_bytes >= EACH_MIN_BYTES * context_lens.shape[0]


# How the CPU attends a decode batch ("auto": the rule below; "each", "buckets" or "padded" to force one).
# auto: one sequence at a time over exactly its context (_decode_each) on one thread when the contexts
# hold EACH_MIN_BYTES of K/V a layer on average (the loop's ops are then paid for); else buckets of
# similar lengths, one fused SDPA each (_decode_buckets). The padded batch (_attend's matmuls over
# chunks in their order) is what a CUDA tensor gets here. Buckets move fewer bytes than the padded batch
# at long-tailed contexts; the loop pays only for long contexts on one thread, its small ops losing at
# short contexts and on more threads (decision 042 has the figures).
CPU_DECODE = "auto"
EACH_MIN_BYTES = 256 << 10
BUCKET_SLACK = 1.5
BUCKET_ELEMENTS = 1 << 22


def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale, window=None, softcap=None):
    """One query per sequence [B, Hq, D] over its cached context (with a window, its last window positions)
    -> [B, Hq, D]."""
    num_seqs, hq, d = q.shape
    way = _cpu_decode_way(context_lens, k_cache) if q.device.type == "cpu" and num_seqs else "padded"
    if way == "each":
        return _decode_each(q, k_cache, v_cache, block_tables, context_lens, scale, window, softcap)
    if way == "buckets":
        return _decode_buckets(q, k_cache, v_cache, block_tables, context_lens, scale, window, softcap)
    out = torch.empty_like(q)
    length = int(context_lens.max()) if num_seqs else 0
    step = _chunk(length * max(hq // k_cache.shape[2], d))  # per KV head: scores, gathered K / V
    block_size = k_cache.shape[1]
    for lo in range(0, num_seqs, step):
        seqs = slice(lo, lo + step)

        def layout():
            q_pos = context_lens[seqs].to(q.device).long()[:, None] - 1  # the new token is the last one in the cache
            return q_pos, _layout(q_pos, block_tables[seqs], context_lens[seqs], block_size, window)

        key = (lo, step, block_size, block_tables.data_ptr(), tuple(block_tables.shape), window)
        q_pos, rows = _DECODE_LAYOUTS.get(context_lens, key, layout)  # every layer of a step asks the same
        o = _attend(q[seqs, None], q_pos, k_cache, v_cache, block_tables[seqs], context_lens[seqs], scale, rows,
                    softcap=softcap)
        out[seqs] = o[:, 0].to(q.dtype)
    return out


def paged_attention_prefill(q, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale, window=None,
                            softcap=None):
    """New tokens [T, Hq, D] attend causally to themselves and their cached prefix (with a window, each to the
    last window positions up to its own)."""
    out = torch.empty_like(q)
    dev, (hq, d), hkv = q.device, q.shape[1:], k_cache.shape[2]
    cu, ctx = cu_query_lens.to(dev).long(), context_lens.to(dev).long()
    counts = cu[1:] - cu[:-1]  # new tokens per sequence; they end its context
    # sequences whose counts round up to the same power of two form one padded batch (< 2x padding)
    bucket = torch.ceil(torch.log2(counts.double()))  # -inf for sequences without new tokens
    for b in torch.unique(bucket[counts > 0]).tolist():
        members = (bucket == b).nonzero().squeeze(1)
        num_q, length = int(counts[members].max()), int(ctx[members].max())
        step = _chunk(length * max(num_q * (hq // hkv), d))  # per KV head: scores, gathered K / V
        for lo in range(0, members.numel(), step):
            seqs = members[lo : lo + step]
            i = torch.arange(num_q, device=dev)
            real = i < counts[seqs, None]  # [b, num_q]; the rest pads the batch
            rows = torch.where(real, cu[seqs, None] + i, 0)
            q_pos = torch.where(real, ctx[seqs, None] - counts[seqs, None] + i, -1)
            tables = block_tables[seqs.to(block_tables.device)]
            o = _attend(q[rows], q_pos, k_cache, v_cache, tables, ctx[seqs], scale, window=window, softcap=softcap)
            out[rows[real]] = o[real].to(q.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# Greedy sampling
# ---------------------------------------------------------------------------------------------


def argmax_rows(logits):
    """Each row's index of its largest logit (the first of ties; NaN counts as largest), int64, and whether every
    logit is finite (one reduction: a NaN or infinity anywhere shows in the sum)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64) and not logits.requires_grad:
        tokens = torch.from_numpy(logits.numpy().argmax(axis=1))  # numpy's argmax: the faster one on a CPU
    else:
        tokens = torch.argmax(logits, dim=-1)
    return tokens, math.isfinite(logits.sum().item())


# ---------------------------------------------------------------------------------------------
# A repeated decode step's host arrays
# ---------------------------------------------------------------------------------------------


def advance_decode(positions, slot_mapping, context_lens, block_tables, block_size: int) -> None:
    """The next decode step's host arrays (numpy) from the last one's, in place: each position + 1, its context
    length (position + 1) and its KV slot (its block in the row's block table [rows, width], and the offset)."""
    positions += 1
    np.add(positions, 1, out=context_lens, casting="unsafe")
    block, offset = np.divmod(positions, block_size)
    np.multiply(block_tables[np.arange(len(positions)), block], block_size, out=slot_mapping, casting="unsafe")
    slot_mapping += offset
