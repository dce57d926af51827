"""Many adapters under AIPerf load (issue 33): base, 8 adapters, 1,000 and 2,000 adapters on SmolLM2.

    python benchmarks/many_adapters.py [--quick] [--rate R] [--requests N] [--json PATH]

One `loraplex-serve --model smollm2` per configuration (device slots `max_loras` 8 and 32,
and, for the comparison, 8 slots with `adapter_admission="resident_first"`), each serving one
adapter store of 2,000 random PEFT adapters for SmolLM2 on q_proj and v_proj, ranks 8, 16,
32 and 64 mixed. Writing 2,000 distinct adapters would take ~7 GB, so the store holds 8
distinct weight files (4 ranks x 2 seeds, built once under .cache/many_adapters/) and each
adapter folder hard-links one of them: to the engine they are 2,000 adapters (read,
validated and loaded by name), but a cold read of an adapter whose file another adapter
read recently hits the page cache, so disk reads here are page-cache reads.

On each server AIPerf runs the workloads in order, each starting on an idle server:
base (no adapter), 8 adapters (uniform), 1,000 and 2,000 adapters with uniform and
Zipf(alpha=1) popularity (rank k drawn with weight 1/k over a seeded shuffle of the
names). Every workload is one JSONL dataset (random words, fixed max_tokens, greedy,
ignore_eos) sent in order at Poisson arrivals of --rate requests/s; each request's adapter
is its line's name, given to AIPerf as a round-robin --model-names list of one name per
request (the template puts it in `lora_name`).

Cold or warm, per request: the script replays the server's host tier (an LRU of
`max_cpu_loras` adapters) over the requests in arrival order, warm-ups included: a
request is cold when its adapter is not in that LRU at its arrival (the server must read
it from disk), warm otherwise (in host memory or a device slot). This is the order the
engine sees them in up to reordering within a step, so it can only misclassify a request
whose adapter was read or evicted within the same few steps.

Figures per workload: output tokens/s (the server's `loraplex_generation_tokens_total`
over AIPerf's benchmark duration), TTFT p50/p99 of cold and warm requests (AIPerf's
per-request records), step-time p99 with and without an adapter load in flight
(`loraplex_step_seconds{loading}`, from the histogram's buckets before and after the
run, interpolated as PromQL's histogram_quantile), the disk-read and host-to-device p99
(`loraplex_adapter_load_seconds`), device-slot loads, and the RSS of the server's
process tree (tritonserver and its Python stubs) after the run. Then the issue's goals:
2,000 adapters at >= 0.85x the 8-adapter throughput; cold TTFT p99 within warm TTFT p99
+ disk read p99 + one step p99; step-time p99 unchanged while adapters load.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import random
import re
import sys
import time
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import serving  # noqa: E402

RANKS = (8, 16, 32, 64)
VARIANTS = 8  # distinct weight files: RANKS x 2 seeds
TARGETS = ["q_proj", "v_proj"]
STORE_SIZE = 2000
MAX_CPU_LORAS = 32  # the engine's default host tier, replayed for cold / warm
PREFIX = "ma-"


@dataclass(frozen=True)
class Workload:
    name: str
    adapters: int  # 0: the base model
    popularity: str  # uniform | zipf


WORKLOADS = [Workload("base", 0, "uniform"), Workload("8", 8, "uniform"),
             Workload("1000-uniform", 1000, "uniform"), Workload("1000-zipf", 1000, "zipf"),
             Workload("2000-uniform", 2000, "uniform"), Workload("2000-zipf", 2000, "zipf")]
QUICK_WORKLOADS = ["base", "8", "2000-uniform", "2000-zipf"]
SERVERS = {  # name -> engine knobs
    "slots8": {"max_loras": 8},
    "slots32": {"max_loras": 32},
    "slots8-resident": {"max_loras": 8, "adapter_admission": "resident_first"},
}
COMPARED = ["8", "2000-uniform", "2000-zipf"]  # what the resident_first server runs (its own 8-adapter run too)


def adapter_name(i: int) -> str:
    return f"{PREFIX}{i:04d}"


def build_store(model_dir: Path, cache: Path, count: int = STORE_SIZE) -> Path:
    """`count` adapter folders, each hard-linking one of VARIANTS weight files (built once)."""
    variants = cache / "variants"
    if not (variants / "complete").exists():
        import torch
        from transformers import AutoModelForCausalLM

        from loraplex.models.builtin.demo import build_peft_adapter

        print(f"many_adapters.py: building {VARIANTS} adapter weight files in {variants}", flush=True)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        for k in range(VARIANTS):
            rank = RANKS[k % len(RANKS)]
            build_peft_adapter(model_dir, variants / f"v{k}", rank, 2 * rank, TARGETS, 5000 + k, model=base,
                               b_scale=0.1)
        (variants / "complete").write_text("")
    store = cache / f"store-{count}"
    if not (store / "complete").exists():
        for i in range(count):
            folder = store / adapter_name(i)
            folder.mkdir(parents=True, exist_ok=True)
            source = variants / f"v{(i * 7 + i // VARIANTS) % VARIANTS}"  # ranks mixed along the names
            for f in source.iterdir():
                if f.is_file() and not (folder / f.name).exists():
                    os.link(f, folder / f.name)
        (store / "complete").write_text("")
    return store


def choose(workload: Workload, n: int, seed: int) -> list[str]:
    """Each request's adapter (serving.BASE_MODEL for none)."""
    rng = random.Random(f"{seed}-{workload.name}")
    if not workload.adapters:
        return [serving.BASE_MODEL] * n
    names = [adapter_name(i) for i in range(workload.adapters)]
    if workload.popularity == "uniform":
        return [rng.choice(names) for _ in range(n)]
    rng.shuffle(names)  # popularity rank k -> a random adapter (ranks of weights mixed)
    cumulative, total = [], 0.0
    for k in range(1, len(names) + 1):
        total += 1.0 / k
        cumulative.append(total)
    return [names[min(bisect.bisect_left(cumulative, rng.random() * total), len(names) - 1)] for _ in range(n)]


