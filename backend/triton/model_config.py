"""What a model's config.pbtxt says about the engine: its EngineConfig and multi_lora.json.

multi_lora.json's entries are checked against the served base model by shape, as vllm_backend's
users expect (an adapter is for the model it fits, whatever its base_model_name_or_path says):
each entry's adapter_config.json and safetensors header are read (never its tensors); one that
does not fit is skipped with one warning line naming the entry and the mismatch. The full
validation happens when the engine loads the adapter.
"""

from __future__ import annotations

import json
import logging
import re
import struct
from pathlib import Path
from types import SimpleNamespace

from loraplex.config import EngineConfig

log = logging.getLogger("loraplex.triton")

MAX_CONFIG_BYTES = 64 * 1024  # loraplex.lora.store.MAX_CONFIG_BYTES (not imported: that imports torch)
MAX_HEADER_BYTES = 100_000_000  # safetensors' own bound on the JSON header
_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:[\w]+\.)*?(qkv_proj|q_proj|k_proj|v_proj|o_proj|gate_up_proj|gate_proj|up_proj"
                     r"|down_proj)"
                     r"\.(lora_A|lora_B)(?:\.[\w-]+)?\.weight$")
# a MoE expert's tensors: per-expert modules (group 2: the module) or peft's target_parameters wrappers (decision 066)
_EXPERT_TENSOR = re.compile(r"(?:^|\.)layers\.\d+\.\w+\.experts\.(?:\d+\.(\w+)\.|(?:base_layer\.)*)(lora_A|lora_B)"
                            r"\.weight$")
# embed_tokens' and lm_head's tensors (loraplex.lora.vocab) -> which of their dims is the module's input / output
_VOCAB_TENSOR = re.compile(r"(?:^|\.)(embed_tokens|lm_head)\.(lora_embedding_A|lora_A\.weight|lora_embedding_B|lora_B\.weight"
                           r"|token_adapter\.trainable_tokens_delta|base_layer\.weight)$")
_VOCAB_DIMS = {"lora_embedding_A": (None, "in"), "lora_A.weight": (None, "in"), "lora_embedding_B": ("out", None),
               "lora_B.weight": ("out", None), "token_adapter.trainable_tokens_delta": (None, "hidden"),
               "base_layer.weight": ("vocab", "hidden")}


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


def base_shapes(model_dir: str) -> tuple[int, dict[str, tuple[int, int]]]:
    """(layers, module -> (in, out)) of the checkpoint's config.json (no transformers import), the modules named
    as adapters for it name them (Phi-3's fused qkv_proj and gate_up_proj)."""
    from loraplex.lora.moe_layout import expert_layout
    from loraplex.lora.shapes import checkpoint_modules, module_shapes

    hf = SimpleNamespace(**json.loads((Path(model_dir) / "config.json").read_text()))
    ours = module_shapes(hf)
    vocab, hidden = int(hf.vocab_size), int(hf.hidden_size)
    layout = expert_layout(hf)  # a MoE model's experts: "experts.<module>" (per expert, or fused) -> (in, out)
    experts = {} if layout is None else {
        **{f"experts.{leaf}": layout.shapes()[module] for leaf, module in layout.leaves.items()},
        "experts.gate_up_proj": (hidden, 2 * layout.intermediate), "experts.down_proj": (layout.intermediate, hidden)}
    return int(hf.num_hidden_layers), {**{name: (ours[parts[0]][0], sum(ours[m][1] for m in parts))
                                          for name, parts in checkpoint_modules(hf).items()},
                                       "embed_tokens": (vocab, hidden), "lm_head": (hidden, vocab), **experts}


