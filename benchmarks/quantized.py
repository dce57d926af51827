"""SmolLM2 served in int8 against our fp16 and llama.cpp's q8_0, through Triton, in one run (issue 41's CPU goals).

    python benchmarks/quantized.py [--max-tokens 128] [--rounds 5] [--mixed-streams 16] [--llama-threads N,...]
        [--engine-config JSON] [--int8-config JSON] [--fp16-config JSON] [--no-llama] [--quick] [--json PATH]

Servers, all started and warmed before any timing, on the same SmolLM2-135M-Instruct checkpoint
(.cache/smollm2/model, fp32 on disk):
  int8       `loraplex-serve --model smollm2 --quantization int8` (benchmarks/serving.py's Launcher: free
             ports, a temp adapter store with the demo adapters pirate and french): int8 weights per output
             channel, quantized at load, the adapters in full precision;
  fp16       `loraplex-serve --model smollm2` with `weight_dtype: float16` (fp16 weights, fp32 compute: the
             CPU path before issue 41);
  llama.cpp  one `llama-server` per --llama-threads value on a q8_0 GGUF of the same checkpoint (its
             `convert_hf_to_gguf.py --outtype q8_0`; llama.cpp built by benchmarks/llamacpp.py, which this
             reuses: the pinned llama-cpp-python sdist's vendored llama.cpp). Default: as many threads as
             int8's native loops (equal threads), and every usable CPU (the goal takes the faster). With
             `--no-repack`: on x86 the only repacked layout of q8_0 is ggml's AMX buffer type, whose kernel
             dies of an illegal instruction (`tilezero`) in this version on the AMX-capable CPU of our
             VMs; without it q8_0 runs ggml's AVX-512 VNNI dot products, as llama.cpp does on every x86
             CPU without AMX.
Both of ours run with the server's default threads (`make serve`'s on 2 CPUs: 1 torch thread; native loops
on every CPU for fp16, every CPU but one for int8, decision 079; printed); --engine-config adds knobs to
both, --int8-config / --fp16-config to one (e.g. each at the native threads it is fastest at).

Workloads (greedy, `ignore_eos`, exactly --max-tokens tokens a request, chat-templated questions):
  single  one base-model stream (the "light client": triton_overhead.py's HTTP `generate_stream` client for
          ours, llama.cpp's `/completion` as benchmarks/llamacpp.py sends it), on every server;
  mixed   --mixed-streams concurrent streams, round-robin over pirate and french, on int8 and fp16.
Each round runs every server once per workload, the order turning by one server each round, so a slower
minute of a shared machine falls on each of them alike. tok/s = the tokens the server reports over the wall
time from the first request sent to the last answer. Ratios (int8 / fp16, int8 / llama.cpp) are taken within
each round, then their median over the rounds is reported beside the ratio of the best runs. Against
llama.cpp twice: at equal threads, and against its faster thread count in each round (the goal's row): a
llama-server with as many spinning threads as cores collapses when another process takes a core (2-47
tok/s on a 2-core machine at load 3), which would flatter us. The load
average is printed before, during (each round) and after.

Goals (issue 41): single stream int8 at least llama.cpp q8_0 at equal threads and at least 1.8x our fp16;
16 mixed-adapter streams int8 at least 1.5x our fp16. --quick: the tiny demo model, 8 tokens, 2 mixed
streams, one round, no llama.cpp (a smoke run; its figures mean nothing). Nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import llamacpp  # noqa: E402
from serving import BASE_MODEL, Launcher, model_and_adapters, server_threads, warm_up  # noqa: E402
from triton_overhead import prompts_for, through_triton  # noqa: E402
from loraplex.launch.cpus import usable_cpus  # noqa: E402

GOALS = {"single_vs_fp16": 1.8, "single_vs_llama": 1.0, "mixed_vs_fp16": 1.5}
ADAPTERS = {"smollm2": list(llamacpp.ADAPTERS), "tiny": ["demo-a", "demo-b"]}


def log(msg: str) -> None:
    print(f"[quantized] {msg}", flush=True)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per request, ignore_eos (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds over every server (default: %(default)s)")
    ap.add_argument("--mixed-streams", type=int, default=16,
                    help="concurrent mixed-adapter streams on int8 and fp16; 0: none (default: %(default)s)")
    ap.add_argument("--llama-threads", default="",
                    help="one llama-server per value (its -t/-tb); default: int8's native threads (equal threads) "
                         "and every usable CPU")
    ap.add_argument("--no-llama", action="store_true", help="leave llama.cpp out")
    ap.add_argument("--engine-config", default="{}", help="engine knobs (JSON) added to both of ours")
    ap.add_argument("--int8-config", default="{}", help="engine knobs (JSON) of the int8 server only, over those")
    ap.add_argument("--fp16-config", default="{}", help="engine knobs (JSON) of the fp16 server only, over those")
    ap.add_argument("--llama-cpp-python", default=llamacpp.LLAMA_CPP_PYTHON,
                    help="llama-cpp-python sdist whose vendored llama.cpp is built (default: %(default)s)")
    ap.add_argument("--llama-server", type=Path, help="an existing llama-server binary instead of the cached build")
    ap.add_argument("--cache", type=Path, default=llamacpp.CACHE, help="sdist, build and GGUFs (default: %(default)s)")
    ap.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for each server")
    ap.add_argument("--quick", action="store_true", help="the demo model, tiny runs, no llama.cpp (a smoke run)")
    ap.add_argument("--json", dest="json_path", type=Path, help="write every figure here")
    return ap


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def llama_servers(args, model: str, checkpoint: Path, threads: list[int], slots: int, work: Path) -> tuple[list, dict]:
    """llama-servers on a q8_0 GGUF of the checkpoint (built and converted once), and what they run."""
    from loraplex.launch.serve import builtin_model

    src = llamacpp.llama_source(args.cache, args.llama_cpp_python)
    commit = llamacpp.upstream_commit(src, args.llama_cpp_python)
    binary = args.llama_server or llamacpp.build_llama_server(src, commit)
    gguf, loras = llamacpp.make_ggufs(src, args.cache, args.llama_cpp_python, checkpoint, builtin_model(model)[1],
                                      "q8_0")
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                             check=False).stderr.strip().splitlines()
    servers = [llamacpp.LlamaServer(binary, gguf, loras, t, slots, 256, work / f"llama-server-t{t}.log")
               for t in threads]
    for server in servers:  # q8_0's only repacked layout on x86 is ggml's AMX buffer: SIGILL on this CPU's VMs
        server.command.append("--no-repack")
    return servers, {"commit": commit, "version": version, "gguf": str(gguf), "gguf_bytes": gguf.stat().st_size,
                     "command": servers[0].command if servers else []}


def run_one(server, prompts: list[str], adapters: list[str], max_tokens: int, decode_rates: list) -> float:
    """tok/s of the prompts sent at once; decode_rates gets llama-server's own decode-only tok/s (its median over
    the requests; nothing for ours)."""
    if isinstance(server, llamacpp.LlamaServer):
        rates: list[float] = []
        tok_s = llamacpp.through_llama(server.http_url, prompts, adapters, max_tokens, rates)
        decode_rates.append(statistics.median(rates))
        return tok_s
    return through_triton(server.http_url, prompts, adapters, max_tokens)


def short_answers(servers: dict, prompt: str, tokens: int) -> dict[str, str]:
    """One greedy answer of the base model from each server (do they compute the same model?)."""
    out = {}
    for name, server in servers.items():
        if isinstance(server, llamacpp.LlamaServer):
            out[name] = llamacpp.llama_text(server.http_url, prompt, tokens, BASE_MODEL)
        else:
            out[name] = llamacpp.ours_text(server.http_url, prompt, tokens, BASE_MODEL)
        log(f"{name:>12}: {out[name]!r}")
    return out


def ratios(runs: dict, workload: str, num: str, *dens: str) -> dict | None:
    """num / den within each round (several dens: the fastest of them that round), their median, and the ratio of
    the best runs (None if a server is missing)."""
    a, bs = runs.get((workload, num)), [runs.get((workload, d)) for d in dens]
    if not a or not bs or not all(bs):
        return None
    b = [max(values) for values in zip(*bs)]
    per_round = [x / y for x, y in zip(a, b)]
    return {"per_round": per_round, "median": statistics.median(per_round), "best": max(a) / max(b)}


def threads_text(report: dict) -> str:
    """Each of our servers' threads, in words."""
    servers = report.get("servers") or {"ours": {"torch_threads": report["torch_threads"],
                                                 "native_threads": report["native_threads"]}}
    return "; ".join(f"{name} {s['torch_threads']} torch + {s['native_threads']} native threads"
                     for name, s in servers.items())


