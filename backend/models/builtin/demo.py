"""Build the offline demo: a byte-level tokenizer, a tiny random LLaMA and two PEFT adapters.

``python -m loraplex.models.builtin.demo [--out .cache/demo] [--force]`` writes::

    <out>/model/                 LLaMA checkpoint (safetensors, fp32) + tokenizer + generation_config
    <out>/adapters/demo-a/       r=8,  alpha=16, q_proj,v_proj
    <out>/adapters/demo-b/       r=16, alpha=16, rsLoRA, all 7 projections
    <out>/demo.json              facts about the build (ids, margins, adapter checks)

Everything is made here from fixed seeds; no model hub is needed.

Tokenizer facts: vocab = ``<pad>``=0, ``<s>``=1, ``</s>``=2, then the 256 bytes, byte
``b`` at id ``3 + b`` (259 tokens; the model's embedding is padded to 264). No merges,
so every UTF-8 byte is one token and any text round-trips exactly. ``tokenizer(text)``
prepends ``<s>`` (as LLaMA does, via a TemplateProcessing post-processor) and never
appends ``</s>``; ``add_special_tokens=False`` gives the bare bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loraplex.lora.shapes import MODULES

DEMO_VERSION = 1
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
BYTE_OFFSET = len(SPECIAL_TOKENS)
ALL_PROJECTIONS = MODULES
DEMO_MODEL_CONFIG: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    initializer_range=0.1,
)
# The lm_head is scaled after init so greedy top-2 logit margins are far from ties.
DEMO_LM_HEAD_SCALE = 3.0
DEMO_ADAPTERS: dict[str, dict[str, Any]] = {
    "demo-a": dict(r=8, alpha=16, target_modules=("q_proj", "v_proj"), seed=1),
    "demo-b": dict(r=16, alpha=16, target_modules=ALL_PROJECTIONS, seed=2, use_rslora=True),
}
# A Zephyr-style chat template, so /v1/chat/completions works on the demo model. It writes BOS as
# text, as LLaMA-2's does, which the OpenAI gateway must not let become a second BOS token.
DEMO_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CHECK_PROMPTS = (
    "Hello",
    "The quick brown fox",
    "Once upon a time",
    "What is LoRA?",
    "1, 2, 3,",
    "Triton serves many tenants",
    "こんにちは",
    "def main():",
)


def log(msg: str) -> None:
    """Progress message on stderr."""
    print(f"[loraplex.models.builtin.demo] {msg}", file=sys.stderr, flush=True)


def default_out_dir() -> Path:
    """``$LORAPLEX_CACHE_DIR/demo`` or ``<project>/.cache/demo``."""
    from loraplex.launch.tritonserver import cache_dir

    return cache_dir() / "demo"


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_byte_tokenizer(out_dir: str | os.PathLike, model_max_length: int = 1024):
    """Save a byte-level BPE tokenizer (no merges; bos prepended) loadable by AutoTokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for b, ch in _bytes_to_unicode().items():
        vocab[ch] = BYTE_OFFSET + b
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=model_max_length, clean_up_tokenization_spaces=False,
    )
    out = Path(out_dir)
    fast.save_pretrained(out)
    # A class name every transformers release knows (5.x writes "TokenizersBackend").
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["add_bos_token"] = True
    cfg["add_eos_token"] = False
    cfg["clean_up_tokenization_spaces"] = False
    cfg["chat_template"] = DEMO_CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return fast


def ensure_chat_template(model_dir: str | os.PathLike) -> bool:
    """Give a demo tokenizer built before it had one the chat template (atomic rewrite); True if it changed."""
    cfg_path = Path(model_dir) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("chat_template") == DEMO_CHAT_TEMPLATE:
        return False
    cfg["chat_template"] = DEMO_CHAT_TEMPLATE
    fd, tmp = tempfile.mkstemp(dir=cfg_path.parent, prefix=".tokenizer_config.")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(cfg, indent=2) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, cfg_path)
    return True


