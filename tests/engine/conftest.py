"""Fixtures of the multi-LoRA engine tests: tiny LLaMA-family models, each with six PEFT adapters.

A *family* is one tiny random checkpoint (``loraplex.models.builtin.demo.build_tiny_llama``) plus the
adapters of ``ADAPTER_SPECS``, written by peft itself (``save_pretrained``) under
``tmp_path_factory``. Families are built once per session, on first use, so every test
module that needs one shares it (and peft's reference models, cached in
``tests/support/peft_reference.py``).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from loraplex.lora.shapes import MODULES

ALL = list(MODULES)

# Three architectures that differ where the forward pass can go wrong.
ARCHS: dict[str, dict] = {
    # GQA: 8 query heads share 2 KV heads (head_dim 16).
    "llama-gqa": dict(model_type="llama", num_attention_heads=8, num_key_value_heads=2),
    # Qwen2: q/k/v projections carry a bias (LoRA adds to base + bias), GQA 4:2.
    "qwen2-bias": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2),
    # MHA on the Mistral config class: as many KV heads as query heads.
    "mistral-mha": dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=4),
}

# Ranks 4..64, mixed targets; B is scaled so each adapter changes greedy outputs without
# swamping the base model (b_scale). rank_pattern / alpha_pattern give one adapter a
# different rank and scale per module inside one slot.
ADAPTER_SPECS: dict[str, dict] = {
    "attn-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], seed=11),
    "mlp-r8": dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"], seed=12),
    "all-r16": dict(r=16, lora_alpha=32, target_modules=ALL, seed=13,
                    rank_pattern={"k_proj": 4}, alpha_pattern={"down_proj": 8}),
    "layers-r24": dict(r=24, lora_alpha=24, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                       layers_to_transform=[1, 3], seed=14),
    "rslora-r32": dict(r=32, lora_alpha=16, use_rslora=True, target_modules=ALL, seed=15),
    "all-r64": dict(r=64, lora_alpha=64, target_modules=ALL, seed=16),
}
B_SCALE = 0.3


@dataclass
class Family:
    """One tiny checkpoint and its adapters (name -> PEFT folder)."""

    arch: str
    model_dir: str
    adapters: dict[str, str]
    specs: dict[str, dict]

    def adapter_config(self, name: str) -> dict:
        """The adapter_config.json peft wrote for one adapter."""
        return json.loads((Path(self.adapters[name]) / "adapter_config.json").read_text())


def build_family(root: Path, arch: str) -> Family:
    """Build the checkpoint of ``arch`` and every adapter of ADAPTER_SPECS under root."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from loraplex.models.builtin.demo import build_peft_adapter, build_tiny_llama

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    model_dir = build_tiny_llama(root / "model", **ARCHS[arch])
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    biases = [p for n, p in base.named_parameters() if n.endswith(".bias")]  # the builder randomizes them
    assert bool(biases) == (ARCHS[arch]["model_type"] == "qwen2") and all(bool(b.any()) for b in biases), arch
    adapters = {}
    for name, spec in ADAPTER_SPECS.items():
        spec = dict(spec)
        adapters[name] = str(build_peft_adapter(
            model_dir, root / "adapters" / name, spec.pop("r"), spec.pop("lora_alpha"), spec.pop("target_modules"),
            spec.pop("seed"), spec.pop("use_rslora", False), model=base, b_scale=B_SCALE, **spec,
        ))
    return Family(arch, str(model_dir), adapters, copy.deepcopy(ADAPTER_SPECS))


@pytest.fixture(scope="session")
def lora_family(tmp_path_factory):
    """lora_family(arch) -> Family, built on first request and cached for the session."""
    cache: dict[str, Family] = {}

    def get(arch: str) -> Family:
        if arch not in cache:
            cache[arch] = build_family(tmp_path_factory.mktemp(f"family-{arch}"), arch)
        return cache[arch]

    return get


@pytest.fixture(params=["auto", "reference"])
def kernel_mode(request, monkeypatch) -> str:
    """LORAPLEX_KERNELS in turn: auto (fp32 CPU: the native ops and GEMM) and reference (the torch path,
    FBGEMM for fp16 weights), set before the test builds its engine."""
    from loraplex.kernels import dispatch

    monkeypatch.setattr(dispatch, "MODE", request.param)
    return request.param


@pytest.fixture(params=list(ARCHS))
def lora_arch(request) -> str:
    """Each architecture of ARCHS in turn (a test taking ``lora_arch`` runs once per architecture)."""
    return request.param
