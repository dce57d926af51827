"""LORAPLEX_KERNELS=reference keeps CUDA tensors on the torch path too (no CuPy; decision 058)."""

from __future__ import annotations

import torch

from loraplex.kernels import dispatch


def test_reference_mode_keeps_cuda_off_the_kernels(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(dispatch, "MODE", "auto")
    assert dispatch.uses_kernels(cuda) and not dispatch.uses_kernels(cpu)
    monkeypatch.setattr(dispatch, "MODE", "reference")
    assert not dispatch.uses_kernels(cuda) and not dispatch.uses_kernels(cpu)
    assert dispatch.kernel_ops(cuda) == ()
    monkeypatch.setattr(dispatch, "MODE", "shim")
    assert dispatch.uses_kernels(cuda) and dispatch.uses_kernels(cpu)
