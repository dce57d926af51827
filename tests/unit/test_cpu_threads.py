"""A server keeps one CPU for Triton's threads; an operator's OMP_NUM_THREADS wins."""


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


def _engine_sets(demo, knob: str, value: int, get, put) -> None:
    """An engine built with knob=value leaves get() == value (put restores what was there)."""
    from loraplex.engine.llm_engine import LLMEngine

    before = get()
    try:
        LLMEngine(EngineConfig(model_dir=str(demo["model"]), num_kv_blocks=16, **{knob: value}))
        assert get() == value
    finally:
        put(before)


def test_the_engine_sets_torch_threads(demo):
    import torch

    _engine_sets(demo, "cpu_threads", 1, torch.get_num_threads, torch.set_num_threads)


def test_native_loops_take_every_cpu_unless_told(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: set(range(2)))
    assert config.native_cpu_threads() == 2
    assert config.native_cpu_threads(3) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert config.native_cpu_threads() == 1
    with pytest.raises(ValueError, match="native_threads"):
        EngineConfig(native_threads=-1)


@pytest.mark.parametrize("cpus, threads", [(1, 1), (2, 1), (16, 15)])
def test_native_loops_of_an_int8_base_leave_one_cpu(monkeypatch, cpus, threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert config.native_cpu_threads(int8=True) == threads
    assert config.native_cpu_threads(3, int8=True) == 3


def test_the_engine_sets_the_native_threads(demo):
    from loraplex import kernels

    _engine_sets(demo, "native_threads", 3, kernels.native_threads, kernels.set_native_threads)


def test_an_int8_engine_leaves_one_cpu_to_the_serving_threads(demo, monkeypatch):
    from loraplex import kernels
    from loraplex.engine.llm_engine import LLMEngine

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: set(range(2)))
    before = kernels.native_threads()
    try:
        for quantization, threads in (("none", 2), ("int8", 1)):
            LLMEngine(EngineConfig(model_dir=str(demo["model"]), num_kv_blocks=16, quantization=quantization))
            assert kernels.native_threads() == threads, quantization
    finally:
        kernels.set_native_threads(before)


def test_a_benchmarked_server_does_not_inherit_the_harness_threads(monkeypatch):
    """`OMP_NUM_THREADS=1 python benchmarks/...` is for the harness's own work: the server it starts runs as
    `make serve` would (an inherited OMP_NUM_THREADS=1 had put the server's native loops on one thread)."""
    from scripts import load_benchmark

    serving = load_benchmark("serving")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: set(range(2)))
    assert "OMP_NUM_THREADS" not in serving.server_environment()
    assert serving.server_environment({"OMP_NUM_THREADS": "2"})["OMP_NUM_THREADS"] == "2"
    assert serving.server_threads({}) == (1, 2)
    assert serving.server_threads({"native_threads": 1}, {"OMP_NUM_THREADS": "2"}) == (2, 1)
