"""Loraplex kernels: each call goes to its .cu kernel or its torch path (``dispatch``).

CUDA tensors run the kernels through CuPy; fp32 CPU tensors run the native C ops
(``cpu_native``) where they serve the call, else the torch reference; or the kernels on the
CPU shim under ``LORAPLEX_KERNELS=shim``. An op whose kernel cannot serve
the model's shapes takes the torch path (``preconditions``; ``check_model`` logs it at
start-up). The backend calls only the functions exported here. CuPy is imported only when
a CUDA tensor arrives, so CPU-only users never need it.
"""

from __future__ import annotations

import torch

from loraplex.kernels import amx_bf16, cpu_native, dispatch, reference
from loraplex.kernels.dispatch import check_model, run, uses_kernels
from loraplex.kernels.launch_args import attention_variant
from loraplex.kernels.prefill_sdpa import remember_host_lengths


def lora_shrink_bgmv(x, a_stack, token_slots, ranks):
    """Per-row gather shrink: out[t, :rank] = x[t] @ A[slot[t], :rank].T; zeros elsewhere."""
    return run("lora_shrink_bgmv", x, a_stack, token_slots, ranks)


def lora_expand_bgmv(y, v, b_stack, token_slots, ranks, scales):
    """Per-row gather expand, in place: y[t] += scale[slot] * v[t, :rank] @ B[slot, :, :rank].T."""
    return run("lora_expand_bgmv", y, v, b_stack, token_slots, ranks, scales)


def lora_shrink_bgmv_group(x, a_stacks, token_slots, ranks):
    """The shrinks of up to three modules reading x (q/k/v, gate/up) at once: [T, G * R], module g in columns
    [g * R, (g + 1) * R)."""
    return run("lora_shrink_bgmv_group", x, a_stacks, token_slots, ranks)


def lora_expand_bgmv_group(v, ys, b_stacks, token_slots, ranks, scales):
    """The expands of a fused group at once, in place: ys[g] += scale_g * v[:, g*R : g*R + rank] @ B_g.T."""
    return run("lora_expand_bgmv_group", v, ys, b_stacks, token_slots, ranks, scales)


def lora_shrink_sgmv(x, a_stack, seg_starts, seg_slots, ranks):
    """Segmented shrink: like lora_shrink_bgmv with one adapter per contiguous segment."""
    return run("lora_shrink_sgmv", x, a_stack, seg_starts, seg_slots, ranks)


def lora_expand_sgmv(y, v, b_stack, seg_starts, seg_slots, ranks, scales):
    """Segmented expand, in place: y[seg] += scale * v[seg, :rank] @ B[slot, :, :rank].T."""
    return run("lora_expand_sgmv", y, v, b_stack, seg_starts, seg_slots, ranks, scales)


def add_rms_norm(x, delta, weight, eps):
    """x += delta in place (when given: the residual add), then RMSNorm(x) * weight as a new tensor."""
    return run("add_rms_norm", x, delta, weight, eps)


def silu_mul(gate, up):
    """silu(gate) * up."""
    return run("silu_mul", gate, up)


def rotate_qk(q, k, positions, cos, signed_sin):
    """(q, k) rotated by positions through RoPE tables [max_len, D]; may rotate the inputs in place."""
    return run("rotate_qk", q, k, positions, cos, signed_sin)


def argmax_rows(logits):
    """(each row's index of its largest logit: the first of ties, the first NaN where there is one; whether
    every logit is finite): one native pass over fp32 CPU logits, else two torch ops."""
    return run("argmax_rows", logits)


def native_layer_ops(device, dtype, head_dim: int) -> bool:
    """Whether a model on device in dtype calls cpu_native's layer ops (add_rms_norm, silu_mul, rotate_qk,
    write_kv, paged_attention_decode) directly: fp32 on the CPU, mode auto, the library built, a head dim it
    takes. Direct calls skip the per-call checks; a model's own tensors have the layouts they take."""
    return (torch.device(device).type == "cpu" and dtype == torch.float32 and dispatch.MODE == "auto"
            and cpu_native.library() is not None and head_dim % 2 == 0
            and head_dim <= cpu_native.library().lp_max_head_dim())


