"""multi_lora.json checked by shape against the served base model: entries that fit are served, the others
skipped with one warning each; only adapter_config.json and the safetensors header are read."""

from __future__ import annotations

import copy
import json
import logging
import struct
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tiny_llama import tiny_config
from transformers import LlamaForCausalLM

from loraplex.config import EngineConfig
from loraplex.lora.adapter import load_peft_adapter
from loraplex.triton.model_config import adapter_mismatch, base_shapes, fitting_adapters, multi_lora_for


def base(folder: Path, **kw) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({**tiny_config(**kw).to_dict(), "architectures": ["LlamaForCausalLM"]}))
    return folder


def peft(folder: Path, seed: int = 1, **kw) -> Path:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(**kw)).eval()
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    get_peft_model(copy.deepcopy(model), config).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"fits": peft(root / "fits"), "wide": peft(root / "wide", hidden_size=96),
            "deep": peft(root / "deep", num_hidden_layers=3), "wide-mlp": peft(root / "wide-mlp", intermediate_size=256)}


def test_fitting_entries_are_served_and_the_others_skipped_with_a_warning_each(tmp_path, adapters, caplog):
    model_dir = base(tmp_path / "base")
    entries = {name: str(path) for name, path in adapters.items()} | {"gone": str(tmp_path / "missing")}
    with caplog.at_level(logging.WARNING, "loraplex.triton"):
        assert fitting_adapters(entries, str(model_dir)) == {"fits": str(adapters["fits"])}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4
    assert any("'wide'" in m and "has shape [96, 4]: the base model's down_proj has 64 outputs" in m for m in lines)
    assert any("'deep'" in m and "layer 2, the base model has 2 layers" in m for m in lines)
    assert any("'wide-mlp'" in m and "down_proj takes 128 inputs" in m for m in lines)
    assert any("'gone'" in m and "missing adapter_config.json" in m for m in lines)
    hf = tiny_config()
    load_peft_adapter(str(adapters["fits"]), "fits", hf, 16)  # what the check passes, the engine loads


def test_the_check_follows_the_served_base_model_not_the_configured_name(tmp_path, adapters):
    repo = tmp_path / "lora_llm"
    (repo / "1").mkdir(parents=True)
    (repo / "1" / "multi_lora.json").write_text(json.dumps({"a": str(adapters["fits"]), "b": str(adapters["wide"])}))
    pbtxt = {"parameters": {"model_dir": {"string_value": "../configured"}}}
    served = base(tmp_path / "model-dir-override")  # LORAPLEX_MODEL_DIR: another checkpoint of the same shapes
    assert multi_lora_for(pbtxt, repo, "1", EngineConfig(model_dir=str(served))) == {"a": str(adapters["fits"])}
    wide = base(tmp_path / "wide-base", hidden_size=96)
    assert multi_lora_for(pbtxt, repo, "1", EngineConfig(model_dir=str(wide))) == {"b": str(adapters["wide"])}


def test_only_the_header_is_read(tmp_path, adapters):
    folder = tmp_path / "header-only"
    folder.mkdir()
    (folder / "adapter_config.json").write_text((adapters["fits"] / "adapter_config.json").read_text())
    data = (adapters["fits"] / "adapter_model.safetensors").read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    (folder / "adapter_model.safetensors").write_bytes(data[:8 + size])  # no tensor bytes at all
    assert adapter_mismatch(str(folder), *base_shapes(str(base(tmp_path / "b")))) is None
    (folder / "adapter_model.safetensors").write_bytes(b"\xff" * 8)
    assert "no valid header" in adapter_mismatch(str(folder), *base_shapes(str(tmp_path / "b")))


def test_an_unreadable_base_config_skips_every_entry(tmp_path, adapters, caplog):
    with caplog.at_level(logging.WARNING, "loraplex.triton"):
        assert fitting_adapters({"fits": str(adapters["fits"])}, str(tmp_path / "nothing")) == {}
    assert "skipping all 1 entries" in caplog.text