class HostTier:
    """The server's host LRU replayed over requests in arrival order: which were cold (read from disk)."""

    def __init__(self, capacity: int = MAX_CPU_LORAS):
        self.capacity, self.lru = capacity, OrderedDict()

    def use(self, name: str) -> bool | None:
        """True if cold, False if warm, None for the base model."""
        if name == serving.BASE_MODEL:
            return None
        cold = name not in self.lru
        self.lru[name] = True
        self.lru.move_to_end(name)
        while len(self.lru) > self.capacity:
            self.lru.popitem(last=False)
        return cold


def write_dataset(path: Path, run: str, adapters: list[str], seed: int, input_chars: int, max_tokens: int) -> None:
    rng = random.Random(f"{seed}-{run}-text")
    with open(path, "w") as f:
        for i, _ in enumerate(adapters):
            line = {"session_id": f"{run}-{i:05d}", "text": serving.words_of(input_chars, rng),
                    "output_length": max_tokens}
            f.write(json.dumps(line) + "\n")


# ---- the server's metrics ------------------------------------------------------------------

def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def buckets(text: str, name: str, label: str, value: str) -> list[tuple[float, float]]:
    """(le, cumulative count) of one histogram's series whose `label` is `value` (summed over other labels)."""
    out: dict[float, float] = {}
    pattern = re.compile(rf'^{name}_bucket{{([^}}]*)}} (\S+)$', re.MULTILINE)
    for labels, count in pattern.findall(text):
        if f'{label}="{value}"' not in labels:
            continue
        le = re.search(r'le="([^"]+)"', labels).group(1)
        bound = float("inf") if le == "+Inf" else float(le)
        out[bound] = out.get(bound, 0.0) + float(count)
    return sorted(out.items())


def quantile(before: list, after: list, q: float) -> float | None:
    """histogram_quantile(q) of the observations between two scrapes (None: none)."""
    prior = dict(before)
    delta = [(le, count - prior.get(le, 0.0)) for le, count in after]
    if not delta or delta[-1][1] <= 0:
        return None
    rank, lower, below = q * delta[-1][1], 0.0, 0.0
    for le, count in delta:
        if count >= rank:
            if le == float("inf"):
                return lower
            return lower + (le - lower) * ((rank - below) / max(count - below, 1e-12))
        lower, below = le, count
    return lower


def observations(before: list, after: list) -> int:
    prior = dict(before)
    return int(after[-1][1] - prior.get(after[-1][0], 0.0)) if after else 0


def tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and all its descendants (MiB)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        stack += children.get(p, [])
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
        total += int(match.group(1)) if match else 0
    return total / 1024


