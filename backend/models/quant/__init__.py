"""Quantized base weights: checkpoint formats, their canonical forms, quantizing at load, and running them
(README.md; decision 072)."""

from loraplex.models.quant.formats import CheckpointFormat, UnsupportedQuantization, detect, read_quantized
from loraplex.models.quant.forms import Fp8Weight, Int4Weight, Int8Weight, dequantize, is_quantized
from loraplex.models.quant.plan import CHOICES, FALLBACKS, QuantPlan, resolve
from loraplex.models.quant.quantize import quantize, quantize_fp8, quantize_int4, quantize_int8

__all__ = [
    "CHOICES", "FALLBACKS", "CheckpointFormat", "Fp8Weight", "Int4Weight", "Int8Weight", "QuantPlan",
    "UnsupportedQuantization", "dequantize", "detect", "is_quantized", "quantize", "quantize_fp8", "quantize_int4",
    "quantize_int8", "read_quantized", "resolve",
]
