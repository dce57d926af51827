"""Launch kernels on CUDA through CuPy: compiled once per instantiation, on torch's stream."""

from __future__ import annotations

import functools

import numpy as np
import torch

from loraplex.kernels.instances import FAMILIES
from loraplex.kernels.sources import expanded_source

NVRTC_OPTIONS = ("-std=c++17",)


def _cupy():
    import cupy  # imported only when a CUDA tensor arrives

    return cupy


@functools.lru_cache(maxsize=None)
def _function(family: str, name: str, device_index: int):
    cupy = _cupy()
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(
            code=expanded_source(FAMILIES[family].source), options=NVRTC_OPTIONS, name_expressions=(name,)
        )
        return module.get_function(name)


@functools.lru_cache(maxsize=64)
def _stream(handle: int, device_index: int):
    cupy = _cupy()
    with cupy.cuda.Device(device_index):
        return cupy.cuda.ExternalStream(handle)


def _arg(arg):
    if isinstance(arg, torch.Tensor):
        return np.uint64(arg.data_ptr())
    if isinstance(arg, (np.int32, np.int64, np.float32)):
        return arg
    raise TypeError(f"unsupported kernel argument {type(arg).__name__}")


class CudaRunner:
    """Launches kernels with CuPy on torch's current CUDA stream."""

    def sm_count(self, device: torch.device) -> int:
        """Streaming multiprocessors of device."""
        return torch.cuda.get_device_properties(device).multi_processor_count

    def launch(self, family: str, name: str, grid, block, args, device: torch.device | None = None) -> None:
        """Run name from family over grid x block with args (tensors, np.int32/int64/float32)."""
        if device is None:
            device = next(a.device for a in args if isinstance(a, torch.Tensor))
        index = device.index if device.index is not None else torch.cuda.current_device()
        fn = _function(family, name, index)
        stream = _stream(torch.cuda.current_stream(index).cuda_stream, index)
        cupy = _cupy()
        with cupy.cuda.Device(index), stream:
            fn(tuple(grid), tuple(block), tuple(_arg(a) for a in args))