# ---- one server --------------------------------------------------------------------------

def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def run_server(name: str, knobs: dict, workloads: list[Workload], store: Path, tokenizer: Path, args,
               run_dir: Path) -> list[dict]:
    """Serve the store with these knobs; AIPerf runs each workload in turn; their figures."""
    server_dir = run_dir / name
    template = serving.write_template(server_dir)
    model_flags = ["--model", "smollm2"]
    engine_config = {"max_cpu_loras": MAX_CPU_LORAS, **knobs}
    print(f"many_adapters.py: {name}: engine {json.dumps(engine_config)}", flush=True)
    host, results = HostTier(), []
    with serving.Launcher(model_flags, engine_config, store, server_dir / "loraplex-serve.log") as server:
        server.start(args.ready_timeout)
        warm = [serving.BASE_MODEL, *(adapter_name(i) for i in range(8))]
        for w in warm:
            host.use(w)
        before_tokens = serving.wait_for_tokens(server.metrics_url, 0.0, serving.warm_up(server.http_url, warm))
        for workload in workloads:
            out_dir = server_dir / workload.name
            out_dir.mkdir(parents=True, exist_ok=True)
            chosen = choose(workload, args.requests, args.seed)
            dataset = out_dir / "dataset.jsonl"
            write_dataset(dataset, workload.name, chosen, args.seed, args.input_chars, args.max_tokens)
            command = serving.aiperf_command(args.aiperf, server.http_url, chosen, template, tokenizer, out_dir,
                                             serving.arrival_load_flags(dataset, serving.Workload(
                                                 args.requests, args.rate, 0, 0, 0, 0, 0, 0, args.seed)))
            scraped = scrape(server.metrics_url)
            figures = serving.profile(server, command, out_dir, before_tokens)
            after = scrape(server.metrics_url)
            before_tokens += figures["output_tokens"]
            results.append({"server": name, "workload": workload.name, "engine_config": engine_config,
                            **figures, **per_request(out_dir, host), **from_metrics(scraped, after),
                            "rss_mib": tree_rss_mib(server.proc.pid)})
            print(f"many_adapters.py: {name} {workload.name}: {figures['output_tokens_per_s']:.1f} tok/s, "
                  f"{figures['errors']} errors", flush=True)
    return results


def per_request(out_dir: Path, host: HostTier) -> dict:
    """TTFT p50/p99 of cold and warm requests (ms), cold as HostTier replays them in arrival order."""
    data = json.loads((out_dir / "inputs.json").read_text())["data"]
    adapter = {e["session_id"]: e["payloads"][-1]["parameters"].get("lora_name", serving.BASE_MODEL) for e in data}
    cold = {session: host.use(name) for session, name in adapter.items()}  # dataset order = arrival order
    ttft: dict[str, list[float]] = {"cold": [], "warm": [], "base": []}
    for record in serving.request_records(out_dir):
        if "error" in record or "time_to_first_token" not in record["metrics"]:
            continue
        kind = cold[record["metadata"]["conversation_id"]]
        key = "base" if kind is None else "cold" if kind else "warm"
        ttft[key].append(record["metrics"]["time_to_first_token"]["value"])
    return {"cold_requests": len(ttft["cold"]), "warm_requests": len(ttft["warm"]),
            **{f"ttft_{k}_p{q}_ms": pct(v, q / 100) for k, v in ttft.items() if k != "base" for q in (50, 99)}}


def from_metrics(before: str, after: str) -> dict:
    step, load = "loraplex_step_seconds", "loraplex_adapter_load_seconds"
    out = {}
    for value in ("true", "false"):
        b, a = buckets(before, step, "loading", value), buckets(after, step, "loading", value)
        p99 = quantile(b, a, 0.99)
        out[f"step_p99_ms_loading_{value}"] = p99 * 1000 if p99 is not None else None
        out[f"steps_loading_{value}"] = observations(b, a)
    for stage in ("disk_read", "host_to_device"):
        b, a = buckets(before, load, "stage", stage), buckets(after, load, "stage", stage)
        p99 = quantile(b, a, 0.99)
        out[f"{stage}_p99_ms"] = p99 * 1000 if p99 is not None else None
        out[f"{stage}_count"] = observations(b, a)
    return out


# ---- the scheduler alone ----------------------------------------------------------------

