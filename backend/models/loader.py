"""Read a HF LLaMA-family checkpoint directory (config + safetensors) into plain tensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def load_hf_config(model_dir: str):
    """The checkpoint's transformers config; rejects architectures we do not implement."""
    from transformers import AutoConfig

    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: not a HF checkpoint directory (no config.json)")
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    archs = getattr(config, "architectures", None) or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ValueError(f"{model_dir}: architectures {archs} not supported; supported: {SUPPORTED_ARCHITECTURES}")
    return config


def load_safetensors(model_dir: str, dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint (sharded or not), cast to dtype on device. Never loads pickle."""
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
                tensors[key] = f.get_tensor(key).to(device=device, dtype=dtype)
    return tensors
