"""Decode step time of each model family against the Llama path, per active parameter, in one run.

    python benchmarks/families.py [--families llama,qwen3,...] [--batch 1,8] [--steps 48] [--quick] [--json PATH]

Every family gets a random checkpoint of SmolLM2-135M's shape (30 layers, hidden 576, 9 heads over 3 KV
heads, MLP 1536, its 49,152-token vocabulary), built from transformers' own config class with the family's
quirks, saved once to a temporary folder; the MoE families get 8 experts of width 768, top-2, so that the
active MLP equals the dense one. Each runs in-process on LLMEngine with the server's defaults on this
machine, a batch of --batch greedy sequences of a 32-token prompt: decode step time is the median over
--steps decode-only steps, best of 3 rounds, the rounds alternating over the families. Active parameters: everything a token's forward reads (the
routed experts only). The issue's goals: each family within 1.3x of Llama per active parameter, MoE within
1.5x of dense. Ratios are from one run (this machine is shared and noisy); nothing asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=2048,
             tie_word_embeddings=True)
MOE = dict(num_local_experts=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768)
FAMILIES = {
    "llama": dict(model_type="llama"),
    "qwen3": dict(model_type="qwen3"),
    "gemma2": dict(model_type="gemma2", query_pre_attn_scalar=64),
    "gemma3": dict(model_type="gemma3_text", query_pre_attn_scalar=64, sliding_window=512),
    "phi3": dict(model_type="phi3", rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                     "partial_rotary_factor": 0.75}, pad_token_id=None),
    "mistral-window": dict(model_type="mistral", sliding_window=512),
    "mixtral": dict(model_type="mixtral", intermediate_size=768),
    "qwen3-moe": dict(model_type="qwen3_moe"),
}
MOE_FAMILIES = ("mixtral", "qwen3-moe")
# --quick (make test's smoke run of make bench): tiny shapes, three families, its figures meaningless
QUICK_SHAPE = dict(SHAPE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=320)
QUICK_MOE = dict(MOE, moe_intermediate_size=64)
QUICK_FAMILIES = "llama,qwen3,qwen3-moe"


def build(root: Path, name: str, quick: bool = False) -> tuple[str, int]:
    """The family's random checkpoint under root: (model dir, active parameters per token)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from loraplex.models.builtin.demo import build_byte_tokenizer

    spec = {**(QUICK_SHAPE if quick else SHAPE), **FAMILIES[name]}
    if name in MOE_FAMILIES:
        spec = {**(QUICK_MOE if quick else MOE), **spec}
    out = root / name
    build_byte_tokenizer(out, spec["max_position_embeddings"])
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(model_type, **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    model.save_pretrained(out, safe_serialization=True)
    active = sum(p.numel() for n, p in model.named_parameters() if "experts" not in n)
    experts = sum(p.numel() for n, p in model.named_parameters() if "experts" in n)
    if experts:
        active += experts * spec["num_experts_per_tok"] // spec.get("num_local_experts", spec.get("num_experts"))
    del model
    return str(out), active


def decode_round(engine, batch: int, steps: int, tag: str) -> float:
    """Median seconds of a decode-only step of `batch` greedy sequences of a 32-token prompt."""
    from loraplex.engine.request import SamplingParams

    for i in range(batch):
        params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
        engine.add_request(engine.make_request(f"{tag}-{i}", "x" * 31, params))
    engine.step()  # the prefill (and each first token)
    times = []
    while engine.has_work():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[:-1] or times)


PAIRS = (("mixtral", "mistral-window"), ("qwen3-moe", "qwen3"))  # MoE -> the dense family of its attention


def summary(rows: list[dict], batches: list[int]) -> tuple[str, dict]:
    """The markdown table and the goals' figures: {"worst_per_param": the largest family / llama ratio per active
    parameter, "moe_over_dense": the largest MoE / dense step ratio}, over the batch sizes."""
    llama = next((r for r in rows if r["family"] == "llama"), rows[0])
    by = {r["family"]: r for r in rows}
    lines = ["| family | active params (M) | " + " | ".join(f"ms/step b={b} | per param vs llama b={b}" for b in batches)
             + " |", "|---|---|" + "---|---|" * len(batches)]
    worst = 0.0
    for r in rows:
        cells = []
        for b in batches:
            per = (r[f"ms_b{b}"] / r["active_params"]) / (llama[f"ms_b{b}"] / llama["active_params"])
            worst = max(worst, per)
            cells += [f"{r[f'ms_b{b}']:.1f}", f"{per:.2f}x"]
        lines.append(f"| {r['family']} | {r['active_params'] / 1e6:.1f} | " + " | ".join(cells) + " |")
    moe = [(m, d, b, by[m][f"ms_b{b}"] / by[d][f"ms_b{b}"]) for m, d in PAIRS if m in by and d in by for b in batches]
    lines += ["", *(f"{m} / {d} (equal active MLP) at batch {b}: {ratio:.2f}x" for m, d, b, ratio in moe)]
    return "\n".join(lines), {"worst_per_param": worst, "moe_over_dense": max((x[3] for x in moe), default=None)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default=None, help=f"comma-separated (default: all: {','.join(FAMILIES)})")
    ap.add_argument("--batch", default="1,8", help="batch sizes (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=48, help="decode steps a round (default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help=f"tiny shapes, {QUICK_FAMILIES}, 4 steps (a smoke run)")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    steps = 4 if args.quick else args.steps
    from loraplex.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine

    names = (args.families or (QUICK_FAMILIES if args.quick else ",".join(FAMILIES))).split(",")
    rows, engines = [], {}
    with tempfile.TemporaryDirectory(prefix="families-") as tmp:
        for name in names:
            model_dir, active = build(Path(tmp), name, args.quick)
            engines[name] = LLMEngine(EngineConfig(model_dir=model_dir, max_model_len=512))
            rows.append({"family": name, "active_params": active})
    # rounds alternate over the families (best of 3 each), so that the machine's load drifts over all of them
    for b in batches:
        best = dict.fromkeys(names, float("inf"))
        for rnd in range(3):
            for name in names:
                best[name] = min(best[name], decode_round(engines[name], b, steps, f"{rnd}-{b}"))
        for row in rows:
            row[f"ms_b{b}"] = 1000 * best[row["family"]]
    for row in rows:
        print(json.dumps(row), flush=True)
    text, _ = summary(rows, batches)
    print("\n" + text)
    if args.json:
        Path(args.json).write_text(json.dumps({"batches": batches, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
