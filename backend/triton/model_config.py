"""What a model's config.pbtxt says about the engine: its EngineConfig and multi_lora.json."""

from __future__ import annotations

import json
from pathlib import Path

from loraplex.config import EngineConfig


def load_multi_lora(path: Path) -> dict[str, str]:
    """vllm_backend's multi_lora.json: adapter name -> PEFT directory (relative to the file)."""
    if not path.exists():
        return {}
    entries = json.loads(path.read_text())
    return {name: str((path.parent / p).resolve()) for name, p in entries.items()}


def configured_model_dir(model_config: dict, model_dir: Path) -> str | None:
    """The base model config.pbtxt names (its model_dir parameter, resolved), if any."""
    path = model_config.get("parameters", {}).get("model_dir", {}).get("string_value")
    return str((model_dir / path).resolve()) if path else None


def multi_lora_for(model_config: dict, model_dir: Path, version: str, config: EngineConfig) -> dict[str, str]:
    """multi_lora.json's adapters when the engine serves the model config.pbtxt names; {} when
    LORAPLEX_MODEL_DIR put another base model in its place (the file's adapters belong to that one)."""
    configured = configured_model_dir(model_config, model_dir)
    if configured is not None and str(Path(config.model_dir).resolve()) != configured:
        return {}
    return load_multi_lora(model_dir / version / "multi_lora.json")


def generate_model_multi_lora(model_config: dict, model_dir: Path, config: EngineConfig,
                              generate_model: str = "lora_llm") -> dict[str, str]:
    """From a sibling model of the repository (lora_adapters): the multi_lora.json of ``generate_model``'s
    highest numbered version (Triton's default policy serves the latest), when it serves this base model."""
    folder = model_dir.parent / generate_model
    versions = sorted((int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit()), reverse=True) \
        if folder.is_dir() else []
    return multi_lora_for(model_config, folder, str(versions[0]), config) if versions else {}


def engine_config_from_model_config(model_config: dict, model_dir: Path) -> EngineConfig:
    """Config parameters of config.pbtxt (engine_config JSON, model_dir), then env overrides."""
    params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
    values = json.loads(params.get("engine_config", "{}") or "{}")
    if params.get("model_dir"):
        values["model_dir"] = configured_model_dir(model_config, model_dir)
    return EngineConfig.from_dict(values).with_env_overrides()
