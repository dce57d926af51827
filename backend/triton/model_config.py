"""What a model's config.pbtxt says about the engine: its EngineConfig and multi_lora.json."""

from __future__ import annotations

import json
from pathlib import Path

from ..config import EngineConfig


def load_multi_lora(path: Path) -> dict[str, str]:
    """vllm_backend's multi_lora.json: adapter name -> PEFT directory (relative to the file)."""
    if not path.exists():
        return {}
    entries = json.loads(path.read_text())
    return {name: str((path.parent / p).resolve()) for name, p in entries.items()}


def engine_config_from_model_config(model_config: dict, model_dir: Path) -> EngineConfig:
    """Config parameters of config.pbtxt (engine_config JSON, model_dir), then env overrides."""
    params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
    values = json.loads(params.get("engine_config", "{}") or "{}")
    if params.get("model_dir"):
        values["model_dir"] = str((model_dir / params["model_dir"]).resolve())
    return EngineConfig.from_dict(values).with_env_overrides()