def set_native_threads(n: int) -> None:
    """Threads of the native CPU ops' parallel loops (the fp16 GEMM, decode attention), process-wide; torch's
    own ops keep torch.set_num_threads'."""
    cpu_native.set_threads(n)


def native_threads() -> int:
    """The native CPU ops' thread count (0 when they are not built here)."""
    return cpu_native.threads()


def linear_pack(weight, bias=None, half: bool = True):
    """A CPU linear layer's weight (and bias) for packed_linear, in fp16 (half) or fp32: panels for the native
    GEMM where it is built and LORAPLEX_KERNELS is auto; else, for fp16, FBGEMM's packing (fp32 has no
    fallback here: callers pack fp32 only where panels_native())."""
    if dispatch.MODE == "auto" and cpu_native.panels_native():
        return cpu_native.Panels(weight.float(), None if bias is None else bias.float(), half)
    if not half:
        raise ValueError("fp32 packing needs the native GEMM (LORAPLEX_KERNELS=auto and a C compiler)")
    return reference.fp16_linear_pack(weight, bias)


def _int8_args(qweight, scale, bias) -> None:
    """ValueError naming the argument of linear_pack_int8 that is not what it takes."""
    if qweight.dtype != torch.int8 or qweight.dim() != 2 or qweight.device.type != "cpu":
        raise ValueError(f"linear_pack_int8: qweight must be a 2-D int8 CPU tensor, not {qweight.dtype} "
                         f"{tuple(qweight.shape)} on {qweight.device}")
    n = qweight.shape[0]
    for name, t in (("scale", scale), ("bias", bias)):
        if t is not None and (not t.is_floating_point() or tuple(t.shape) != (n,) or t.device.type != "cpu"):
            raise ValueError(f"linear_pack_int8: {name} must be a floating CPU tensor of shape ({n},), not "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")


def linear_pack_int8(qweight, scale, bias=None):
    """An int8 linear layer for packed_linear: W = qweight * scale[:, None] (qweight int8 [N, K], per-output-channel
    scale [N], symmetric), bias [N] or None. Fused projections are row-concatenations of qweight and scale. Native
    int8 panels where the native GEMM is built and LORAPLEX_KERNELS is auto (VNNI where the CPU has it: products
    within ~1e-5 of x @ W.T relative to |x| |W[n]|; else weights converted to fp32), which DecodeForward takes;
    else torch's weight-only int8 GEMM."""
    _int8_args(qweight, scale, bias)
    if dispatch.MODE == "auto" and cpu_native.int8_isa() != cpu_native.INT8_NONE:
        return cpu_native.Panels.int8(qweight, scale.float(), None if bias is None else bias.float())
    return reference.int8_linear_pack(qweight, scale, bias)


def packed_linear(x, packed, out=None):
    """x @ W.T + b [M, N] in fp32 with W from linear_pack or linear_pack_int8 (each weight read as its stored
    value): the GEMM its packing was made for; into `out` (contiguous fp32 [M, N]) when given (the fp16 FBGEMM
    packing ignores it)."""
    if isinstance(packed, cpu_native.Panels):
        return cpu_native.packed_linear(x, packed, out)
    if isinstance(packed, reference.Int8Linear):
        return reference.int8_linear(x, packed, out)
    return reference.fp16_linear(x, packed)


def bf16_linear(x, packed, parts, out=None):
    """x [M, K] fp32 @ W.T + b -> [M, N] fp32 on AMX-BF16 tiles (amx_bf16), W linear_pack's fp32 or fp16 panels: x and
    W each split into parts bf16 parts, the products of parts i + j < parts summed in fp32 (2: bf16x3, 16 significant
    bits of each; 1: plain bf16), the output fp32; into `out` (fp32 [M, N], rows contiguous) when given. On the
    native ops' threads. Only where bf16_tiles(packed)."""
    return amx_bf16.linear(x, packed, parts, cpu_native.threads(), out)


def bf16_tiles(packed=None) -> bool:
    """Whether bf16_linear runs here (AMX-BF16 in the CPU and compiler, the tiles granted, LORAPLEX_KERNELS auto) and,
    given packed, takes it (fp32 or fp16 panels)."""
    if dispatch.MODE != "auto" or not amx_bf16.available():
        return False
    return packed is None or (isinstance(packed, cpu_native.Panels) and amx_bf16.serves(packed))


def fp8_linear(x, weight, scale, block=None, bias=None):
    """x [..., K] @ W.T + bias -> [..., N] in x's dtype, W from FP8 weights: weight float8_e4m3fn [N, K] and scale
    [1] (per tensor), [N] (per output channel) or [ceil(N / bn), ceil(K / bk)] with block (bn, bk). W rounded to
    x's dtype, products summed in fp32 (reference.fp8_linear); CUDA: GEMV for decode rows, tensor-core GEMM for
    prefill (quant_launch)."""
    return run("fp8_linear", x, weight, scale, block, bias)


def w4a16_linear(x, qweight, scales, zeros, group_size, bias=None):
    """x [..., K] @ W.T + bias -> [..., N] in x's dtype, W[n, k] = (q[n, k] - zeros[n, k // G]) * scales[n, k // G]:
    qweight uint8 [N, ceil(K / 2)] (even k in the low nibble), scales float16/bfloat16/float32 and zeros uint8
    [N, ceil(K / G)], G = group_size. W rounded to x's dtype, products summed in fp32 (reference.w4a16_linear)."""
    return run("w4a16_linear", x, qweight, scales, zeros, group_size, bias)


def native_panels(device, dtype, head_dim: int) -> bool:
    """Whether a model's fp32 CPU weights pack into panels for the native GEMM (native_layer_ops, and a vector
    path for the GEMM on this CPU)."""
    return native_layer_ops(device, dtype, head_dim) and cpu_native.panels_native()


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """Store new keys/values [T, Hkv, D] at flat slots (block * block_size + offset); slot < 0 skips."""
    return run("write_kv", k_cache, v_cache, k, v, slot_mapping)


def copy_blocks(kv_cache, src, dst):
    """Copy-on-write: kv_cache[:, :, dst[i]] = kv_cache[:, :, src[i]] for all layers."""
    return run("copy_blocks", kv_cache, src, dst)


def _variant(window, softcap):
    """window and softcap checked (ValueError naming the bad one), None where there is none."""
    window, softcap = attention_variant(window, softcap)
    return window or None, softcap or None


def paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale, window=None, softcap=None):
    """One query per sequence [B, Hq, D] over its cached context -> [B, Hq, D]. window (tokens): the query at
    position p sees only the keys at p - window < k <= p; softcap: scores = softcap * tanh(scores / softcap)
    before the softmax (scores already scaled). Blocks wholly before the window are never read."""
    window, softcap = _variant(window, softcap)
    return run("paged_attention_decode", q, k_cache, v_cache, block_tables, context_lens, scale, window, softcap)