def simulate(policy: str, workload: Workload, slots: int, requests: int, rate: float, seed: int) -> dict:
    """adapter_admission=`policy` on the scheduler with tests/support's fake runner (no model): Poisson
    arrivals of `rate` requests per step; steps to drain, device-slot loads, queue wait in steps."""
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from scheduler_harness import Harness

    h = Harness(num_blocks=4096, block_size=16, adapter_slots=slots, adapter_admission=policy, max_num_seqs=64,
                max_num_batched_tokens=512, max_adapter_wait_seconds=1e9)
    rng, names = random.Random(seed), choose(workload, requests, seed)
    arrivals, t = [], 0.0
    for _ in names:
        t += rng.expovariate(rate)
        arrivals.append(t)
    queued, step = {}, 0
    while len(queued) < len(names) or h.sched.has_work():
        while len(queued) < len(names) and arrivals[len(queued)] <= step:
            i = len(queued)
            h.now = step
            h.add(f"r{i}", 40, max_tokens=24, lora=None if names[i] == serving.BASE_MODEL else names[i])
            queued[f"r{i}"] = step
        h.now = step
        for seq in h.step().admitted:
            rid = seq.request.request_id
            if isinstance(queued.get(rid), int):
                queued[rid] = (queued[rid], step)
        step += 1
    waits = sorted(b - a for a, b in queued.values())
    return {"policy": policy, "workload": workload.name, "slots": slots, "steps": step,
            "slot_loads": len(h.adapters.loads), "wait_p50": pct(waits, 0.5), "wait_p99": pct(waits, 0.99)}


def simulations(args) -> list[dict]:
    out = []
    for workload in WORKLOADS[1:]:
        for slots in (8, 32):
            for policy in ("resident_first", "policy"):
                out.append(simulate(policy, workload, slots, args.sim_requests, args.sim_rate, args.seed))
    return out


def sim_table(results: list[dict]) -> str:
    rows = [["workload", "slots", "admission", "steps", "slot loads", "wait p50 (steps)", "wait p99 (steps)"]]
    rows += [[r["workload"], str(r["slots"]), r["policy"], str(r["steps"]), str(r["slot_loads"]),
              str(r["wait_p50"]), str(r["wait_p99"])] for r in results]
    return serving.aligned(rows)


# ---- report ---------------------------------------------------------------------------------

COLUMNS = [("output_tokens_per_s", "tok/s", "{:.1f}"), ("errors", "err", "{}"),
           ("cold_requests", "cold", "{}"), ("ttft_cold_p50_ms", "TTFT cold p50", "{:.0f}"),
           ("ttft_cold_p99_ms", "cold p99", "{:.0f}"), ("warm_requests", "warm", "{}"),
           ("ttft_warm_p50_ms", "TTFT warm p50", "{:.0f}"), ("ttft_warm_p99_ms", "warm p99", "{:.0f}"),
           ("ttft_p99_ms", "all p99", "{:.0f}"),
           ("step_p99_ms_loading_false", "step p99", "{:.0f}"), ("step_p99_ms_loading_true", "step p99 loading", "{:.0f}"),
           ("disk_read_p99_ms", "read p99", "{:.1f}"), ("host_to_device_p99_ms", "h2d p99", "{:.1f}"),
           ("host_to_device_count", "slot loads", "{}"), ("rss_mib", "RSS MiB", "{:.0f}")]


def table(results: list[dict]) -> str:
    rows = [["server / workload", *(h for _, h, _ in COLUMNS)]]
    for r in results:
        rows.append([f"{r['server']} {r['workload']}",
                     *(fmt.format(r[k]) if r.get(k) is not None else "-" for k, _, fmt in COLUMNS)])
    return serving.aligned(rows)


