"""Pick the kernel runner for a tensor's device."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _cuda():
    from loraplex.kernels.cuda_runner import CudaRunner

    return CudaRunner()


@functools.lru_cache(maxsize=None)
def _cpu():
    from loraplex.kernels.cpu_runner import CpuRunner

    return CpuRunner()


def runner_for(tensor: torch.Tensor):
    """CuPy runner for CUDA tensors, the CPU shim runner otherwise."""
    return _cuda() if tensor.is_cuda else _cpu()