def adapter_mismatch(folder: str, layers: int, shapes: dict[str, tuple[int, int]]) -> str | None:
    """Why the PEFT folder does not fit a base model of these shapes (None: it fits), from its
    adapter_config.json and its safetensors header only."""
    root = Path(folder)
    try:
        config_file, weights = root / "adapter_config.json", root / "adapter_model.safetensors"
        if config_file.stat().st_size > MAX_CONFIG_BYTES:
            return f"adapter_config.json is over {MAX_CONFIG_BYTES} bytes"
        config = json.loads(config_file.read_bytes())
        if not isinstance(config, dict):
            return "adapter_config.json is not a JSON object"
        with open(weights, "rb") as f:
            size = struct.unpack("<Q", f.read(8).ljust(8, b"\0"))[0]
            if not 0 < size <= MAX_HEADER_BYTES:
                return "adapter_model.safetensors has no valid header"
            header = json.loads(f.read(size))
    except FileNotFoundError as exc:
        return f"missing {Path(exc.filename).name if exc.filename else 'file'}"
    except (OSError, ValueError, struct.error) as exc:
        return f"unreadable: {type(exc).__name__}"
    if not isinstance(header, dict):
        return "adapter_model.safetensors has no valid header"
    fitted = 0
    for key, entry in header.items():
        expert = _EXPERT_TENSOR.search(key)
        if expert is not None:
            why = _expert_mismatch(key, entry, expert, shapes)
            if why is not None:
                return why
            fitted += 1
            continue
        match = _TENSOR.search(key)
        if key != "__metadata__" and match is None and _VOCAB_TENSOR.search(key):
            why = _vocab_mismatch(key, entry, shapes)
            if why is not None:
                return why
            fitted += 1
        if key == "__metadata__" or match is None:
            continue
        layer, module, part = int(match.group(1)), match.group(2), match.group(3)
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if layer >= layers:
            return f"{key} is for layer {layer}, the base model has {layers} layers"
        if not (isinstance(shape, list) and len(shape) == 2):
            return f"{key} has shape {shape}, not 2-D"
        if module not in shapes:
            return f"{key} is for {module}, which the base model does not have (its modules: {', '.join(shapes)})"
        fan_in, fan_out = shapes[module]
        if part == "lora_A" and shape[1] != fan_in:
            return f"{key} has shape {shape}: the base model's {module} takes {fan_in} inputs"
        if part == "lora_B" and shape[0] != fan_out:
            return f"{key} has shape {shape}: the base model's {module} has {fan_out} outputs"
        fitted += 1
    return None if fitted else "no LoRA weights of a module the base model has"


def _expert_mismatch(key: str, entry, match, shapes: dict[str, tuple[int, int]]) -> str | None:
    """Why a tensor on a MoE expert does not fit the base model's experts (a fused one: either parameter)."""
    leaf, part = match.groups()
    names = [f"experts.{leaf}"] if leaf else ["experts.gate_up_proj", "experts.down_proj"]
    if not any(n in shapes for n in names):
        return f"{key} is for MoE experts{f' ({leaf})' if leaf else ''}, which the base model does not have"
    shape = entry.get("shape") if isinstance(entry, dict) else None
    if not (isinstance(shape, list) and len(shape) == 2):
        return f"{key} has shape {shape}, not 2-D"
    if not any(n in shapes and (shape[1] if part == "lora_A" else shape[0]) == shapes[n][part == "lora_B"]
               for n in names):
        return f"{key} has shape {shape}: the base model's experts are {[list(shapes[n]) for n in names if n in shapes]} (in, out)"
    return None


def _vocab_mismatch(key: str, entry, shapes: dict[str, tuple[int, int]]) -> str | None:
    """Why a tensor on embed_tokens or lm_head does not fit the base model's vocab_size and hidden_size."""
    module, part = _VOCAB_TENSOR.search(key).groups()
    if module not in shapes:
        return None  # a base_shapes without them: loraplex.lora.vocab checks at load
    fan_in, fan_out = shapes[module]
    dims = {"in": fan_in, "out": fan_out, "vocab": shapes["lm_head"][1], "hidden": shapes["lm_head"][0]}
    shape = entry.get("shape") if isinstance(entry, dict) else None
    if not (isinstance(shape, list) and len(shape) == 2):
        return f"{key} has shape {shape}, not 2-D"
    for size, want in zip(shape, _VOCAB_DIMS[part]):
        if want is not None and size != dims[want]:
            return f"{key} has shape {shape}: the base model's {module} is {list(shapes[module])} (in, out)"
    return None


def fitting_adapters(entries: dict[str, str], model_dir: str, source: str = "multi_lora.json") -> dict[str, str]:
    """The entries whose adapters fit the base model in ``model_dir``; one warning per skipped entry."""
    if not entries:
        return {}
    try:
        layers, shapes = base_shapes(model_dir)
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        log.warning("%s: skipping all %d entries: cannot read the base model's config.json in %s (%s)",
                    source, len(entries), model_dir, exc)
        return {}
    fitting = {}
    for name, folder in entries.items():
        why = adapter_mismatch(folder, layers, shapes)
        if why is None:
            fitting[name] = folder
        else:
            log.warning("%s: skipping adapter %r (%s): it does not fit the served base model %s: %s",
                        source, name, folder, model_dir, why)
    return fitting


def multi_lora_for(model_config: dict, model_dir: Path, version: str, config: EngineConfig) -> dict[str, str]:
    """multi_lora.json's adapters that fit the base model the engine serves (config.pbtxt's, or
    LORAPLEX_MODEL_DIR's in its place), checked by shape; the others are skipped with a warning each."""
    path = model_dir / version / "multi_lora.json"
    return fitting_adapters(load_multi_lora(path), config.model_dir, str(path))


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