def summary(report: dict) -> tuple[str, str]:
    """(the tok/s table, the goals table) in markdown."""
    lines = ["| workload | server | tok/s each round | best | median | llama.cpp's decode-only tok/s (its timings) |",
             "|---|---|---|---|---|---|"]
    for r in report["runs"]:
        values, own = r["tok_s"], r.get("decode_tok_s")
        lines.append(f"| {r['workload']} | {r['server']} | {' '.join(f'{v:.1f}' for v in values)} | {max(values):.1f} | "
                     f"{statistics.median(values):.1f} | {' '.join(f'{v:.1f}' for v in own) if own else '-'} |")
    goals = ["| goal | ratio | each round | median | best runs | asked | met (median) |", "|---|---|---|---|---|---|---|"]
    for g in report["goals"]:
        r = g["ratio"]
        cells = ("-", "-", "-", "no (not measured)") if r is None else (
            " ".join(f"{x:.2f}" for x in r["per_round"]), f"{r['median']:.2f}x", f"{r['best']:.2f}x",
            "**yes**" if r["median"] >= g["asked"] else "no")
        goals.append(f"| {g['key']} | {g['what']} | {cells[0]} | {cells[1]} | {cells[2]} | at least {g['asked']:g} | "
                     f"{cells[3]} |")
    return "\n".join(lines), "\n".join(goals)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model = "tiny" if args.quick else "smollm2"
    if args.quick:
        args.max_tokens, args.rounds, args.mixed_streams, args.no_llama = 8, 1, min(args.mixed_streams, 2), True
    extra = json.loads(args.engine_config)
    configs = {"int8": {**extra, **json.loads(args.int8_config)},
               "fp16": {**extra, "weight_dtype": "float16", **json.loads(args.fp16_config)}}
    model_flags, checkpoint, _ = model_and_adapters(argparse.Namespace(model_dir=None, model=model, adapters="base"))
    adapters = ADAPTERS[model]
    threads_of = {"int8": server_threads({**configs["int8"], "quantization": "int8"}),  # (torch, native threads)
                  "fp16": server_threads(configs["fp16"])}
    torch_threads, native_threads = threads_of["int8"]
    threads = [int(t) for t in args.llama_threads.split(",") if t] or sorted({native_threads, usable_cpus()})
    load_before = load_average()
    log(f"load average before: {load_before} ({os.cpu_count()} CPUs); "
        + "; ".join(f"{name}: {t} torch, {n} native threads" for name, (t, n) in threads_of.items()))
    work = Path(tempfile.mkdtemp(prefix="quantized-bench-"))
    ours = {"int8": Launcher([*model_flags, "--quantization", "int8"], configs["int8"], work / "store-int8",
                             work / "loraplex-serve-int8.log"),
            "fp16": Launcher(model_flags, configs["fp16"], work / "store-fp16", work / "loraplex-serve-fp16.log")}
    llamas, llama_info = ([], {}) if args.no_llama else llama_servers(
        args, model, checkpoint, threads, max(1, args.mixed_streams), work)
    servers = {**ours, **{f"llama.cpp q8_0 -t {s.threads}": s for s in llamas}}
    log(f"logs in {work}")
    runs: dict[tuple[str, str], list[float]] = {}
    decode: dict[tuple[str, str], list[float]] = {}  # llama-server's decode-only tok/s (its timings)
    loads = []
    try:
        with ThreadPoolExecutor(len(servers)) as pool:  # started together: their start-ups overlap
            for started in [pool.submit(server.start, args.ready_timeout) for server in servers.values()]:
                started.result()
        log("servers ready; warming up")
        for server in ours.values():
            warm_up(server.http_url, [BASE_MODEL, *adapters])
        for server in llamas:
            llamacpp.through_llama(server.http_url, prompts_for(model, 1), [BASE_MODEL], 4)
        answers = short_answers(servers, prompts_for(model, 4)[3], 24)
        workloads = [("single", list(servers), prompts_for(model, 1), [BASE_MODEL])]
        if args.mixed_streams:
            workloads.append((f"mixed x{args.mixed_streams}", list(ours), prompts_for(model, args.mixed_streams),
                              adapters))
        for r in range(args.rounds):
            for workload, names, prompts, names_of_adapters in workloads:
                order = names[r % len(names):] + names[:r % len(names)]
                for name in order:
                    tok_s = run_one(servers[name], prompts, names_of_adapters, args.max_tokens,
                                    decode.setdefault((workload, name), []))
                    runs.setdefault((workload, name), []).append(tok_s)
            loads.append(load_average())
            log(f"round {r + 1}/{args.rounds}: " + "; ".join(f"{w} {n} {v[-1]:.1f}" for (w, n), v in runs.items())
                + f" tok/s; load {loads[-1]}")
    finally:
        for server in servers.values():
            server.stop()
    mixed = f"mixed x{args.mixed_streams}"
    equal = f"llama.cpp q8_0 -t {native_threads}"  # as many threads as int8's native loops
    llama_names = [n for n in servers if n.startswith("llama")]
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": model, "max_tokens": args.max_tokens,
        "rounds": args.rounds, "mixed_streams": args.mixed_streams, "adapters": adapters,
        "torch_threads": torch_threads, "native_threads": native_threads, "llama_threads": threads,
        "servers": {name: {"engine_config": configs[name], "torch_threads": t, "native_threads": n}
                    for name, (t, n) in threads_of.items()},
        "llama": llama_info, "engine_config": extra, "answers": answers,
        "load_before": load_before, "load_rounds": loads, "load_after": load_average(), "cpus": os.cpu_count(),
        "runs": [{"workload": w, "server": n, "tok_s": v, **({"decode_tok_s": decode[w, n]} if decode.get((w, n)) else {})}
                 for (w, n), v in runs.items()],
        "goals": [
            {"key": "single_vs_fp16", "what": "one stream, int8 / fp16", "asked": GOALS["single_vs_fp16"],
             "ratio": ratios(runs, "single", "int8", "fp16")},
            {"key": "single_vs_llama", "what": "one stream, int8 / llama.cpp q8_0 at its faster thread count each "
             f"round (of -t {', '.join(str(t) for t in threads)})", "asked": GOALS["single_vs_llama"],
             "ratio": ratios(runs, "single", "int8", *llama_names)},
            {"key": "single_vs_llama_equal", "what": f"one stream, int8 / {equal} (equal threads)",
             "asked": GOALS["single_vs_llama"], "ratio": ratios(runs, "single", "int8", equal)},
            {"key": "mixed_vs_fp16", "what": f"{args.mixed_streams} mixed-adapter streams, int8 / fp16",
             "asked": GOALS["mixed_vs_fp16"], "ratio": ratios(runs, mixed, "int8", "fp16")},
        ]}
    tok_table, goals_table = summary(report)
    print(f"\n{model}, {args.max_tokens} greedy tokens a request (ignore_eos), {args.rounds} rounds; "
          f"{threads_text(report)}\n")
    print(tok_table)
    print()
    print(goals_table)
    print(f"\nload average (1, 5, 15 min): before {load_before}, each round {' | '.join(loads)}, after "
          f"{report['load_after']}; {os.cpu_count()} CPUs")
    if llama_info:
        print(f"llama.cpp {llama_info['commit']} (llama-cpp-python {args.llama_cpp_python} sdist), "
              f"{llama_info['gguf_bytes'] / 1e6:.0f} MB q8_0 GGUF")
    if args.json_path:
        args.json_path.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