def build_tiny_llama(out_dir: str | os.PathLike, *, seed: int = 0, lm_head_scale: float = DEMO_LM_HEAD_SCALE,
                     **config_overrides: Any) -> Path:
    """Save a random LLaMA-family checkpoint (fp32 safetensors) with the byte tokenizer.

    ``config_overrides`` go to the config; ``model_type="qwen2"`` (q/k/v bias) or
    ``"mistral"`` picks another architecture; e.g. ``num_key_value_heads=4`` for MHA.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_byte_tokenizer(out, config_overrides.get("max_position_embeddings", 1024))
    model_type = config_overrides.pop("model_type", "llama")
    vocab = (len(tok) + 7) // 8 * 8
    kw = dict(DEMO_MODEL_CONFIG, vocab_size=vocab, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
              pad_token_id=PAD_ID)
    if model_type == "qwen2":
        kw.update(use_sliding_window=False)
    kw.update(config_overrides)
    config = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(lm_head_scale)
        for name, param in model.named_parameters():  # HF zero-inits biases (Qwen2 q/k/v): make them count
            if name.endswith(".bias"):
                param.normal_(0.0, config.initializer_range)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False,
        max_new_tokens=16,
    )
    model.save_pretrained(out, safe_serialization=True)
    return out


def build_peft_adapter(model_dir: str | os.PathLike, out_dir: str | os.PathLike, r: int, alpha: float,
                       target_modules, seed: int, use_rslora: bool = False, *, model=None,
                       b_scale: float = 1.0, **lora_kwargs: Any) -> Path:
    """Save a PEFT LoRA adapter for ``model_dir`` with random (non-zero) A and B from ``seed``.

    ``lora_kwargs`` go to peft's LoraConfig (e.g. rank_pattern, alpha_pattern, layers_to_transform).
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir).float()
    cfg = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=0.0,
        bias="none", task_type="CAUSAL_LM", init_lora_weights=False, use_rslora=use_rslora, **lora_kwargs,
    )
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, cfg)
    if b_scale != 1.0:
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.mul_(b_scale)
    out = Path(out_dir)
    peft_model.save_pretrained(out, safe_serialization=True)
    # Record the base model as given (the tests compare against it), not a temp path.
    cfg_path = out / "adapter_config.json"
    data = json.loads(cfg_path.read_text())
    data["base_model_name_or_path"] = str(model_dir)
    cfg_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    peft_model.unload()  # leave ``model`` as it was for the next adapter
    return out


def greedy_check(model_dir: str | os.PathLike, adapters: dict[str, Path], prompts=CHECK_PROMPTS,
                 max_new_tokens: int = 8) -> dict[str, Any]:
    """Greedy outputs of the base model and each adapter; top-2 logit margins of the base."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir).float().eval()

    def run(model) -> tuple[list[list[int]], list[float]]:
        outs, margins = [], []
        for p in prompts:
            ids = torch.tensor([tok(p).input_ids])
            with torch.no_grad():
                o = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                   output_scores=True, return_dict_in_generate=True,
                                   pad_token_id=PAD_ID, eos_token_id=None)
            for s in o.scores:
                top = s[0].float().topk(2).values
                margins.append(float(top[0] - top[1]))
            outs.append(o.sequences[0, ids.shape[1]:].tolist())
        return outs, margins

    base_out, margins = run(base)
    result: dict[str, Any] = {
        "median_margin": statistics.median(margins),
        "min_margin": min(margins),
        "frac_margin_below_1e-2": sum(m < 1e-2 for m in margins) / len(margins),
        "adapters": {},
    }
    for name, path in adapters.items():
        pm = PeftModel.from_pretrained(base, str(path)).eval()
        out, amargins = run(pm)
        differs = sum(a != b for a, b in zip(out, base_out))
        result["adapters"][name] = {
            "differs": differs, "prompts": len(prompts),
            "median_margin": statistics.median(amargins),
        }
        base = pm.unload()
    return result


def _quiet_transformers() -> None:
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except (ImportError, AttributeError):  # pragma: no cover - cosmetic only
        pass


def _is_complete(out: Path) -> bool:
    try:
        return json.loads((out / "demo.json").read_text()).get("version") == DEMO_VERSION
    except (FileNotFoundError, ValueError):
        return False


def demo_paths(out_dir: str | os.PathLike) -> dict[str, Path]:
    """Where the demo's parts live under ``out_dir``."""
    out = Path(out_dir).resolve()
    paths = {"root": out, "model": out / "model", "tokenizer": out / "model",
             "adapters": out / "adapters", "info": out / "demo.json"}
    for name in DEMO_ADAPTERS:
        paths[name] = out / "adapters" / name
    return paths


