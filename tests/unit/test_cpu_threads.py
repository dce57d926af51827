"""A server keeps one CPU for Triton's threads; an operator's OMP_NUM_THREADS wins."""

import os

import pytest

from loraplex import config
from loraplex.config import EngineConfig, serving_cpu_threads


@pytest.mark.parametrize("cpus, threads", [(1, 1), (2, 1), (16, 15)])
def test_a_server_leaves_one_cpu(monkeypatch, cpus, threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert serving_cpu_threads() == threads


def test_omp_num_threads_is_the_operators_choice(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert serving_cpu_threads() == 0  # 0: torch keeps what OMP_NUM_THREADS gave it


def test_negative_threads_are_refused():
    with pytest.raises(ValueError, match="cpu_threads"):
        EngineConfig(cpu_threads=-1)


def test_the_engine_sets_torch_threads(demo):
    import torch

    from loraplex.engine import LLMEngine

    before = torch.get_num_threads()
    try:
        LLMEngine(EngineConfig(model_dir=str(demo["model"]), cpu_threads=1, num_kv_blocks=16))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
