"""Multi-LoRA decode throughput: one batch with 1, 8 or 32 distinct adapters vs the base model
alone, and vs peft serving each adapter's requests one adapter at a time (the naive baseline
S-LoRA compares against).

    python benchmarks/lora_throughput.py [--json results.json] [--device auto|cpu|cuda]

What runs (same batch of --batch sequences in every row: same prompt lengths, greedy,
ignore_eos, exactly --max-tokens generated tokens each):

* engine: ``loraplex.engine.llm_engine.LLMEngine`` with all requests added at once, stepped on this
  thread; the rows take turns over the repeats (base, 8, 32, base, ...), best of each. Decode throughput = tokens sampled in pure decode steps / the time of those steps
  (the prefill step that also samples each sequence's first token is excluded); end-to-end
  = all generated tokens / wall time from add_request to the last output.
* peft (naive): the HF model wrapped by ``PeftModel`` with every adapter preloaded; for each
  adapter in turn ``set_adapter`` + one batched ``generate`` of that adapter's requests.
  Decode time is measured from the first generated token (a streamer timestamps it) to the
  end, so both sides' decode numbers exclude prefill. The base row's baseline is the plain
  HF model generating the whole batch at once.

The model is a random LLaMA built here (byte-level tokenizer, so a prompt of n-1 ASCII
characters is exactly n tokens) unless --model-dir names a LLaMA-family checkpoint;
adapters are random PEFT LoRAs of rank --rank written by peft itself. On CPU the engine runs
the torch reference kernels (fp32); on CUDA, the CUDA kernels (bf16 by default).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # peers.py, when imported from elsewhere

import peers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                    help="auto: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--lora-dtype", default="auto", choices=["auto", "float16"],
                    help="the engine's lora_dtype (float16: CPU fp32 only; peft keeps the adapters as written)")
    ap.add_argument("--batch", type=int, default=32, help="sequences in the batch (every row)")
    ap.add_argument("--adapters", default="1,8,32", help="distinct adapters per row, comma-separated")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sequence (incl. BOS)")
    ap.add_argument("--max-tokens", type=int, default=32, help="generated tokens per sequence (ignore_eos)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default="all", choices=["all", "attn"],
                    help="LoRA target modules: all 7 projections or q,k,v,o")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1376)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--model-dir", default=None, help="use this LLaMA-family checkpoint instead of a random one")
    ap.add_argument("--work-dir", default=None, help="where to build model and adapters (default: a temp dir)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per row (best is reported)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    ap.add_argument("--json", dest="json_path", default=None, help="write results to this JSON file")
    return ap.parse_args(argv)


def log(msg: str) -> None:
    """Progress on stderr (the table goes to stdout)."""
    print(f"[lora_throughput] {msg}", file=sys.stderr, flush=True)


def build_assets(args, work: Path, num_adapters: int) -> tuple[str, dict[str, str]]:
    """Model checkpoint and num_adapters random PEFT adapters; returns (model_dir, name -> path)."""
    return peers.build_model_and_adapters(
        work, num_adapters, args.rank, args.targets, model_dir=args.model_dir, hidden_size=args.hidden,
        intermediate_size=args.intermediate, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads)


def make_prompts(tokenizer, batch: int, prompt_len: int) -> list[str]:
    """Distinct ASCII prompts that tokenize to exactly prompt_len tokens (checked)."""
    words = "the quick brown fox jumps over a lazy dog while many tenants share one server".split()
    prompts = []
    for i in range(batch):
        text, j = f"{i}:", i
        while len(tokenizer(text).input_ids) < prompt_len:
            text += " " + words[j % len(words)]
            j += 7
        ids = tokenizer(text).input_ids[:prompt_len]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        if len(tokenizer(text).input_ids) != prompt_len:
            raise SystemExit(f"cannot make a prompt of exactly {prompt_len} tokens with this tokenizer")
        prompts.append(text)
    return prompts


def assign(batch: int, names: list[str]) -> list[str | None]:
    """Adapter of each sequence: round-robin over names (None = base model)."""
    return [names[i % len(names)] if names else None for i in range(batch)]


def run_engine(engine, prompts: list[str], loras: list[str | None], max_tokens: int, tag: str) -> dict:
    """One batch to completion; decode and end-to-end throughput and the generated ids."""
    from loraplex.engine.request import SamplingParams

    reqs = []
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        params = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
        if lora:
            params["lora_name"] = lora
        reqs.append(engine.make_request(f"{tag}-{i}", prompt, SamplingParams.from_dict(params)))
    produced = {r.request_id: [] for r in reqs}
    decode_time, decode_tokens, steps = 0.0, 0, 0
    peers.sync(engine.device)
    t0 = time.perf_counter()
    for r in reqs:
        engine.add_request(r)
    while engine.has_work():
        had_first = {rid for rid, toks in produced.items() if toks}
        s0 = time.perf_counter()
        outs = engine.step()
        peers.sync(engine.device)
        dt = time.perf_counter() - s0
        steps += 1
        new = [(o.request_id, o.token_ids) for o in outs if o.token_ids]
        for rid, toks in new:
            produced[rid] += toks
        if new and all(rid in had_first for rid, _ in new):
            decode_time += dt
            decode_tokens += sum(len(t) for _, t in new)
        for o in outs:
            if o.error is not None:
                raise RuntimeError(f"request {o.request_id} failed: {o.error!r}")
    total = time.perf_counter() - t0
    n = sum(len(t) for t in produced.values())
    if n != len(reqs) * max_tokens:
        raise RuntimeError(f"engine generated {n} tokens, expected {len(reqs) * max_tokens}")
    return {"decode_tok_s": decode_tokens / decode_time if decode_time else float("nan"),
            "e2e_tok_s": n / total, "seconds": total, "steps": steps,
            "tokens": [produced[r.request_id] for r in reqs]}


def run_peft(model, tokenizer, prompts, loras, max_tokens: int) -> dict:
    """Naive serving: for each adapter (in order of first use) one batched generate of its requests.

    ``model`` is a PeftModel holding every adapter, or the plain HF model when loras are all None.
    """
    jobs = [peers.Job(tokenizer(p).input_ids, max_tokens, lora) for p, lora in zip(prompts, loras)]
    run = peers.run_static(model, jobs, peers.batches_by_adapter(jobs, len(jobs)), tokenizer.pad_token_id or 0,
                           adapters="set" if any(loras) else "none")
    return {"decode_tok_s": run.decode_tokens_per_s, "e2e_tok_s": run.tokens_per_s, "seconds": run.seconds,
            "tokens": run.tokens}


def best(runs: list[dict]) -> dict:
    """Best of the repeats, per metric (a noisy shared machine only ever makes a run slower)."""
    out = dict(runs[0])
    out["decode_tok_s"] = max(r["decode_tok_s"] for r in runs)
    out["e2e_tok_s"] = max(r["e2e_tok_s"] for r in runs)
    out["seconds"] = min(r["seconds"] for r in runs)
    return out


def main(argv: list[str] | None = None) -> int:
    """Build, run every row, print the table (and write JSON if asked)."""
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype if args.dtype != "auto" else ("float32" if device == "cpu" else "bfloat16")
    counts = [int(c) for c in args.adapters.split(",") if c.strip()]
    if any(c < 1 or c > args.batch for c in counts):
        raise SystemExit("--adapters counts must be between 1 and --batch")
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(sys.argv[1:] if argv is None else argv)])

    t_start = time.perf_counter()
    tmp = tempfile.TemporaryDirectory(prefix="lora_throughput-") if not args.work_dir else None
    work = Path(args.work_dir or tmp.name)
    log(f"building model and {max(counts)} adapters under {work}")
    model_dir, adapter_dirs = build_assets(args, work, max(counts))

    from transformers import AutoTokenizer

    from loraplex.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = make_prompts(tokenizer, args.batch, args.prompt_len)
    block_size = 16
    blocks_per_seq = -(-(args.prompt_len + args.max_tokens) // block_size)
    engine = LLMEngine(EngineConfig(
        model_dir=model_dir, device=device, dtype=dtype, multi_lora=adapter_dirs,
        max_loras=max(counts), max_cpu_loras=max(counts), max_lora_rank=args.rank,
        block_size=block_size, num_kv_blocks=args.batch * blocks_per_seq + 8,
        max_num_seqs=args.batch, max_num_batched_tokens=max(2048, args.batch * args.prompt_len),
        enable_prefix_caching=False, lora_dtype=args.lora_dtype,
    ))
    hf, peft_model = peers.load_peer_models(model_dir, adapter_dirs, dtype, device)  # EOS does not end a sequence
    names = sorted(adapter_dirs)
    log(f"device {device}, dtype {dtype}, torch threads {torch.get_num_threads()}; setup "
        f"{time.perf_counter() - t_start:.1f}s")

    rows = [("base", [])] + [(f"{c} adapter{'s' if c > 1 else ''}", names[:c]) for c in counts]
    for label, row_names in rows:  # loads every adapter into a slot (there is one for each)
        run_engine(engine, prompts, assign(args.batch, row_names), min(4, args.max_tokens), "warm")
    engine_runs = {label: [] for label, _ in rows}
    for k in range(args.repeats):  # the rows take turns, so a slower minute of a shared machine hits them alike
        for label, row_names in rows:
            engine_runs[label].append(run_engine(engine, prompts, assign(args.batch, row_names), args.max_tokens,
                                                 f"{label}-{k}"))
    results = []
    for label, row_names in rows:
        loras = assign(args.batch, row_names)
        eng = best(engine_runs[label])
        model = hf if not row_names else peft_model
        run_peft(model, tokenizer, prompts[:2], loras[:2], 2)  # warm-up
        ref = best([run_peft(model, tokenizer, prompts, loras, args.max_tokens) for _ in range(args.repeats)])
        match = sum(a == b for a, b in zip(eng["tokens"], ref["tokens"]))
        results.append({"row": label, "adapters": len(row_names), "engine": eng, "peft": ref, "match": match})
        log(f"{label}: engine decode {eng['decode_tok_s']:.0f} tok/s, peft decode {ref['decode_tok_s']:.0f} tok/s")

    base_decode = results[0]["engine"]["decode_tok_s"]
    base_e2e = results[0]["engine"]["e2e_tok_s"]
    header = (f"{'row':<12} {'engine decode':>14} {'vs base':>8} {'peft decode':>12} {'vs peft':>8} "
              f"{'engine e2e':>11} {'vs base':>8} {'peft e2e':>9} {'vs peft':>8} {'= peft':>7}")
    lines = [
        f"command: {command}",
        f"device {device}, dtype {dtype}, lora_dtype {args.lora_dtype}, torch threads {torch.get_num_threads()}, torch {torch.__version__}",
        f"model: {model_dir if args.model_dir else 'random LLaMA'} hidden {engine.model.config.hidden_size}, "
        f"layers {engine.model.num_layers}, heads {engine.model.num_heads}/{engine.model.num_kv_heads} kv, "
        f"intermediate {engine.model.config.intermediate_size}",
        f"batch {args.batch} sequences, prompt {args.prompt_len} tokens, {args.max_tokens} generated tokens each "
        f"(greedy, ignore_eos); adapters rank {args.rank} on {args.targets} projections; best of {args.repeats} runs",
        "throughput in generated tokens/s; 'decode' excludes the prefill step, 'e2e' includes it;",
        "peft = one adapter at a time (set_adapter + batched generate per adapter; base row: plain HF generate);",
        "'= peft' = sequences whose tokens equal peft's",
        "",
        header,
        "-" * len(header),
    ]
    for r in results:
        e, p = r["engine"], r["peft"]
        lines.append(
            f"{r['row']:<12} {e['decode_tok_s']:>14.0f} {e['decode_tok_s'] / base_decode:>7.2f}x "
            f"{p['decode_tok_s']:>12.0f} {e['decode_tok_s'] / p['decode_tok_s']:>7.2f}x "
            f"{e['e2e_tok_s']:>11.0f} {e['e2e_tok_s'] / base_e2e:>7.2f}x {p['e2e_tok_s']:>9.0f} "
            f"{e['e2e_tok_s'] / p['e2e_tok_s']:>7.2f}x {r['match']:>4}/{args.batch}"
        )
    lines.append("")
    lines.append(f"total wall time {time.perf_counter() - t_start:.1f}s")
    print("\n".join(lines), flush=True)

    if args.json_path:
        payload = {
            "command": command, "device": device, "dtype": dtype, "torch_threads": torch.get_num_threads(),
            "settings": {k: v for k, v in vars(args).items() if k != "json_path"},
            "rows": [{
                "row": r["row"], "adapters": r["adapters"], "sequences_equal_to_peft": r["match"],
                "engine": {k: v for k, v in r["engine"].items() if k != "tokens"},
                "peft": {k: v for k, v in r["peft"].items() if k != "tokens"},
                "engine_decode_vs_base": r["engine"]["decode_tok_s"] / base_decode,
                "engine_decode_vs_peft": r["engine"]["decode_tok_s"] / r["peft"]["decode_tok_s"],
                "engine_e2e_vs_base": r["engine"]["e2e_tok_s"] / base_e2e,
                "engine_e2e_vs_peft": r["engine"]["e2e_tok_s"] / r["peft"]["e2e_tok_s"],
            } for r in results],
        }
        Path(args.json_path).write_text(json.dumps(payload, indent=2) + "\n")
        log(f"wrote {args.json_path}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
