"""What moving structured-output compiles into worker processes costs, and why the engine compiles again.

    python benchmarks/constraint_compiles.py [--model-dir .cache/smollm2/model] [--repeats 7]

* start: the first constraint of a compiler (a worker process starts: Python, xgrammar, the vocabulary).
* per typical schema (benchmarks/structured_outputs.py's): xgrammar's compile in this process; the
  compiler's compile for a tenant with nothing cached (in a worker, then in the engine); and the road not
  taken, shipping the compiled grammar back (serialize_json, deserialize_json, its bytes). Best of --repeats.
* big grammars within the checks: what serializing them would ship.
* a regex that compiles past a 1 s bound: seconds until refused, and whether its worker is gone.

Nothing here asserts a timing; the figures go to docs/decisions/061-compile-workers.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from structured_outputs import TYPICAL_SCHEMAS  # noqa: E402

from loraplex.engine.compile_worker import compile_constraint, new_compiler  # noqa: E402
from loraplex.engine.constraints import Constraint, ConstraintCompiler  # noqa: E402
from loraplex.exceptions import InvalidRequest  # noqa: E402
from loraplex.launch.processes import process_running  # noqa: E402


def best_ms(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return 1000 * best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=str(ROOT / ".cache" / "smollm2" / "model"), help="a tokenizer's folder")
    ap.add_argument("--repeats", type=int, default=7, help="timed runs of each; the best is reported")
    args = ap.parse_args()
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    compiler = ConstraintCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], workers=1)
    t0 = time.perf_counter()
    compiler.compile(Constraint("regex", "warm"), "warm-up")
    print(f"first constraint (a worker starts)   {time.perf_counter() - t0:.2f} s")
    info = compiler._tokenizer_info()
    here = new_compiler(info)
    print(f"{'schema':16} {'in process':>11} {'worker+engine':>14} {'ser+deser':>10} {'shipped':>10}")
    for i, (name, schema) in enumerate(TYPICAL_SCHEMAS.items()):
        spec = json.dumps(schema, sort_keys=True)
        local = best_ms(lambda: compile_constraint(here, "json", spec), args.repeats)
        tenants = iter(f"t{i}-{k}" for k in range(args.repeats))
        pooled = best_ms(lambda: compiler.compile(Constraint("json", spec), next(tenants)), args.repeats)
        grammar = compile_constraint(here, "json", spec)
        text = grammar.serialize_json()
        trip = best_ms(lambda: xgr.CompiledGrammar.deserialize_json(grammar.serialize_json(), info), args.repeats)
        print(f"{name:16} {local:9.2f}ms {pooled:12.2f}ms {trip:8.2f}ms {len(text) / 1e6:8.2f}MB")
    big = {"400 required properties": ("json", json.dumps({"type": "object", "properties": {
        f"p{i}": {"type": "integer"} for i in range(400)}, "required": [f"p{i}" for i in range(400)]})),
        "a chain of 1000 rules": ("grammar", "root ::= r0\n" + "\n".join(
            f'r{i} ::= "a{i}" r{i + 1} | "b" r{i + 1} | "c"' for i in range(1000)) + '\nr1000 ::= "z"')}
    for name, (kind, spec) in big.items():
        t0 = time.perf_counter()
        grammar = compile_constraint(here, kind, spec)
        took = time.perf_counter() - t0
        print(f"{name} ({len(spec) / 1e3:.0f} kB): compiles in {1000 * took:.0f} ms, "
              f"{grammar.memory_size_bytes / 1e6:.1f} MB in memory, {len(grammar.serialize_json()) / 1e6:.0f} MB "
              "serialized")
    stopping = ConstraintCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], 1.0, workers=1)
    stopping.compile(Constraint("regex", "warm"), "warm-up")
    [worker] = stopping.worker_pids()
    slow = Constraint("regex", ("(a|" * 16 + "b" + ")*" * 16) * 100)  # within the nesting check
    t0 = time.perf_counter()
    try:
        stopping.compile(slow, "tenant")
    except InvalidRequest as exc:
        print(f"past a 1 s bound: refused after {time.perf_counter() - t0:.2f} s ({exc}); its worker "
              f"{'still runs' if process_running(worker) else 'is gone'}")
    for c in (compiler, stopping):
        c.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