def paged_attention_prefill(q, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale, window=None,
                            softcap=None):
    """New tokens [T, Hq, D] attend causally to themselves and their cached prefix; window and softcap as in
    paged_attention_decode (each new token its own window)."""
    window, softcap = _variant(window, softcap)
    return run("paged_attention_prefill", q, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale,
               window, softcap)


def advance_decode(positions, slot_mapping, context_lens, block_tables, block_size):
    """A repeated decode step's host arrays (numpy) from the last step's, in place: positions + 1, context_lens
    (positions + 1) and each row's KV slot from its block table; one native pass where the library is built."""
    native = dispatch.MODE == "auto" and cpu_native.library() is not None
    (cpu_native if native else reference).advance_decode(positions, slot_mapping, context_lens, block_tables,
                                                         block_size)


__all__ = [
    "advance_decode",
    "bf16_linear",
    "bf16_tiles",
    "add_rms_norm",
    "check_model",
    "copy_blocks",
    "fp8_linear",
    "w4a16_linear",
    "linear_pack",
    "linear_pack_int8",
    "native_layer_ops",
    "native_panels",
    "native_threads",
    "set_native_threads",
    "lora_expand_bgmv",
    "lora_expand_bgmv_group",
    "lora_expand_sgmv",
    "lora_shrink_bgmv",
    "lora_shrink_bgmv_group",
    "lora_shrink_sgmv",
    "packed_linear",
    "paged_attention_decode",
    "paged_attention_prefill",
    "remember_host_lengths",
    "rotate_qk",
    "silu_mul",
    "uses_kernels",
    "write_kv",
]
