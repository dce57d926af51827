"""Loraplex kernels: dispatch to CuPy CUDA kernels on CUDA tensors, torch reference on CPU.

The backend calls only the functions exported here.
"""

from .reference import (  # noqa: F401  (CPU path; CUDA launchers plug in behind these names)
    copy_blocks,
    lora_expand_bgmv,
    lora_expand_sgmv,
    lora_shrink_bgmv,
    lora_shrink_sgmv,
    paged_attention_decode,
    paged_attention_prefill,
    write_kv,
)
