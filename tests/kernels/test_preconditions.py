"""Kernel preconditions: per-op decisions, their log lines, and the start-up check of a model."""

from __future__ import annotations

import logging

import pytest
import torch

from loraplex.kernels import dispatch, prefill_launch
from loraplex.kernels.preconditions import OPS, KernelShapes, decisions

FALLBACK = "is not supported by the CUDA kernel"
ATTENTION = ("paged_attention_decode", "paged_attention_prefill")


def disabled(shapes: KernelShapes) -> dict[str, str]:
    return {op: why for op, why in decisions(shapes).items() if why}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_supported_models_use_every_kernel(dtype, head_dim):
    assert disabled(KernelShapes(dtype, head_dim, 32, 8, (8, 0))) == {}


def test_unsupported_head_dim_disables_attention_only():
    assert disabled(KernelShapes(torch.float16, 80, 32, 8, (9, 0))) == {
        op: f"{op}: head_dim 80 is not supported by the CUDA kernel (needs 32, 64, 128 or 256); using the torch path"
        for op in ATTENTION
    }


def test_bfloat16_needs_compute_capability_8():
    why = disabled(KernelShapes(torch.bfloat16, 64, 8, 8, (7, 5)))
    assert sorted(why) == sorted(["lora", *ATTENTION])  # the cache ops move raw bytes
    assert why["lora"] == (
        "lora: bfloat16 on compute capability 7.5 is not supported by the CUDA kernel "
        "(needs compute capability 8.0 or newer); using the torch path"
    )
    assert disabled(KernelShapes(torch.float16, 64, 8, 8, (7, 5))) == {}
    assert disabled(KernelShapes(torch.bfloat16, 64, 8, 8, None)) == {}  # the CPU shim


def test_dtype_without_kernel_instantiation():
    why = disabled(KernelShapes(torch.float64, 64, 8, 8, (9, 0)))
    assert sorted(why) == sorted(["lora", *ATTENTION])
    assert "dtype float64 is not supported by the CUDA kernel (needs float32, float16 or bfloat16)" in why["lora"]


def test_query_heads_must_group_over_kv_heads():
    why = disabled(KernelShapes(torch.float16, 64, 6, 4, (8, 0)))
    assert sorted(why) == sorted(ATTENTION)
    assert "6 query heads over 4 KV heads" in why["paged_attention_decode"]


def test_cache_rows_must_be_whole_copy_units():
    why = disabled(KernelShapes(torch.uint8, 33, 1, 1, None))
    assert why["write_kv"].startswith("write_kv: KV rows of 33 bytes") and "copy_blocks" in why


def test_check_model_on_cpu_checks_nothing(monkeypatch, caplog):
    monkeypatch.setattr(dispatch, "MODE", "auto")
    assert dispatch.check_model(80, 4, 2, torch.float32, "cpu") == {}
    assert not caplog.records


def test_check_model_logs_one_line_per_disabled_op(monkeypatch, caplog):
    monkeypatch.setattr(dispatch, "MODE", "shim")
    with caplog.at_level(logging.WARNING, logger="loraplex.kernels"):
        fallbacks = dispatch.check_model(16, 8, 2, torch.float32, "cpu")
    assert sorted(fallbacks) == sorted(ATTENTION)
    assert [r.getMessage() for r in caplog.records] == list(fallbacks.values())


@pytest.mark.parametrize("impl,ops", [("sdpa", ("paged_attention_decode",)), ("kernel", ATTENTION)])
def test_check_model_on_cuda_reports_prefill_only_when_its_kernel_runs(monkeypatch, caplog, impl, ops):
    monkeypatch.setattr(dispatch, "capability", lambda device: (9, 0))
    monkeypatch.setattr(prefill_launch, "DEFAULT_IMPL", impl)
    expected_ops = tuple(op for op in OPS if impl == "kernel" or op != "paged_attention_prefill")
    assert dispatch.kernel_ops(torch.device("cuda")) == expected_ops
    with caplog.at_level(logging.WARNING, logger="loraplex.kernels"):
        fallbacks = dispatch.check_model(80, 4, 2, torch.bfloat16, "cuda")
    assert sorted(fallbacks) == sorted(ops)
    assert len(caplog.records) == len(ops) and all(FALLBACK in r.getMessage() for r in caplog.records)