def goals(results: list[dict]) -> list[str]:
    lines = []
    by = {(r["server"], r["workload"]): r for r in results}
    for (server, workload), r in by.items():
        eight = by.get((server, "8"))
        if workload.startswith("2000") and eight:
            x = r["output_tokens_per_s"] / eight["output_tokens_per_s"]
            lines.append(f"{server} {workload}: throughput {x:.2f}x the 8-adapter run (goal >= 0.85): "
                         f"{'met' if x >= 0.85 else 'NOT met'}")
        if r.get("ttft_cold_p99_ms") is not None and r.get("ttft_warm_p99_ms") is not None:
            bound = r["ttft_warm_p99_ms"] + (r["disk_read_p99_ms"] or 0) + (r["step_p99_ms_loading_true"]
                                                                            or r["step_p99_ms_loading_false"] or 0)
            lines.append(f"{server} {workload}: cold TTFT p99 {r['ttft_cold_p99_ms']:.0f} ms vs warm p99 + read p99 "
                         f"+ step p99 = {bound:.0f} ms: {'met' if r['ttft_cold_p99_ms'] <= bound else 'NOT met'}")
        if r.get("step_p99_ms_loading_true") and r.get("step_p99_ms_loading_false"):
            x = r["step_p99_ms_loading_true"] / r["step_p99_ms_loading_false"]
            lines.append(f"{server} {workload}: step p99 while loading {x:.2f}x the p99 without")
    for workload in COMPARED:
        aware, plain = by.get(("slots8-resident", workload)), by.get(("slots8", workload))
        if aware and plain:
            lines.append(f"resident_first vs policy, 8 slots, {workload}: {aware['output_tokens_per_s']:.1f} vs "
                         f"{plain['output_tokens_per_s']:.1f} tok/s, TTFT p99 {aware['ttft_p99_ms']:.0f} vs "
                         f"{plain['ttft_p99_ms']:.0f} ms, slot loads {aware['host_to_device_count']} vs "
                         f"{plain['host_to_device_count']}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="8 slots only (and resident_first on 8 and 2000-zipf), 4 workloads, fewer requests")
    ap.add_argument("--rate", type=float, default=1.5, help="Poisson arrivals, requests/s (default %(default)s)")
    ap.add_argument("--requests", type=int, default=0, help="requests per workload (default 48; --quick 32)")
    ap.add_argument("--max-tokens", type=int, default=24, help="max_tokens of every request (default %(default)s)")
    ap.add_argument("--input-chars", type=int, default=160, help="prompt length in characters (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--servers", default="", help=f"comma-separated subset of {','.join(SERVERS)}")
    ap.add_argument("--workloads", default="", help=f"comma-separated subset of {','.join(w.name for w in WORKLOADS)}")
    ap.add_argument("--aiperf", default=str(serving.DEFAULT_AIPERF), help="aiperf executable (make aiperf)")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--out", default=str(ROOT / ".cache" / "many_adapters" / "runs"), help="AIPerf's files")
    ap.add_argument("--json", default="", help="write every figure here")
    ap.add_argument("--simulate", action="store_true",
                    help="only the scheduler with a fake runner: resident_first vs policy admission, no servers")
    ap.add_argument("--sim-requests", type=int, default=2000, help="--simulate: requests (default %(default)s)")
    ap.add_argument("--sim-rate", type=float, default=1.0, help="--simulate: arrivals per step (default %(default)s)")
    args = ap.parse_args()
    args.requests = args.requests or (32 if args.quick else 48)
    if args.simulate:
        print(sim_table(simulations(args)))
        return 0
    if not Path(args.aiperf).exists():
        print(f"many_adapters.py: no aiperf at {args.aiperf}; `make aiperf` installs it", file=sys.stderr)
        return 2
    from loraplex.launch.serve import builtin_model
    from loraplex.launch.tritonserver import cache_dir

    checkpoint = builtin_model("smollm2")[0]
    store = build_store(checkpoint, cache_dir() / "many_adapters")
    run_dir = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    plan = {"slots8": [w for w in WORKLOADS if not args.quick or w.name in QUICK_WORKLOADS],
            "slots32": [] if args.quick else list(WORKLOADS),
            "slots8-resident": [w for w in WORKLOADS if w.name in (["8", "2000-zipf"] if args.quick else COMPARED)]}
    chosen = args.servers.split(",") if args.servers else [s for s in SERVERS if plan[s]]
    started = time.monotonic()
    results = []
    for name in chosen:
        workloads = [w for w in plan[name] or WORKLOADS if not args.workloads or w.name in args.workloads.split(",")]
        results += run_server(name, SERVERS[name], workloads, store, checkpoint, args, run_dir)
    print(f"\nmany_adapters.py: {len(results)} runs in {time.monotonic() - started:.0f} s; {args.requests} requests "
          f"per run at {args.rate:g}/s Poisson, max_tokens {args.max_tokens}; adapters hard-link {VARIANTS} weight "
          f"files (cold reads hit the page cache); AIPerf's files in {run_dir}\n")
    print(table(results))
    print()
    print("\n".join(goals(results)))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
