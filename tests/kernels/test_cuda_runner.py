"""The CuPy launch path, with CuPy replaced by a recorder (no GPU here)."""

from __future__ import annotations

import contextlib
import types

import numpy as np
import pytest
import torch

from loraplex.kernels import cuda_runner
from loraplex.kernels.instances import FAMILIES
from loraplex.kernels.sources import expanded_source


class Recorder:
    """Stands in for the cupy module; records compiles, contexts and launches."""

    def __init__(self):
        self.events = []
        rec = self

        class RawModule:
            def __init__(self, code, options, name_expressions):
                rec.events.append(("compile", code, options, name_expressions))

            def get_function(self, name):
                def launch(grid, block, args):
                    rec.events.append(("launch", name, grid, block, args))

                return launch

        @contextlib.contextmanager
        def device(index):
            rec.events.append(("device", index))
            yield

        class ExternalStream:
            def __init__(self, ptr):
                self.ptr = ptr

            def __enter__(self):
                rec.events.append(("stream", self.ptr))

            def __exit__(self, *exc):
                return False

        self.RawModule = RawModule
        self.cuda = types.SimpleNamespace(Device=device, ExternalStream=ExternalStream)


@pytest.fixture
def fake(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(cuda_runner, "_cupy", lambda: rec)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=4242))
    cuda_runner._function.cache_clear()
    cuda_runner._stream.cache_clear()
    yield rec
    cuda_runner._function.cache_clear()
    cuda_runner._stream.cache_clear()


def test_compiles_once_and_launches_on_torch_stream(fake):
    name = FAMILIES["lora"].names[0]
    t = torch.zeros(4)
    runner = cuda_runner.CudaRunner()
    for _ in range(2):
        args = [t, np.int32(7), np.float32(0.5)]
        runner.launch("lora", name, (3, 2, 1), (128, 1, 1), args, device=torch.device("cuda", 0))
    compiles = [e for e in fake.events if e[0] == "compile"]
    assert compiles == [("compile", expanded_source("lora.cu"), cuda_runner.NVRTC_OPTIONS, (name,))]
    launches = [e for e in fake.events if e[0] == "launch"]
    assert len(launches) == 2
    _, got_name, grid, block, args = launches[0]
    assert (got_name, grid, block) == (name, (3, 2, 1), (128, 1, 1))
    assert args[0] == np.uint64(t.data_ptr()) and args[0].dtype == np.uint64
    assert args[1:] == (np.int32(7), np.float32(0.5)) and args[1].dtype == np.int32
    assert ("stream", 4242) in fake.events
    assert fake.events.index(("stream", 4242)) < fake.events.index(launches[0])


def test_rejects_python_scalars(fake):
    with pytest.raises(TypeError, match="unsupported kernel argument"):
        name = FAMILIES["lora"].names[0]
        cuda_runner.CudaRunner().launch("lora", name, (1,), (32,), [3], device=torch.device("cuda", 0))
