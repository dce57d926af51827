"""A CUDA device's peak memory bandwidth, the denominator of the GPU benchmarks' fractions of peak."""

from __future__ import annotations

import math

KNOWN_PEAK_GBS = {"H200": 4800.0, "H100": 3350.0, "H800": 3350.0, "A100": 2039.0, "L40S": 864.0, "A10": 600.0}


def peak_gbs(override: float | None = None, device: str = "cuda") -> tuple[float, str]:
    """(GB/s, where it came from): override (a --peak-gbs), else the device's memory clock x bus width,
    else its name in KNOWN_PEAK_GBS; NaN off CUDA or for an unknown device."""
    if override:
        return override, "--peak-gbs"
    if not device.startswith("cuda"):
        return math.nan, "none (not a CUDA device)"
    import torch

    try:
        import cupy

        dev = torch.cuda.current_device()
        clock_khz = cupy.cuda.runtime.deviceGetAttribute(36, dev)  # cudaDevAttrMemoryClockRate
        bus_bits = cupy.cuda.runtime.deviceGetAttribute(37, dev)  # cudaDevAttrGlobalMemoryBusWidth
        if clock_khz and bus_bits:
            return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, "device attributes (memory clock x bus width)"
    except Exception as err:  # noqa: BLE001 - fall back to the name table
        reason = f"device attributes unavailable ({err}); "
    else:
        reason = ""
    name = torch.cuda.get_device_name()
    for key, gbs in KNOWN_PEAK_GBS.items():
        if key in name:
            return gbs, f"{reason}table entry {key}"
    return math.nan, f"{reason}unknown device {name!r}"
