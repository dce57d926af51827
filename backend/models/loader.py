"""Read a HF checkpoint directory (config + safetensors) of a supported family into plain tensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from loraplex.models.family import ACTIVATIONS, FAMILIES, supported

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
SUPPORTED_ACTIVATIONS = tuple(ACTIVATIONS)  # the gated MLP's activation


def load_hf_config(model_dir: str):
    """The checkpoint's transformers config; rejects architectures and activations we do not implement."""
    from transformers import AutoConfig

    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: not a HF checkpoint directory (no config.json)")
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    archs = getattr(config, "architectures", None) or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ValueError(f"{model_dir}: architectures {archs} is not a family we serve; supported: {supported()}")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{model_dir}: use_bidirectional_attention is set (an embedding model): not a causal LM")
    activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if activation not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"{model_dir}: hidden_act {activation!r} is not implemented (only {', '.join(SUPPORTED_ACTIVATIONS)}"
                         "): its MLP would be served wrong")
    return config


def load_safetensors(model_dir: str, dtype: torch.dtype, device, keep=None) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint (sharded or not), cast to dtype on device; those keep(name, tensor) selects (a
    quantized layer's integer, fp8 and scale tensors) as stored, on the CPU. Never loads pickle."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = [p.name for p in sorted(root.glob("*.safetensors"))]
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights (pickle checkpoints are not loaded)")
    tensors = {}
    for name in files:
        with safe_open(str(root / name), framework="pt", device="cpu") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                tensors[key] = t if keep is not None and keep(key, t) else t.to(device=device, dtype=dtype)
    return tensors
