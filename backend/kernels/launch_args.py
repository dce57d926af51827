"""Small helpers shared by the launchers: index tensors, vector widths, grid sizes."""

from __future__ import annotations

import math
import numbers

import torch

from loraplex.kernels.instances import HEAD_DIMS, VEC_WIDTH, c_type

INT32_MAX = 2**31 - 1


def ceil_div(a: int, b: int) -> int:
    """Smallest integer >= a / b."""
    return -(-a // b)


def int32_on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t as a contiguous int32 tensor on device (no copy when it already is one)."""
    return t.to(device=device, dtype=torch.int32).contiguous()


def float32_on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t as a contiguous float32 tensor on device (no copy when it already is one)."""
    return t.to(device=device, dtype=torch.float32).contiguous()


def aligned(*tensors: torch.Tensor, bytes_: int = 16) -> bool:
    """True when every tensor's data pointer is a multiple of bytes_."""
    return all(t.data_ptr() % bytes_ == 0 for t in tensors)


def vector_width(dtype: torch.dtype, length: int, *tensors: torch.Tensor) -> int:
    """16-byte vector width in elements if length and all pointers allow it, else 1."""
    width = VEC_WIDTH[c_type(dtype)]
    return width if length % width == 0 and aligned(*tensors) else 1


def check_paged(kernel: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """ValueError unless the head dim is supported, query heads group over KV heads, and caches are contiguous."""
    num_q_heads, head_dim, num_kv_heads = q.shape[1], q.shape[2], k_cache.shape[2]
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head dim {head_dim} not supported by the {kernel} kernel (supported: {HEAD_DIMS})")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not group over {num_kv_heads} KV heads")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")


def same_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The common dtype of tensors; TypeError if they differ."""
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise TypeError(f"kernel operands must share one dtype, got {sorted(map(str, dtypes))}")
    return dtypes.pop()


def attention_variant(window, softcap) -> tuple[int, float]:
    """The paged-attention variant as the kernels take it: (window in tokens, 0 for none, at most INT32_MAX: a
    longer one sees every key of any context; softcap, 0.0 for none). ValueError unless window is None or a
    positive integer and softcap None or a positive finite number."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 1):
        raise ValueError(f"attention window must be a positive whole number of tokens or None, got {window!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real)
                                or not 0 < softcap < math.inf):
        raise ValueError(f"attention softcap must be a positive finite number or None, got {softcap!r}")
    return min(int(window or 0), INT32_MAX), float(softcap or 0.0)
