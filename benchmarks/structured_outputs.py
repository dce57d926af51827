"""Structured outputs: what a JSON-schema constraint costs in the shared batch, and what compiling one costs.

    python benchmarks/structured_outputs.py [--model-dir .cache/smollm2/model] [--streams 16]
        [--max-tokens 64] [--repeats 3] [--threads N] [--json PATH]

* throughput: --streams sequences added at once to one in-process engine (stepped on this thread),
  every one generating exactly --max-tokens tokens; "free": none constrained (ignore_eos); "mixed":
  half of them constrained by a JSON schema that cannot end before --max-tokens tokens (an array of
  at least that many strings), the other half free. The two runs alternate over --repeats (free,
  mixed, free, ...); output tokens/s of each, the best of each, and their ratio (issue 32 asks 0.9x).
  Per step: the time the loop thread spends on the bitmasks (waiting for the fills started before the
  forward pass, then applying them), and the matchers' CPU time (fills on their threads, accepts).
* compile: typical schemas compiled for a tenant that has none cached (in a compile worker, then in the
  engine), --compiles times each: p50 and p99; then the same constraint again (the tenant's cache): p50.

Nothing here asserts a timing; the figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loraplex.config import EngineConfig  # noqa: E402
from loraplex.engine.constraints import Constraint  # noqa: E402
from loraplex.engine.llm_engine import LLMEngine  # noqa: E402
from loraplex.engine.request import SamplingParams  # noqa: E402
from loraplex.worker import grammar_mask  # noqa: E402

TYPICAL_SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                "email": {"type": "string", "format": "email"}},
               "required": ["name", "age"]},
    "order": {"type": "object", "properties": {
        "id": {"type": "string"}, "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
            "price": {"type": "number"}}, "required": ["sku", "qty"]}},
        "status": {"enum": ["open", "paid", "shipped", "cancelled"]}}, "required": ["id", "items", "status"]},
    "classification": {"type": "object", "properties": {
        "label": {"enum": ["positive", "negative", "neutral"]}, "confidence": {"type": "number"},
        "reasons": {"type": "array", "items": {"type": "string", "maxLength": 80}, "maxItems": 5}},
        "required": ["label"]},
    "extraction": {"type": "object", "properties": {
        "entities": {"type": "array", "items": {"type": "object", "properties": {
            "text": {"type": "string"}, "type": {"enum": ["PERSON", "ORG", "PLACE", "DATE"]},
            "start": {"type": "integer"}, "end": {"type": "integer"}}, "required": ["text", "type"]}}},
        "required": ["entities"], "additionalProperties": False},
}


def log(message: str) -> None:
    print(f"[structured_outputs] {message}", file=sys.stderr, flush=True)


def run(engine: LLMEngine, streams: int, max_tokens: int, constrained: int) -> dict:
    """Output tokens/s of one batch of `streams` requests, the first `constrained` of them under a JSON schema."""
    schema = {"type": "array", "items": {"type": "string"}, "minItems": max_tokens}
    requests = []
    for i in range(streams):
        if i < constrained:
            params = SamplingParams.from_dict({"max_tokens": max_tokens, "temperature": 0,
                                               "structured_outputs": {"json": schema}})
        else:
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        requests.append(engine.make_request(f"s{i}", f"Item {i}: list words as JSON.", params))
    spent, apply = [0.0], grammar_mask.GrammarMask.apply

    def timed(self, logits, rows, filling=None):
        t0 = time.perf_counter()
        apply(self, logits, rows, filling)
        spent[0] += time.perf_counter() - t0

    grammar_mask.GrammarMask.apply = timed
    steps_before = engine.scheduler.num_updates
    matched_before = sum(engine.runner.grammar_seconds.values())
    t0 = time.perf_counter()
    try:
        outputs = engine.generate(requests)
    finally:
        grammar_mask.GrammarMask.apply = apply
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for outs in outputs.values() for o in outs)
    assert tokens == streams * max_tokens, (tokens, streams * max_tokens)
    steps = engine.scheduler.num_updates - steps_before
    matched = sum(engine.runner.grammar_seconds.values()) - matched_before
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "steps": steps,
            "mask_ms_per_step": 1000 * spent[0] / max(steps, 1), "match_cpu_ms_per_step": 1000 * matched / max(steps, 1)}


def compile_times(engine: LLMEngine, compiles: int) -> dict:
    """p50/p99 of a compile of each typical schema by a tenant that has not compiled it (nothing cached for it:
    the compile in a worker process, then in the engine), and of the same tenant's cached one."""
    fresh, cached = [], []
    compiler = engine.constraints  # its worker started by the runs before
    for i in range(compiles):
        for name, schema in TYPICAL_SCHEMAS.items():
            constraint, tenant = Constraint("json", json.dumps(schema, sort_keys=True)), f"bench-{i}-{name}"
            t0 = time.perf_counter()
            compiler.compile(constraint, tenant)
            fresh.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            compiler.compile(constraint, tenant)
            cached.append(time.perf_counter() - t0)
    fresh.sort()
    return {"fresh_p50_ms": 1000 * statistics.median(fresh), "fresh_p99_ms": 1000 * fresh[int(0.99 * (len(fresh) - 1))],
            "cached_p50_ms": 1000 * statistics.median(cached), "samples": len(fresh)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=str(ROOT / ".cache" / "smollm2" / "model"),
                    help="a checkpoint of a supported family (default: SmolLM2 as `make smollm2` converts it)")
    ap.add_argument("--streams", type=int, default=16, help="sequences in the batch; half constrained in 'mixed'")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens every sequence generates")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each (alternating); the best is reported")
    ap.add_argument("--compiles", type=int, default=10, help="fresh compiles of each typical schema")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--json", dest="json_path", default=None, help="write the figures here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model_dir=args.model_dir, max_num_seqs=max(args.streams, 1)))
    run(engine, args.streams, 8, args.streams // 2)  # warm-up: xgrammar imported, its tokenizer set up
    runs = {"free": [], "mixed": []}
    for repeat in range(args.repeats):
        for name, constrained in (("free", 0), ("mixed", args.streams // 2)):
            result = run(engine, args.streams, args.max_tokens, constrained)
            runs[name].append(result)
            log(f"{name} #{repeat + 1}: {result['tokens_per_s']:.1f} tok/s, mask {result['mask_ms_per_step']:.3f} ms/step")
    best = {name: max(results, key=lambda r: r["tokens_per_s"]) for name, results in runs.items()}
    ratio = best["mixed"]["tokens_per_s"] / best["free"]["tokens_per_s"]
    compiled = compile_times(engine, args.compiles)
    print(f"model {args.model_dir}, {args.streams} streams x {args.max_tokens} tokens, torch threads "
          f"{torch.get_num_threads()}")
    print(f"free (none constrained)        {best['free']['tokens_per_s']:8.1f} tok/s")
    print(f"mixed (half JSON-schema)       {best['mixed']['tokens_per_s']:8.1f} tok/s   "
          f"{ratio:.2f}x of free; bitmask {best['mixed']['mask_ms_per_step']:.3f} ms/step on the loop "
          f"(matching {best['mixed']['match_cpu_ms_per_step']:.3f} ms CPU/step, fills on their threads)")
    print(f"compile, typical schemas       p50 {compiled['fresh_p50_ms']:.2f} ms, p99 {compiled['fresh_p99_ms']:.2f} ms "
          f"({compiled['samples']} fresh compiles); cached p50 {compiled['cached_p50_ms']:.3f} ms")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"runs": runs, "best": best, "ratio": ratio,
                                                    "compile": compiled, "command": sys.argv}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
