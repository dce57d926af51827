"""Route each kernel call: its .cu kernel (CuPy on CUDA, the CPU shim when asked) or the torch path.

``LORAPLEX_KERNELS`` is read once, at import: ``auto`` (default) runs the kernels on CUDA
tensors and, on CPU tensors, the native C ops (``cpu_native``) where they serve the call, else
the torch reference; ``reference`` keeps every tensor on the torch path, CUDA ones included (no CuPy: the
Triton stub beside NumPy 1, decision 058); ``shim`` runs CPU
tensors through the .cu kernels, compiled for the CPU shim (slow; for tests), and the layer ops
that have no .cu kernel through the reference. A call whose shapes a kernel cannot serve
(``preconditions``) takes the torch path: SDPA for prefill on CUDA, else the reference.
The decision is made per call from the call's own shapes (cached), so models in one process
never share state; ``check_model`` logs it once per model at start-up.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os

import torch

from loraplex.kernels import cpu_native, preconditions, reference
from loraplex.kernels.preconditions import DECODE, OPS, PREFILL, QUANT, KernelShapes
from loraplex.kernels.prefill_sdpa import paged_attention_prefill_sdpa
from loraplex.kernels.runners import runner_for

log = logging.getLogger("loraplex.kernels")
ENV = "LORAPLEX_KERNELS"
MODES = ("auto", "reference", "shim")
OP_OF = {
    "lora_shrink_bgmv": "lora", "lora_expand_bgmv": "lora", "lora_shrink_sgmv": "lora", "lora_expand_sgmv": "lora",
    "lora_shrink_bgmv_group": "lora", "lora_expand_bgmv_group": "lora",
    "write_kv": "write_kv", "copy_blocks": "copy_blocks", DECODE: DECODE, PREFILL: PREFILL,
    "fp8_linear": QUANT, "w4a16_linear": QUANT,
}
LAUNCHER_MODULE = {
    "lora": "lora_launch", "write_kv": "cache_launch", "copy_blocks": "cache_launch",
    DECODE: "decode_launch", PREFILL: "prefill_launch", QUANT: "quant_launch",
}


def read_mode() -> str:
    """The kernel mode from LORAPLEX_KERNELS (auto when unset or empty); ValueError on anything else."""
    mode = os.environ.get(ENV) or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r} is not one of {', '.join(MODES)}")
    return mode


MODE = read_mode()


def uses_kernels(device: torch.device) -> bool:
    """Whether tensors on device run the .cu kernels (CUDA unless mode reference; the CPU only in shim mode)."""
    return (device.type == "cuda" and MODE != "reference") or MODE == "shim"


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(device: torch.device) -> tuple[int, int] | None:
    """Compute capability of a CUDA device; None for the CPU (shim)."""
    if device.type != "cuda":
        return None
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


def call_shapes(op: str, args: tuple) -> KernelShapes:
    """What op's preconditions look at, from its call's arguments (the reference's order)."""
    first = args[0]
    cap = capability(first.device)
    if op in ("lora", QUANT):
        return KernelShapes(first.dtype, capability=cap)
    if op in ("write_kv", "copy_blocks"):  # cache [..., Hkv, D]
        return KernelShapes(first.dtype, first.shape[-1], 0, first.shape[-2], cap)
    return KernelShapes(first.dtype, first.shape[-1], first.shape[-2], args[1].shape[-2], cap)  # q, k_cache


def torch_path(name: str, tensor: torch.Tensor):
    """The torch function serving name: SDPA for prefill on CUDA, else the reference."""
    if name == PREFILL and tensor.is_cuda:
        return paged_attention_prefill_sdpa
    return getattr(reference, name)


@functools.lru_cache(maxsize=None)
def launcher(name: str):
    """The launcher of the exported op name (imported on first use)."""
    module = importlib.import_module(f".{LAUNCHER_MODULE[OP_OF[name]]}", __package__)
    return getattr(module, name)


def native_serves(name: str, args: tuple) -> bool:
    """Whether the native CPU op name serves this call (mode auto, the library built, its dtypes and layouts)."""
    return (MODE == "auto" and name in cpu_native.OPS and cpu_native.library() is not None
            and cpu_native.serves(name, args))


def run(name: str, *args):
    """Run the exported op name on args: its kernel where one serves them, else the native CPU op where one
    serves them, else the torch path."""
    first, op = args[0], OP_OF.get(name)
    if not uses_kernels(first.device):
        return (getattr(cpu_native, name) if native_serves(name, args) else torch_path(name, first))(*args)
    if op is None or preconditions.reason(op, call_shapes(op, args)):
        return torch_path(name, first)(*args)
    options = {"runner": runner_for(first)}
    if op == PREFILL and not first.is_cuda:
        options["impl"] = "kernel"  # the shim runs the .cu source, never SDPA
    return launcher(name)(*args, **options)


def kernel_ops(device: torch.device) -> tuple[str, ...]:
    """The ops that launch a kernel on device (prefill on CUDA only when LORAPLEX_PREFILL_ATTENTION=kernel)."""
    if not uses_kernels(device):
        return ()
    from loraplex.kernels.prefill_launch import DEFAULT_IMPL

    return tuple(op for op in OPS if not (op == PREFILL and device.type == "cuda" and DEFAULT_IMPL != "kernel"))


def check_model(head_dim: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype, device) -> dict[str, str]:
    """At model start: the ops whose kernel cannot serve the model on device -> why; one warning each."""
    device = torch.device(device)
    if device.type == "cpu" and dtype == torch.float32 and MODE == "auto":
        cpu_native.library()  # built (or its absence logged) at start-up, not in the first step
    shapes = KernelShapes(dtype, head_dim, num_heads, num_kv_heads, capability(device))
    fallbacks = {op: why for op, why in preconditions.decisions(shapes, kernel_ops(device)).items() if why}
    for why in fallbacks.values():
        log.warning(why)
    return fallbacks
