"""A checkpoint's loaded tensors brought into the form a QuantPlan serves: quantized layers read into canonical
forms, full-precision projections quantized at load, or quantized ones dequantized (quantization none)."""

from __future__ import annotations

import re
from dataclasses import replace

import torch

from loraplex.models.quant.forms import FORMS, Int4Weight, dequantize
from loraplex.models.quant.formats import read_quantized
from loraplex.models.quant.plan import QuantPlan
from loraplex.models.quant.quantize import quantize

# the decoder's linear projections (and Phi-3's fused checkpoint ones) that quantization at load converts
PROJECTION = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(q_proj|k_proj|v_proj|o_proj|qkv_proj|gate_proj|up_proj"
                        r"|gate_up_proj|down_proj)\.weight$")
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def quantizes_lm_head(plan: QuantPlan) -> bool:
    """Whether quantizing at load converts lm_head too: int8 only (the CPU's decode reads it every step; fp8 and
    int4 keep it in the compute dtype, as vLLM's online quantization does). A checkpoint's own lm_head is served
    as stored (its format's ignore list)."""
    return plan.source == "load" and plan.served == "int8"


def prepare(tensors: dict, plan: QuantPlan, dtype: torch.dtype, device) -> None:
    """In place: the tensors as plan serves them, on device (forms keep their dtypes; the rest is in dtype). A
    quantized lm_head of a tied model is its own weight; the embedding lookups keep the full-precision one."""
    if plan.checkpoint is not None:
        read_quantized(tensors, plan.checkpoint)
    for name, t in list(tensors.items()):
        if isinstance(t, FORMS):
            tensors[name] = (dequantize(t).to(device=device, dtype=dtype) if plan.source == "dequantized"
                             else _on_device(t, device, dtype))
        elif plan.source == "load" and PROJECTION.match(name):
            tensors[name] = _on_device(quantize(t, plan.served), device, dtype)
    if quantizes_lm_head(plan):
        tensors[LM_HEAD] = quantize(tensors.get(LM_HEAD, tensors[EMBED]), plan.served).to(device)


def _on_device(w, device, dtype: torch.dtype):
    """A form on device; on CUDA an int4 form's scales in the compute dtype, which quant_linear.cu dequantizes
    with fewer instructions (bf16: each scale rounded once more, a bf16 ulp, below what bf16 activations
    resolve; dequantize(form) stays the served weight)."""
    w = w.to(device)
    if isinstance(w, Int4Weight) and torch.device(device).type == "cuda" and w.scales.dtype != dtype:
        w = replace(w, scales=w.scales.to(dtype))
    return w


def served_weight(raw: dict, name: str, plan: QuantPlan, device="cpu", dtype: torch.dtype = torch.float32
                  ) -> torch.Tensor | None:
    """One projection's weight [out, in] in fp32 as a model on device in dtype serves it, from its checkpoint
    tensors (raw: the tensors of that layer, as stored): DoRA's norms read it. None when raw has no such layer."""
    if plan.checkpoint is not None:
        read_quantized(raw, plan.checkpoint)
    w = raw.get(name)
    if w is None:
        return None
    if plan.source == "load" and PROJECTION.match(name):
        w = quantize(w.to(dtype), plan.served)  # as prepare quantized it: after the cast to dtype
    return dequantize(_on_device(w, device, dtype) if isinstance(w, FORMS) else w)
