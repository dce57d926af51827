"""A neighbour's greedy stream alone and beside a hostile structured-output request (issue 39): the grammar
compiles in microseconds, but its matching grows with every token; the matching budget
(grammar_token_budget_ms, grammar_mean_budget_ms) ends it, so the neighbour's time holds.

    python benchmarks/hostile_neighbour.py [--model-dir .cache/smollm2/model] [--n 4] [--tokens 64]
        [--repeats 3] [--head-start 0] [--token-budget-ms 10] [--mean-budget-ms 1] [--threads N] [--json PATH]

One in-process engine, stepped on this thread (the loop's work, as served). Each repeat runs the neighbour
alone (--tokens greedy tokens, ignore_eos), then again beside the hostile request (--n samples, temperature 1,
seeded), added in the same step or --head-start steps after it. The hostile request is left to run until the
neighbour ends; if it is still running then it is aborted (with the budget off it would run for minutes).
Prints the medians, their ratio (the issue's goal: at most 1.5x), how the hostile request ended and its
matching CPU time.
Nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as tritonserver runs the engine (decision 056)

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loraplex.config import EngineConfig  # noqa: E402
from loraplex.engine.llm_engine import LLMEngine  # noqa: E402
from loraplex.engine.request import SamplingParams  # noqa: E402

HOSTILE = 'root ::= x\nx ::= x x | "a" | "b" | ""'  # the grammar


def log(message: str) -> None:
    print(f"[hostile_neighbour] {message}", file=sys.stderr, flush=True)


def neighbour(engine: LLMEngine, rid: str, tokens: int):
    return engine.make_request(rid, "Write a short story about a lighthouse keeper.",
                               SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True), "neighbour")


def hostile(engine: LLMEngine, rid: str, n: int, max_tokens: int, grammar: str):
    return engine.make_request(rid, "abbabaabbbabaababbabbbaababaabbbabab", SamplingParams.from_dict(
        {"n": n, "temperature": 1.0, "seed": 7, "max_tokens": max_tokens,
         "structured_outputs": {"grammar": grammar}}), "mallory")


def run(engine: LLMEngine, requests: list, watched, head_start: int = 0) -> tuple[float, dict]:
    """Add `requests`, step `head_start` times, then add `watched` and step until it ends: its seconds from being
    added, and every request's outputs; requests still running then are aborted (and stepped until they end)."""
    for request in requests:
        engine.add_request(request)
    outputs: dict[str, list] = {r.request_id: [] for r in (*requests, watched)}
    for _ in range(head_start):
        for out in engine.step():
            outputs[out.request_id].append(out)
    engine.add_request(watched)
    t0 = time.perf_counter()
    took = None
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id].append(out)
            if out.request_id == watched.request_id and out.finished and took is None:
                took = time.perf_counter() - t0
                for other in requests:
                    if not any(o.finished and o.error for o in outputs[other.request_id]):
                        engine.abort(other.request_id)
    return took, outputs


def matching(engine: LLMEngine) -> float:
    """The hostile tenant's matching CPU seconds so far (0 on a revision that does not count them)."""
    return getattr(engine.runner, "grammar_seconds", {}).get("mallory", 0.0)


def hostile_outcome(outs: list) -> str:
    """How the hostile request ended: its error, or its samples' finish reasons, and its tokens."""
    tokens = sum(len(o.token_ids) for o in outs)
    errors = [o.error for o in outs if o.error is not None]
    if errors:
        return f"ended after {tokens} tokens: {errors[-1]}"
    return f"{tokens} tokens, finish reasons {sorted({o.finish_reason for o in outs if o.finished})}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=str(ROOT / ".cache" / "smollm2" / "model"),
                    help="a checkpoint of a supported family (default: SmolLM2 as `make smollm2` converts it)")
    ap.add_argument("--n", type=int, default=4, help="samples of the hostile request")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens of the neighbour")
    ap.add_argument("--hostile-tokens", type=int, default=1024, help="max_tokens of the hostile request")
    ap.add_argument("--grammar", default=HOSTILE, help="the hostile request's EBNF grammar (default: the issue's)")
    ap.add_argument("--repeats", type=int, default=3, help="alone/beside pairs; medians are reported")
    ap.add_argument("--head-start", type=int, default=0,
                    help="steps the hostile request runs before the neighbour is added (0: both in one step)")
    ap.add_argument("--token-budget-ms", type=float, default=None, help="grammar_token_budget_ms (default: the knob's)")
    ap.add_argument("--mean-budget-ms", type=float, default=None, help="grammar_mean_budget_ms (default: the knob's)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--json", dest="json_path", default=None, help="write the figures here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    knobs = {k: v for k, v in (("grammar_token_budget_ms", args.token_budget_ms),
                               ("grammar_mean_budget_ms", args.mean_budget_ms)) if v is not None}
    engine = LLMEngine(EngineConfig(model_dir=args.model_dir, **knobs))
    run(engine, [], neighbour(engine, "warm", 8))  # warm-up: the first steps' allocations
    alone, beside, outcomes, matched = [], [], [], []
    for repeat in range(args.repeats):
        took, _ = run(engine, [], neighbour(engine, f"alone-{repeat}", args.tokens))
        alone.append(took)
        spent = matching(engine)
        h = hostile(engine, f"hostile-{repeat}", args.n, args.hostile_tokens, args.grammar)  # compiled (cached after)
        took, outputs = run(engine, [h], neighbour(engine, f"beside-{repeat}", args.tokens), args.head_start)
        beside.append(took)
        outcomes.append(hostile_outcome(outputs[h.request_id]))
        matched.append(matching(engine) - spent)
        log(f"#{repeat + 1}: alone {alone[-1]:.2f} s, beside {beside[-1]:.2f} s; hostile {outcomes[-1]}")
    ratio = statistics.median(beside) / statistics.median(alone)
    budget = getattr(engine.runner, "grammar_budget", None)  # None: a revision before the budget
    limits = [budget.token_ms, budget.mean_ms] if budget else None
    print(f"model {args.model_dir}, torch threads {torch.get_num_threads()}, budget "
          + (f"{limits[0]:g} ms a token, {limits[1]:g} ms a token on average" if limits else "none"))
    print(f"neighbour alone ({args.tokens} greedy tokens)   {statistics.median(alone):7.2f} s (median of {args.repeats})")
    print(f"beside the hostile n={args.n} request        {statistics.median(beside):7.2f} s   {ratio:.2f}x "
          f"(added after the hostile's first {args.head_start} steps)")
    print(f"hostile request: {outcomes[-1]}; its matching {statistics.median(matched):.2f} s CPU (median)")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"alone_s": alone, "beside_s": beside, "ratio": ratio,
                                                    "hostile": outcomes, "matching_cpu_s": matched,
                                                    "budget_ms": limits,
                                                    "command": sys.argv}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