def build_demo(out_dir: str | os.PathLike | None = None, force: bool = False) -> dict[str, Path]:
    """Build the demo model, tokenizer and adapters under ``out_dir`` unless already complete."""
    out = Path(out_dir) if out_dir is not None else default_out_dir()
    out = out.resolve()
    if not force and _is_complete(out):
        if ensure_chat_template(out / "model"):  # the weights are unchanged: no rebuild needed
            log(f"added the chat template to the demo tokenizer at {out / 'model'}")
        log(f"demo already built at {out}")
        return demo_paths(out)
    t0 = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
        _quiet_transformers()
        log("building byte-level tokenizer and tiny LLaMA (random weights, seed 0)")
        model_dir = build_tiny_llama(tmp / "model")
        final_model_dir = out / "model"
        base = AutoModelForCausalLM.from_pretrained(model_dir).float()
        adapters = {}
        for name, spec in DEMO_ADAPTERS.items():
            log(f"building adapter {name} (r={spec['r']}, alpha={spec['alpha']}, "
                f"targets={','.join(spec['target_modules'])}{', rslora' if spec.get('use_rslora') else ''})")
            adapters[name] = build_peft_adapter(
                final_model_dir, tmp / "adapters" / name, spec["r"], spec["alpha"],
                spec["target_modules"], spec["seed"], spec.get("use_rslora", False), model=base,
            )
        log("checking greedy outputs (base vs adapters) and logit margins")
        check = greedy_check(model_dir, adapters)
        log(f"median top-2 logit margin (base, greedy): {check['median_margin']:.3f}; "
            f"min {check['min_margin']:.2e}; below 1e-2: {check['frac_margin_below_1e-2']:.1%}")
        for name, info in check["adapters"].items():
            log(f"{name}: greedy output differs from base on {info['differs']}/{info['prompts']} prompts")
            if info["differs"] * 2 <= info["prompts"]:
                raise RuntimeError(f"adapter {name} too weak: differs on {info['differs']} prompts")
        cfg = base.config
        info = {
            "version": DEMO_VERSION,
            "vocab_size": cfg.vocab_size,
            "tokenizer_size": 256 + BYTE_OFFSET,
            "pad_token_id": PAD_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
            "bos_prepended": True,
            "byte_token_offset": BYTE_OFFSET,
            "lm_head_scale": DEMO_LM_HEAD_SCALE,
            "adapters": {n: {k: (list(v) if isinstance(v, tuple) else v) for k, v in s.items()}
                         for n, s in DEMO_ADAPTERS.items()},
            "check": check,
        }
        (tmp / "demo.json").write_text(json.dumps(info, indent=2) + "\n")
        for p in [tmp, *tmp.rglob("*")]:  # mkdtemp and safetensors create owner-only modes
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        if out.exists():
            old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
            os.replace(out, old / "d")
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.replace(tmp, out)
        except OSError:
            if not _is_complete(out):  # lost a race to another builder: fine if theirs is done
                raise
        log(f"demo built at {out} in {time.monotonic() - t0:.1f}s")
        return demo_paths(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: build the demo and print its paths as JSON."""
    ap = argparse.ArgumentParser(prog="python -m loraplex.models.builtin.demo", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="output folder (default: .cache/demo in the project)")
    ap.add_argument("--force", action="store_true", help="rebuild even if a complete demo exists")
    args = ap.parse_args(argv)
    paths = build_demo(args.out, force=args.force)
    print(json.dumps({k: str(v) for k, v in paths.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
