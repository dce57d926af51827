"""LoRA compute behind one seam (base.LoraBackend): the torch path, the native CPU path and the kernels."""

from __future__ import annotations

import torch

from loraplex import kernels
from loraplex.lora.backends.base import LoraBackend, LoraPlan, RowSlots
from loraplex.lora.backends.kernel import KernelLoraBackend, Segments
from loraplex.lora.backends.native import NativeLoraBackend, NativeRows
from loraplex.lora.backends.torch_path import TorchLoraBackend, TorchPlan


def lora_backend(model, slots, to_tensor) -> LoraBackend:
    """The backend for model's LoRA stacks slots: the native one where the model's one-call decode forward
    serves the stacks, the torch path elsewhere on the CPU in fp32, the BGMV/SGMV kernels otherwise (CUDA, the
    shim, and other CPU dtypes through the kernels' reference)."""
    native = model.native_decode
    if native is not None and native.serves_lora(slots):
        return NativeLoraBackend(slots, to_tensor)
    if not kernels.uses_kernels(torch.device(model.device)) and model.dtype == torch.float32:
        return TorchLoraBackend(slots, to_tensor)
    return KernelLoraBackend(slots, to_tensor)


__all__ = ["LoraBackend", "LoraPlan", "RowSlots", "Segments", "NativeRows", "TorchPlan", "KernelLoraBackend",
           "NativeLoraBackend", "TorchLoraBackend", "lora_backend"]
