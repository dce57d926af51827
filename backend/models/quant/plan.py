"""Which format a model is served in: the `quantization` knob against the checkpoint's own format and the device,
and what is refused (decision 072). Nothing falls back to full precision unless asked: `quantization: none`
dequantizes a quantized checkpoint, `quantization_fallback: reference` runs a format the device has no kernel for
through the torch reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.models.quant.formats import CheckpointFormat, detect

CHOICES = ("auto", "none", "int8", "fp8", "int4")
FALLBACKS = ("off", "reference")
# the fp8 / int4 kernels (quant_linear.cu) dequantize in registers and multiply with mma.sync in fp16/bf16: sm_80+
# (fp8 needs no e4m3 tensor cores: weight-only, the activations stay in the compute dtype)
QUANT_CAPABILITY = (8, 0)


@dataclass(frozen=True, slots=True)
class QuantPlan:
    """served: none, int8, fp8 or int4; source: "checkpoint" (read as stored), "load" (quantized at load),
    "dequantized" (a quantized checkpoint served in full precision) or "" (a plain checkpoint as it is);
    reference: the linear layers run through the torch reference (quantization_fallback)."""

    served: str = "none"
    source: str = ""
    checkpoint: CheckpointFormat | None = None
    reference: bool = False

    @property
    def quantized(self) -> bool:
        return self.served != "none"

    @property
    def label(self) -> str:
        """The served format in words (logs, the model config, the info metric)."""
        if self.source == "checkpoint":
            return f"{self.served}: {self.checkpoint.label}"
        if self.source == "load":
            return f"{self.served}: quantized at load"
        if self.source == "dequantized":
            return f"none: {self.checkpoint.label} dequantized at load"
        return "none"


def _device_refusal(method: str, device: torch.device, what: str) -> str | None:
    """Why the device has no kernel for method (None: it has)."""
    from loraplex.kernels import dispatch

    if device.type == "cpu":
        if method == "int8" or dispatch.MODE == "shim":  # shim: the .cu kernels run on the CPU (tests)
            return None
        return (f"{what} does not run on the CPU: the CPU serves int8 only (serve an int8 checkpoint, or "
                "quantization int8 on a full-precision one; quantization none dequantizes this one to full precision; "
                "quantization_fallback reference runs it through the slow torch reference)")
    if method == "int8":
        return (f"{what} does not run on CUDA: int8 is the CPU's format (serve fp8 or int4 on a GPU, or "
                "quantization none)")
    if torch.cuda.get_device_capability(device) < QUANT_CAPABILITY:
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        return f"{what} needs compute capability 8.0+ (the quantized kernels' mma.sync); this GPU is {cap}"
    return None


def resolve(choice: str, hf_config, device, dtype: torch.dtype, fallback: str = "off",
            fp16_weights: bool = False, moe: bool = False) -> QuantPlan:
    """The QuantPlan for the knob `choice` (CHOICES) on this checkpoint and device; ValueError naming what is
    refused (UnsupportedQuantization for a checkpoint format not served)."""
    if choice not in CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(CHOICES)}, not {choice!r}")
    if fallback not in FALLBACKS:
        raise ValueError(f"quantization_fallback must be one of {', '.join(FALLBACKS)}, not {fallback!r}")
    device = torch.device(device)
    fmt = detect(hf_config)
    if fmt is None:
        if choice in ("auto", "none"):
            return QuantPlan()
        plan = QuantPlan(choice, "load")
        what = f"quantization {choice}"
        if moe:
            raise ValueError(f"{what}: quantizing a mixture of experts at load is not served (its experts are "
                             "its weight bytes)")
    elif choice == "none":
        return QuantPlan("none", "dequantized", fmt)
    elif choice in ("auto", fmt.method):
        plan = QuantPlan(fmt.method, "checkpoint", fmt)
        what = f"the checkpoint's {fmt.label} ({fmt.method})"
    else:
        raise ValueError(f"quantization {choice}: the checkpoint is already quantized ({fmt.label}, served as "
                         f"{fmt.method}); requantizing it is not served: use quantization auto (or {fmt.method}) to "
                         "serve it as stored, or none to dequantize it")
    if fp16_weights:
        raise ValueError(f"weight_dtype float16 and {what} both choose the projections' weights: set one")
    if device.type == "cpu" and dtype != torch.float32:
        raise ValueError(f"{what} on the CPU computes in float32: dtype must be float32 (auto)")
    why = _device_refusal(plan.served, device, what)
    if why is not None:
        if fallback != "reference":
            raise ValueError(why)
        plan = QuantPlan(plan.served, plan.source, plan.checkpoint, reference=True)
    return plan
