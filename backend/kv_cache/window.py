"""The model-wide attention window the KV cache may free blocks behind (decision 065).

A block can leave a sequence's table only when no layer will read it again, so a window
counts only when every layer slides over the same one: Mistral's ``sliding_window``,
Mixtral's and Phi-3's, Qwen2/Qwen3's with ``use_sliding_window`` and ``max_window_layers``
0 (HF slides layers ``i >= max_window_layers``), or ``layer_types`` all "sliding_attention".
Interleaved checkpoints (Gemma 2/3: some layers attend fully) free nothing. The engine asks
``common_window`` of the windows the model's attention uses per layer; ``kv_window`` reads the
same from a transformers config.
"""

from __future__ import annotations


def kv_window(config) -> int | None:
    """W when every layer of ``config`` attends only to the last W positions (a query at p sees keys
    p - W < k <= p), else None (some layer reads every block)."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return int(window) if layer_types and all(t == "sliding_attention" for t in layer_types) else None
    max_window_layers = getattr(config, "max_window_layers", None)  # Qwen2/3 configs that predate layer_types
    if max_window_layers and hasattr(config, "use_sliding_window"):
        return None
    return int(window)


def common_window(layer_windows) -> int | None:
    """W when every layer's window (None: full attention) is the same W, else None."""
    windows = set(layer_windows)
    if len(windows) != 1:
        return None
    (window,) = windows
    return int(window) if window else None
