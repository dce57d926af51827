"""Serving benchmark: `loraplex-serve` under NVIDIA AIPerf load, one server per configuration.

    python benchmarks/serving.py [--quick] [--configs continuous,static,no-prefix-cache] [--json PATH]
    python benchmarks/serving.py --workload w1 [--quick] [--json PATH]

For each configuration the script starts `loraplex-serve` (its own adapter store in a temp
dir, free ports, `--engine-config` set to the configuration's knobs), waits for
/v2/health/ready, sends one short warm-up request per adapter, runs `aiperf profile`
against Triton's HTTP generate_stream endpoint (template endpoint, streaming), stops the
launcher with SIGTERM and goes on to the next configuration. All configurations get the
same AIPerf workload: synthetic prompts and output lengths drawn with one fixed seed,
Poisson arrivals at one offered rate, requests assigned round-robin to the adapters
(AIPerf's `--model-names a,b` with the template's `lora_name` set to `{{ model }}`), a
pool of shared prompt prefixes (what the prefix cache can reuse), greedy, `ignore_eos`.

Configurations (engine knobs, backend/config.py):
  continuous       the default engine (iteration-level batching, prefix cache on)
  static           {"batching": "static"}: request-level batching as a static server runs
                   it: a new batch is admitted only once the running one has finished, and
                   a batch keeps its shape until then (an ended sequence's row is still
                   computed, its output dropped: what padding costs a static batch)
  static-shrink    {"batching": "static-shrink"}: the same admission, ended rows leave
  no-prefix-cache  {"enable_prefix_caching": false}

Token counts: AIPerf counts output tokens by re-tokenizing the streamed text on the
client. The tiny model's byte tokenizer and random weights stream invalid UTF-8 that
re-tokenizes to ~1.8x the real count, so output tokens come from the server instead: the
`loraplex_generation_tokens_total` counter (Triton's metrics endpoint) before and after
the run, checked against the sum of the requests' `max_tokens` (exact under
`ignore_eos`). Output tokens/s = that count / AIPerf's benchmark duration; ITL per request
= (e2e latency - TTFT) / (max_tokens - 1). Request throughput, TTFT and e2e latency are
AIPerf's own figures (TTFT: the first streamed chunk with text).

--workload w1 (issue 11, goal 1): one server, the default configuration, on W1's random
model (built once under .cache/w1/) with its 8 adapters in the adapter store. AIPerf sends
the 48 requests of a fixed-seed single-turn dataset (text + output_length) all at once
(concurrency = request count), round-robin over the adapters, then again on the base
model (--no-base-run: not). With the server stopped, the peers of peers.py run in this
process on the prompts and max_tokens AIPerf sent (its inputs.json), with the torch
threads of the server's engine: peft one adapter at a time and peft mixed-adapter batches
(static batches of 16), HF `generate` and transformers' continuous batching on the base
model. Useful output tokens/s = the requests' max_tokens / wall time (ours: AIPerf's
benchmark duration); one table of ours / each.

AIPerf runs from its own virtualenv (default .cache/aiperf-venv, `make bench` creates
it): its dependencies would change pinned packages of the serving environment.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # run from a checkout without installing; peers.py

import peers  # noqa: E402

from loraplex.launch.processes import answers_ok, start_in_session  # noqa: E402
from loraplex.launch.tritonserver import free_ports  # noqa: E402

CONFIGURATIONS = {
    "continuous": {},
    "static": {"batching": "static"},
    "static-shrink": {"batching": "static-shrink"},
    "no-prefix-cache": {"enable_prefix_caching": False},
}
DEFAULT_AIPERF = ROOT / ".cache" / "aiperf-venv" / "bin" / "aiperf"
BASE_MODEL = "base"  # the name that, in --adapters, means the base model without an adapter
GENERATED_TOKENS = "loraplex_generation_tokens_total"
PROMPT_TOKENS, PREFIX_HIT_TOKENS = "loraplex_prompt_tokens_total", "loraplex_prefix_cache_hit_tokens_total"
WARM_UP_TOKENS = 4
# The payload of one request; AIPerf renders it per request (an inline template would be
# split at its first comma by --extra-inputs, so it goes to a file).
PAYLOAD_TEMPLATE = (
    '{"text_input": {{ text|tojson }}, "stream": true, "parameters": {"max_tokens": {{ max_tokens }}, '
    '"ignore_eos": true, "temperature": 0{% if model != "' + BASE_MODEL + '" %}, "lora_name": {{ model|tojson }}'
    '{% endif %}}}'
)


# --api-keys: the tenants file every server gets and the key every request carries (empty: development mode)
AUTH: dict[str, str] = {}


def use_api_keys(run_dir: Path) -> None:
    """Serve authenticated (a tenants file of one tenant, its quotas at their defaults) and send its key."""
    from loraplex.tenancy.tenants import new_key

    key, digest = new_key()
    run_dir.mkdir(parents=True, exist_ok=True)
    tenants = run_dir / "tenants.json"
    tenants.write_text(json.dumps({"tenants": {"bench": {"api_key_sha256": digest}}}))
    AUTH.update(tenants_file=str(tenants), api_key=key)


@dataclass
class Workload:
    """What AIPerf sends to every configuration."""

    requests: int
    rate: float  # requests per second, Poisson arrivals
    input_tokens: int
    input_stddev: int
    output_tokens: int
    output_stddev: int
    prefix_prompts: int  # distinct shared prefixes (0: none)
    prefix_tokens: int
    seed: int
    output_lengths: str = "normal"  # or "long-tailed": LONG_TAIL's range, the same mean, our dataset file


# Long-tailed max_tokens (as W1's): most requests short, a few up to the top of this range.
LONG_TAIL = (4, 256)
DEFAULT_WORKLOAD = Workload(requests=200, rate=4.0, input_tokens=64, input_stddev=16, output_tokens=48,
                            output_stddev=16, prefix_prompts=4, prefix_tokens=128, seed=0)
QUICK_WORKLOAD = Workload(requests=8, rate=8.0, input_tokens=32, input_stddev=8, output_tokens=16,
                          output_stddev=4, prefix_prompts=2, prefix_tokens=32, seed=0)
# One configuration: a smoke run checks the harness (server, warm-up, AIPerf, the server's token count),
# and each further configuration only repeats it on another server (~40 s each on 2 cores).
QUICK_CONFIGS = "continuous"
DEFAULT_CONFIGS = "continuous,static,no-prefix-cache"  # static-shrink only when asked


@dataclass(frozen=True)
class W1:
    """Issue 11's W1 workload: a random LLaMA with random adapters, every request arriving at once."""

    layers: int = 6
    hidden: int = 512
    intermediate: int = 1376
    heads: int = 8
    kv_heads: int = 8
    vocab: int = 32000
    adapters: int = 8  # random PEFT LoRAs on all 7 projections, requests round-robin over them
    rank: int = 16
    requests: int = 48
    prompt_tokens: tuple[int, int] = (32, 256)  # uniform, BOS included
    output_tokens: tuple[int, int] = (4, 256)  # long-tailed, summing to output_total
    output_total: int = 2040
    peer_batch: int = 16  # the static peers' batch size
    seed: int = 0

    @property
    def summary(self) -> str:
        """What it is, in words."""
        return (f"a random {self.layers}-layer LLaMA, hidden {self.hidden}, vocab {self.vocab}, {self.requests} "
                f"requests at once round-robin over {self.adapters} random rank-{self.rank} adapters, prompts of "
                f"{self.prompt_tokens[0]}-{self.prompt_tokens[1]} tokens, long-tailed max_tokens of "
                f"{self.output_tokens[0]}-{self.output_tokens[1]}, {self.output_total} in all")

    @property
    def model_key(self) -> str:
        """Names the cached checkpoint and adapters of this shape."""
        return (f"l{self.layers}-h{self.hidden}-i{self.intermediate}-a{self.heads}-kv{self.kv_heads}-v{self.vocab}"
                f"-{self.adapters}x-r{self.rank}")


W1_WORKLOAD = W1()
# The W1 path at a size that runs in seconds: every step of it (model, adapters, AIPerf's burst,
# the base-model run, each peer, the ratios), none of its figures.
QUICK_W1_WORKLOAD = W1(layers=2, hidden=128, intermediate=344, heads=4, kv_heads=4, vocab=1024, adapters=2, rank=8,
                       requests=6, prompt_tokens=(8, 24), output_tokens=(2, 8), output_total=24, peer_batch=4)
WORDS = ("the quick brown fox jumps over a lazy dog while many tenants share one server and each of them "
         "asks for its own adapter").split()


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=("synthetic", "w1"), default="synthetic",
                    help="synthetic: AIPerf's synthetic prompts at --rate over the built-in model's adapters, one "
                         f"server per configuration; w1: issue 11's W1 ({W1_WORKLOAD.summary}; --seed applies, the "
                         "other workload and model flags do not) through Triton with the adapters and with the base "
                         "model, then the peers in-process on the prompts AIPerf sent (default: %(default)s)")
    ap.add_argument("--peers", default=",".join(PEERS),
                    help=f"w1: comma-separated in-process peers (default: all); choices: {', '.join(PEERS)}")
    ap.add_argument("--base-run", action=argparse.BooleanOptionalAction, default=True,
                    help="w1: after the adapters' run, the same requests through Triton on the base model, without "
                         "lora_name (default: on)")
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke run: {QUICK_WORKLOAD.requests} requests, configuration {QUICK_CONFIGS} "
                         "(unless --configs is given); the workload flags below are ignored. With --workload w1: "
                         f"W1's steps at a tiny size ({QUICK_W1_WORKLOAD.summary})")
    ap.add_argument("--configs", default=None,
                    help=f"comma-separated configurations, the first is the baseline of the ratios "
                         f"(default: {DEFAULT_CONFIGS}; w1: one, default {QUICK_CONFIGS}); "
                         f"choices: {', '.join(CONFIGURATIONS)}")
    ap.add_argument("--model", choices=("tiny", "smollm2"), default="tiny",
                    help="built-in model of loraplex-serve (tiny: random 4-layer LLaMA with demo-a/demo-b; "
                         "default: %(default)s)")
    ap.add_argument("--model-dir", default=None,
                    help="HF checkpoint folder instead of a built-in model (its tokenizer drives AIPerf; "
                         f"no adapters: --adapters defaults to {BASE_MODEL})")
    ap.add_argument("--adapters", default=None,
                    help=f"comma-separated adapter names requests go to round-robin ({BASE_MODEL} = no adapter; "
                         "default: the built-in model's demo adapters)")
    ap.add_argument("--engine-config", default="{}",
                    help="engine knobs (JSON) common to every configuration; a configuration's own knobs win "
                         "(default: %(default)s)")
    d, default = DEFAULT_WORKLOAD, " (default: %(default)s)"
    ap.add_argument("--requests", type=int, default=d.requests, help="requests per configuration" + default)
    ap.add_argument("--rate", type=float, default=d.rate,
                    help="offered load: requests/s, Poisson arrivals" + default)
    ap.add_argument("--input-tokens", type=int, default=d.input_tokens,
                    help="mean synthetic prompt length (tokens, after the shared prefix)" + default)
    ap.add_argument("--input-stddev", type=int, default=d.input_stddev, help="its standard deviation" + default)
    ap.add_argument("--output-tokens", type=int, default=d.output_tokens,
                    help="mean max_tokens (ignore_eos)" + default)
    ap.add_argument("--output-stddev", type=int, default=d.output_stddev, help="its standard deviation" + default)
    ap.add_argument("--output-lengths", choices=("normal", "long-tailed"), default=d.output_lengths,
                    help="normal: AIPerf's synthetic prompts and max_tokens (--output-tokens +- --output-stddev); "
                         f"long-tailed: max_tokens of {LONG_TAIL[0]}-{LONG_TAIL[1]} with the same mean, most short "
                         "and a few long (as W1's), prompts of --input-tokens +- --input-stddev characters after "
                         "the shared prefix (tokens with the tiny model's byte tokenizer), from a dataset file "
                         "written with --seed" + default)
    ap.add_argument("--prefix-prompts", type=int, default=d.prefix_prompts,
                    help="distinct shared prompt prefixes, one prepended to each prompt (0: none)" + default)
    ap.add_argument("--prefix-tokens", type=int, default=d.prefix_tokens,
                    help="length of each prefix (tokens)" + default)
    ap.add_argument("--seed", type=int, default=d.seed,
                    help="AIPerf's random seed (prompts, lengths, arrivals); w1: the seed of its prompts and "
                         "lengths" + default)
    ap.add_argument("--aiperf", default=str(DEFAULT_AIPERF),
                    help="the aiperf executable (`make bench` installs it into .cache/aiperf-venv)" + default)
    ap.add_argument("--artifacts", default=None,
                    help="folder for AIPerf's exports and the launcher logs, one subfolder per configuration "
                         "(w1: per AIPerf run, adapters and base, beside the dataset) "
                         "(default: .cache/serving/run-<pid>)")
    ap.add_argument("--ready-timeout", type=float, default=300.0,
                    help="seconds to wait for the server" + default)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--api-keys", action="store_true",
                    help="serve with a tenants file of one tenant (authenticated mode: its quotas at their defaults, "
                         "Triton's admin APIs closed) and send that tenant's key with every request")
    return ap


def workload_from(args: argparse.Namespace) -> Workload:
    """The workload the flags ask for (--quick: the smoke workload)."""
    if args.quick:
        return QUICK_WORKLOAD
    return Workload(args.requests, args.rate, args.input_tokens, args.input_stddev, args.output_tokens,
                    args.output_stddev, args.prefix_prompts, args.prefix_tokens, args.seed, args.output_lengths)


def chosen_configs(args: argparse.Namespace) -> dict[str, dict]:
    """name -> engine knobs of each configuration asked for, in order, the common knobs merged under."""
    one_config = args.quick or args.workload == "w1"
    names = (args.configs or (QUICK_CONFIGS if one_config else DEFAULT_CONFIGS)).split(",")
    unknown = [n for n in names if n not in CONFIGURATIONS]
    if unknown:
        raise SystemExit(f"serving.py: unknown configuration(s) {', '.join(unknown)}; "
                         f"choices: {', '.join(CONFIGURATIONS)}")
    if args.workload == "w1" and len(names) != 1:
        raise SystemExit(f"serving.py: --workload w1 serves one configuration, --configs names {len(names)}")
    common = json.loads(args.engine_config)
    return {name: {**common, **CONFIGURATIONS[name]} for name in names}


def model_and_adapters(args: argparse.Namespace) -> tuple[list[str], Path, list[str]]:
    """(launcher flags naming the model, checkpoint folder for AIPerf's tokenizer, adapter names)."""
    if args.model_dir:
        names = args.adapters.split(",") if args.adapters else [BASE_MODEL]
        return ["--model-dir", args.model_dir], Path(args.model_dir), names
    from loraplex.launch.serve import builtin_model

    checkpoint, adapters_dir, _ = builtin_model(args.model)
    names = args.adapters.split(",") if args.adapters else sorted(p.name for p in adapters_dir.iterdir() if p.is_dir())
    return ["--model", args.model], checkpoint, names


# Thread settings a harness may run under for its own in-process work (`OMP_NUM_THREADS=1 python benchmarks/...`):
# the servers it starts do not inherit them, so they run as `make serve` would here (set them by env= / engine knobs).
HARNESS_ONLY_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def server_environment(extra: dict | None = None) -> dict:
    """The environment a benchmarked server starts with: this one without HARNESS_ONLY_ENV, plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if k not in HARNESS_ONLY_ENV}, **(extra or {})}


def server_threads(engine_config: dict, env: dict | None = None) -> tuple[int, int]:
    """(torch threads, native threads) of a server started with engine_config and server_environment(env),
    as its engine picks them (docs/configuration.md: cpu_threads, native_threads)."""
    from loraplex.config import native_cpu_threads, serving_cpu_threads

    environ = server_environment(env)
    torch_threads = engine_config.get("cpu_threads") or serving_cpu_threads(environ) or int(environ["OMP_NUM_THREADS"])
    return torch_threads, native_cpu_threads(engine_config.get("native_threads", 0), environ,
                                             int8=engine_config.get("quantization") == "int8")


class Launcher:
    """One `loraplex-serve` in its own process group, on free ports, with a private adapter store, in
    server_environment(env)."""

    def __init__(self, model_flags: list[str], engine_config: dict, store: Path, log_path: Path,
                 env: dict | None = None):
        self.http_port, self.grpc_port, self.metrics_port = free_ports(3)
        self.command = [str(Path(sys.executable).with_name("loraplex-serve")), *model_flags, "--quiet",
                        "--address", "127.0.0.1", "--http-port", str(self.http_port),
                        "--grpc-port", str(self.grpc_port), "--metrics-port", str(self.metrics_port),
                        "--adapter-store", str(store), "--engine-config", json.dumps(engine_config),
                        *(["--tenants-file", AUTH["tenants_file"]] if AUTH else [])]
        self.log_path = log_path
        self.env = server_environment(env)
        self.proc: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        """Base URL of Triton's HTTP endpoint."""
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        """Triton's Prometheus endpoint."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    NAME, READY_PATH = "loraplex-serve", "/v2/health/ready"  # what it is, and the URL that answers once it serves

    def start(self, ready_timeout: float) -> "Launcher":
        """Start it and wait until READY_PATH answers (Triton: /v2/health/ready)."""
        with open(self.log_path, "wb") as log:
            self.proc = start_in_session(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + ready_timeout
        while not answers_ok(f"{self.http_url}{self.READY_PATH}"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.NAME} did not become ready; log {self.log_path}:\n"
                                   + self.log_path.read_text(errors="replace")[-3000:])
            time.sleep(0.5)
        return self

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM the launcher's process group (it stops tritonserver), SIGKILL it after ``grace`` s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):  # it may end between the poll and the signal
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its guard process then ends tritonserver's group
        self.proc.wait()

    def __enter__(self) -> "Launcher":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def warm_up(http_url: str, adapters: list[str]) -> int:
    """One short greedy request per adapter, so adapter loading and first-step costs stay out of the figures.

    Returns the tokens they generated.
    """
    for name in adapters:
        parameters = {"max_tokens": WARM_UP_TOKENS, "temperature": 0, "ignore_eos": True}
        if AUTH:
            parameters["api_key"] = AUTH["api_key"]
        if name != BASE_MODEL:
            parameters["lora_name"] = name
        body = json.dumps({"text_input": "warm-up", "parameters": parameters}).encode()
        request = urllib.request.Request(f"{http_url}/v2/models/lora_llm/generate", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"warm-up request for {name} failed: {exc.code} {exc.read().decode(errors='replace')}")
    return WARM_UP_TOKENS * len(adapters)


def counter_total(metrics_url: str, name: str) -> float:
    """Sum of a counter over all its label sets (0 if absent)."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    pattern = re.compile(rf"^{name}(?:{{[^}}]*}})? (\S+)$", re.MULTILINE)
    return sum(float(value) for value in pattern.findall(text))


def aiperf_command(aiperf: str, http_url: str, adapters: list[str], template: Path, tokenizer: Path, out_dir: Path,
                   load_flags: list[str]) -> list[str]:
    """`aiperf profile` against one server: template endpoint, streaming, adapters round-robin, then ``load_flags``
    (the dataset and arrivals: `synthetic_load_flags` or `burst_load_flags`)."""
    return [
        aiperf, "profile", "--endpoint-type", "template", "--streaming",
        "--url", f"{http_url}/v2/models/lora_llm/generate_stream",
        "--extra-inputs", f"payload_template:{template}", "--extra-inputs", "response_field:text_output",
        "--tokenizer", str(tokenizer), "--model-names", ",".join(adapters),
        "--model-selection-strategy", "round-robin", *load_flags, "--artifact-dir", str(out_dir),
        "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry", "--workers-max", "1", "--record-processors", "1",
    ]


def synthetic_load_flags(workload: Workload) -> list[str]:
    """AIPerf's synthetic prompts and output lengths (normal, fixed seed), Poisson arrivals."""
    w = workload
    flags = [
        "--request-count", str(w.requests), "--request-rate", str(w.rate), "--arrival-pattern", "poisson",
        "--isl", str(w.input_tokens), "--isl-stddev", str(w.input_stddev),
        "--osl", str(w.output_tokens), "--osl-stddev", str(w.output_stddev), "--random-seed", str(w.seed),
    ]
    if w.prefix_prompts:
        flags += ["--prefix-prompt-pool-size", str(w.prefix_prompts), "--prefix-prompt-length", str(w.prefix_tokens)]
    return flags


def long_tailed_requests(workload: Workload) -> list[tuple[str, int]]:
    """(prompt text, max_tokens) of each request of a long-tailed workload, from its seed: one of the shared
    prefixes, then words up to a normally drawn length; max_tokens long-tailed over LONG_TAIL, the same mean."""
    w, rng = workload, random.Random(workload.seed)
    outputs = long_tailed_lengths(w.requests, *LONG_TAIL, w.requests * w.output_tokens, rng)
    prefixes = [words_of(w.prefix_tokens, rng) for _ in range(w.prefix_prompts)]
    requests = []
    for i, max_tokens in enumerate(outputs):
        prefix = prefixes[i % len(prefixes)] if prefixes else ""
        requests.append((prefix + words_of(max(1, round(rng.gauss(w.input_tokens, w.input_stddev))), rng),
                         max_tokens))
    return requests


def words_of(chars: int, rng: random.Random) -> str:
    """Random WORDS, cut to exactly chars characters."""
    text = ""
    while len(text) < chars:
        text += rng.choice(WORDS) + " "
    return text[:chars]


def arrival_load_flags(dataset: Path, workload: Workload) -> list[str]:
    """Every line of a single-turn JSONL dataset sent once, in order, at Poisson arrivals of workload.rate."""
    return ["--input-file", str(dataset), "--custom-dataset-type", "single_turn",
            "--dataset-sampling-strategy", "sequential", "--request-count", str(workload.requests),
            "--request-rate", str(workload.rate), "--arrival-pattern", "poisson", "--random-seed", str(workload.seed)]


def burst_load_flags(dataset: Path, requests: int) -> list[str]:
    """Every line of a single-turn JSONL dataset (text, output_length) sent once, in order, all at once."""
    return ["--input-file", str(dataset), "--custom-dataset-type", "single_turn",
            "--dataset-sampling-strategy", "sequential", "--request-count", str(requests),
            "--concurrency", str(requests)]


def run_aiperf(command: list[str], out_dir: Path) -> None:
    """Run AIPerf with its output in ``out_dir/aiperf.log``; raise with the log's tail if it fails."""
    log_path = out_dir / "aiperf.log"
    env = {**os.environ, "AIPERF_DATASET_MMAP_BASE_PATH": str(out_dir)}  # its dataset files: here, not in /tmp
    with open(log_path, "wb") as log:
        rc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            check=False).returncode
    if rc != 0:
        raise RuntimeError(f"aiperf exited with code {rc}; log {log_path}:\n"
                           + log_path.read_text(errors="replace")[-3000:])


def max_tokens_by_session(out_dir: Path) -> dict[str, int]:
    """session id -> the max_tokens its request asked for (AIPerf's inputs.json)."""
    data = json.loads((out_dir / "inputs.json").read_text())["data"]
    return {entry["session_id"]: entry["payloads"][-1]["parameters"]["max_tokens"] for entry in data}


def request_records(out_dir: Path) -> list[dict]:
    """AIPerf's per-request records of the profiling phase (profile_export.jsonl)."""
    lines = (out_dir / "profile_export.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return [r for r in records if r["metadata"].get("benchmark_phase", "profiling") == "profiling"]


def completed_requests(out_dir: Path) -> tuple[list[tuple[dict, int]], int]:
    """(AIPerf's record, its max_tokens) of each request that completed, and how many failed."""
    asked = max_tokens_by_session(out_dir)
    records = request_records(out_dir)
    ok = [(r, asked[r["metadata"]["conversation_id"]]) for r in records
          if "error" not in r and "request_latency" in r["metrics"]]
    return ok, len(records) - len(ok)


def summarize(out_dir: Path, generated_tokens: float) -> dict:
    """The figures of one configuration from AIPerf's exports and the server's token count."""
    summary = json.loads((out_dir / "profile_export_aiperf.json").read_text())
    ok, failed = completed_requests(out_dir)
    itl = [(r["metrics"]["request_latency"]["value"] - r["metrics"]["time_to_first_token"]["value"]) / (n - 1)
           for r, n in ok if n > 1]
    duration = summary["benchmark_duration"]["avg"]
    return {
        "request_count": int(summary["request_count"]["avg"]),
        "errors": failed,
        "benchmark_duration_s": duration,
        "output_tokens": int(generated_tokens),
        "output_tokens_asked": sum(n for _, n in ok),
        "aiperf_output_tokens": int(summary["total_output_tokens"]["avg"]),
        "output_tokens_per_s": generated_tokens / duration,
        "requests_per_s": summary["request_throughput"]["avg"],
        "ttft_mean_ms": summary["time_to_first_token"]["avg"],
        "ttft_p50_ms": summary["time_to_first_token"]["p50"],
        "ttft_p99_ms": summary["time_to_first_token"]["p99"],
        "itl_p50_ms": statistics.median(itl) if itl else None,
        "e2e_mean_ms": summary["request_latency"]["avg"],
        "e2e_p99_ms": summary["request_latency"]["p99"],
    }


def prefill_computed(metrics_url: str) -> float:
    """Prompt tokens the server has prefilled so far: prompt tokens less those the prefix cache served."""
    return counter_total(metrics_url, PROMPT_TOKENS) - counter_total(metrics_url, PREFIX_HIT_TOKENS)


def wait_for_tokens(metrics_url: str, before: float, expected: int, timeout: float = 5.0) -> float:
    """Tokens generated since ``before``, polled until they reach ``expected`` or ``timeout`` s pass."""
    deadline = time.monotonic() + timeout
    while True:
        generated = counter_total(metrics_url, GENERATED_TOKENS) - before
        if generated >= expected or time.monotonic() > deadline:
            return generated
        time.sleep(0.2)


def profile(server: Launcher, command: list[str], out_dir: Path, tokens_before: float) -> dict:
    """Run one AIPerf ``command`` against ``server``; its figures, output tokens counted by the server.

    ``tokens_before``: the server's generated-token counter before the run (what earlier
    requests made, once counted).
    """
    prefill_before = prefill_computed(server.metrics_url)
    run_aiperf(command, out_dir)
    asked = sum(n for _, n in completed_requests(out_dir)[0])
    generated = wait_for_tokens(server.metrics_url, tokens_before, asked)
    figures = {**summarize(out_dir, generated), "prefill_tokens": prefill_computed(server.metrics_url) - prefill_before}
    if figures["output_tokens"] != figures["output_tokens_asked"]:
        print(f"serving.py: {out_dir.name}: warning: the server generated {figures['output_tokens']} tokens, "
              f"the requests asked for {figures['output_tokens_asked']}", file=sys.stderr)
    return figures


def write_template(out_dir: Path) -> Path:
    """The payload template AIPerf renders per request, as a file in ``out_dir`` (made if missing)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    template = out_dir / "payload_template.json"
    key = f', "api_key": {json.dumps(AUTH["api_key"])}' if AUTH else ""
    template.write_text(PAYLOAD_TEMPLATE.replace('"temperature": 0', '"temperature": 0' + key, 1))
    return template


def measure(name: str, engine_config: dict, model_flags: list[str], tokenizer: Path, adapters: list[str],
            workload: Workload, args: argparse.Namespace, run_dir: Path) -> dict:
    """Serve one configuration, load it with AIPerf, and return its figures (AIPerf's files in run_dir/name)."""
    return measure_each(name, engine_config, model_flags, tokenizer, adapters, [workload], args, run_dir)[0]


def measure_each(name: str, engine_config: dict, model_flags: list[str], tokenizer: Path, adapters: list[str],
                 workloads: list[Workload], args: argparse.Namespace, run_dir: Path) -> list[dict]:
    """Serve one configuration and load it with AIPerf once per workload, in order, each run starting on an idle
    server; their figures. AIPerf's files: run_dir/name, or run_dir/name/rate-R for more than one workload."""
    server_dir = run_dir / name
    template = write_template(server_dir)
    print(f"serving.py: {name}: engine {json.dumps(engine_config)}", flush=True)
    results = []
    with (tempfile.TemporaryDirectory(prefix="loraplex-bench-store-") as store,
          Launcher(model_flags, engine_config, Path(store), server_dir / "loraplex-serve.log") as server):
        server.start(args.ready_timeout)
        before = wait_for_tokens(server.metrics_url, 0.0, warm_up(server.http_url, adapters))
        for workload in workloads:
            out_dir = server_dir if len(workloads) == 1 else server_dir / f"rate-{workload.rate:g}"
            out_dir.mkdir(parents=True, exist_ok=True)
            if workload.output_lengths == "long-tailed":
                load = arrival_load_flags(write_dataset(long_tailed_requests(workload), out_dir / "dataset.jsonl"),
                                          workload)
            else:
                load = synthetic_load_flags(workload)
            command = aiperf_command(args.aiperf, server.http_url, adapters, template, tokenizer, out_dir, load)
            figures = profile(server, command, out_dir, before)
            before += figures["output_tokens"]
            results.append({"config": name, "engine_config": engine_config, "rate": workload.rate,
                            "artifacts": str(out_dir), **figures})
    return results


COLUMNS = [  # (key, heading, format, better when higher)
    ("output_tokens_per_s", "out tok/s", "{:.1f}", True),
    ("requests_per_s", "req/s", "{:.2f}", True),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.1f}", False),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.1f}", False),
    ("itl_p50_ms", "ITL p50 ms", "{:.1f}", False),
    ("e2e_mean_ms", "e2e mean ms", "{:.0f}", False),
    ("e2e_p99_ms", "e2e p99 ms", "{:.0f}", False),
    ("prefill_tokens", "prefill tok", "{:.0f}", False),
]


def ratio(value: float | None, base: float | None) -> str:
    """value / base as `1.23x`, or `-` when either is missing or base is 0."""
    return f"{value / base:.2f}x" if value is not None and base else "-"


def format_table(results: list[dict]) -> str:
    """One row per configuration, then one row of ratios per configuration against the first (the baseline)."""
    base = results[0]
    rows = [[r["config"], *(fmt.format(r[key]) if r[key] is not None else "-" for key, _, fmt, _ in COLUMNS)]
            for r in results]
    rows += [[f"{r['config']} / {base['config']}", *(ratio(r[key], base[key]) for key, *_ in COLUMNS)]
             for r in results[1:]]
    header = ["configuration", *(heading for _, heading, _, _ in COLUMNS)]
    return aligned([header, *rows])


def aligned(rows: list[list[str]]) -> str:
    """Rows of cells as text columns: the first left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    return "\n".join(lines)


def w1_assets(w1: W1) -> tuple[Path, Path]:
    """(checkpoint folder, folder of its adapters) of W1's random model, built once under .cache/w1/."""
    from loraplex.launch.tritonserver import cache_dir

    home = cache_dir() / "w1" / w1.model_key
    if not (home / "complete").exists():
        print(f"serving.py: building the W1 model and {w1.adapters} adapters in {home}", flush=True)
        work = home.with_name(f"{home.name}.tmp-{os.getpid()}")
        shutil.rmtree(work, ignore_errors=True)
        peers.build_model_and_adapters(
            work, w1.adapters, w1.rank, "all", hidden_size=w1.hidden,
            intermediate_size=w1.intermediate, num_hidden_layers=w1.layers, num_attention_heads=w1.heads,
            num_key_value_heads=w1.kv_heads, vocab_size=w1.vocab)
        (work / "complete").write_text(json.dumps(asdict(w1), indent=2) + "\n")
        shutil.rmtree(home, ignore_errors=True)
        work.rename(home)
    return home / "model", home / "adapters"


def long_tailed_lengths(n: int, low: int, high: int, total: int, rng: random.Random) -> list[int]:
    """``n`` lengths in [low, high] summing to ``total``, most short and a few long, in random order.

    At evenly spaced quantiles q (0..1) the length is low * (high/low) ** (q ** p), the
    exponent p found by bisection; rounding's remainder goes one token at a time to the
    longest that are below ``high``.
    """
    if not n * low <= total <= n * high:
        raise ValueError(f"{n} lengths in [{low}, {high}] cannot sum to {total}")
    quantiles = [i / (n - 1) for i in range(n)] if n > 1 else [0.0]

    def lengths(p: float) -> list[int]:
        return [min(high, max(low, round(low * (high / low) ** (q ** p)))) for q in quantiles]

    short, long = 1e-3, 1e3  # p: the sum falls as p grows
    for _ in range(200):
        middle = math.sqrt(short * long)
        short, long = (middle, long) if sum(lengths(middle)) > total else (short, middle)
    out = lengths(long)
    while sum(out) < total:
        out[max((i for i in range(n) if out[i] < high), key=lambda i: (out[i], i))] += 1
    rng.shuffle(out)
    return out


def w1_requests(w1: W1) -> list[tuple[str, int]]:
    """(prompt text, max_tokens) of each W1 request, from ``w1.seed``: ASCII words cut to a length drawn
    uniformly from w1.prompt_tokens (the byte tokenizer: one token a character, plus BOS)."""
    rng = random.Random(w1.seed)
    outputs = long_tailed_lengths(w1.requests, *w1.output_tokens, w1.output_total, rng)
    requests = []
    for max_tokens in outputs:
        requests.append((words_of(rng.randint(*w1.prompt_tokens) - 1, rng), max_tokens))
    return requests


def write_dataset(requests: list[tuple[str, int]], path: Path) -> Path:
    """AIPerf's single-turn JSONL: one {"text", "output_length"} line per request."""
    path.write_text("".join(json.dumps({"text": text, "output_length": n}) + "\n" for text, n in requests))
    return path


def sent_jobs(out_dir: Path, tokenizer) -> list[peers.Job]:
    """The requests AIPerf sent (its inputs.json), in order, as the peers' jobs."""
    jobs = []
    for entry in json.loads((out_dir / "inputs.json").read_text())["data"]:
        payload = entry["payloads"][-1]
        parameters = payload["parameters"]
        jobs.append(peers.Job(tokenizer(payload["text_input"]).input_ids, parameters["max_tokens"],
                              parameters.get("lora_name")))
    return jobs


PEERS = {  # name -> what it is, with {b} for the static batch size
    "peft-one-at-a-time": "peft, one adapter at a time, static batches of {b}",
    "peft-mixed": "peft, mixed-adapter static batches of {b} (adapter_names)",
    "hf-static": "HF generate, base model, static batches of {b}",
    "hf-generate-batch": "transformers generate_batch (continuous batching), base model",
}


def run_peer(name: str, models: tuple, jobs: list[peers.Job], batch: int, pad_id: int) -> peers.PeerRun:
    """One peer over ``jobs``; ``models`` = (plain HF model, PeftModel with every adapter)."""
    hf, peft_model = models
    if name == "peft-one-at-a-time":
        return peers.run_static(peft_model, jobs, peers.batches_by_adapter(jobs, batch), pad_id, adapters="set")
    if name == "peft-mixed":
        return peers.run_static(peft_model, jobs, peers.batches_in_arrival_order(jobs, batch), pad_id,
                                adapters="per-row")
    if name == "hf-static":
        return peers.run_static(hf, jobs, peers.batches_in_arrival_order(jobs, batch), pad_id)
    if name == "hf-generate-batch":
        return peers.run_continuous_batching(hf, jobs)
    raise ValueError(f"unknown peer {name}; choices: {', '.join(PEERS)}")


def measure_peers(names: list[str], model_dir: Path, adapters_dir: Path, jobs: list[peers.Job], batch: int,
                  threads: int) -> dict[str, dict]:
    """Each peer on ``jobs`` in this process, ``threads`` torch threads, after a 2-job warm-up; name -> figures
    (or the reason it was skipped)."""
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(threads)
    peers.quiet_transformers()
    adapter_dirs = {p.name: str(p) for p in sorted(adapters_dir.iterdir()) if p.is_dir()}
    models = peers.load_peer_models(str(model_dir), adapter_dirs)
    pad_id = AutoTokenizer.from_pretrained(model_dir).pad_token_id or 0
    warm = [peers.Job(job.prompt_ids, 2, job.adapter) for job in jobs[:2]]
    results = {}
    for name in names:
        missing = peers.continuous_batching_missing() if name == "hf-generate-batch" else None
        if missing:
            print(f"serving.py: peer {name} skipped: {missing}", file=sys.stderr, flush=True)
            results[name] = {"skipped": missing}
            continue
        run_peer(name, models, warm, batch, pad_id)
        run = run_peer(name, models, jobs, batch, pad_id)
        results[name] = {"useful_tokens": run.useful_tokens, "tokens_asked": sum(j.max_tokens for j in jobs),
                         "seconds": run.seconds, "output_tokens_per_s": run.tokens_per_s}
        print(f"serving.py: peer {name}: {run.tokens_per_s:.1f} useful tok/s ({run.seconds:.1f} s)", flush=True)
    return results


def measure_w1(w1: W1, name: str, engine_config: dict, peer_names: list[str], args: argparse.Namespace,
               run_dir: Path) -> dict:
    """W1 through Triton on one server (over its adapters, then on the base model unless --no-base-run), then each
    peer in-process on the requests AIPerf sent."""
    from transformers import AutoTokenizer

    from loraplex.launch.serve import seed_adapter_store

    model_dir, adapters_dir = w1_assets(w1)
    adapters = sorted(p.name for p in adapters_dir.iterdir() if p.is_dir())
    template = write_template(run_dir)
    dataset = write_dataset(w1_requests(w1), run_dir / "w1_dataset.jsonl")
    runs = {"adapters": adapters, **({"base": [BASE_MODEL]} if args.base_run else {})}
    ours = {}
    print(f"serving.py: W1 {name}: engine {json.dumps(engine_config)}", flush=True)
    with (tempfile.TemporaryDirectory(prefix="loraplex-bench-store-") as store,
          Launcher(["--model-dir", str(model_dir)], engine_config, Path(store), run_dir / "loraplex-serve.log")
          as server):
        seed_adapter_store(Path(store), adapters_dir)
        server.start(args.ready_timeout)
        before = wait_for_tokens(server.metrics_url, 0.0, warm_up(server.http_url, [*adapters, BASE_MODEL]))
        for run, names in runs.items():
            out_dir = run_dir / run
            out_dir.mkdir(parents=True, exist_ok=True)
            command = aiperf_command(args.aiperf, server.http_url, names, template, model_dir, out_dir,
                                     burst_load_flags(dataset, w1.requests))
            ours[run] = profile(server, command, out_dir, before)
            before += ours[run]["output_tokens"]
            print(f"serving.py: ours ({run}): {ours[run]['output_tokens_per_s']:.1f} tok/s", flush=True)
    jobs = sent_jobs(run_dir / "adapters", AutoTokenizer.from_pretrained(model_dir))
    if (len(jobs), sum(j.max_tokens for j in jobs)) != (w1.requests, w1.output_total):
        raise RuntimeError(f"AIPerf sent {len(jobs)} requests for {sum(j.max_tokens for j in jobs)} tokens, the "
                           f"dataset has {w1.requests} for {w1.output_total}")
    threads = max(server_threads(engine_config))  # the CPUs the server computes on: its native loops' (decision 080)
    results = measure_peers(peer_names, model_dir, adapters_dir, jobs, w1.peer_batch, threads)
    return {"workload": asdict(w1), "config": name, "engine_config": engine_config, "adapters": adapters,
            "torch_threads": threads, "ours": ours, "peers": results, "ratios": w1_ratios(ours, results)}


def w1_ratios(ours: dict, peer_results: dict) -> dict[str, dict[str, float]]:
    """ours run -> peer -> ours' useful tokens/s over the peer's (peers that were skipped: none)."""
    return {run: {name: figures["output_tokens_per_s"] / peer["output_tokens_per_s"]
                  for name, peer in peer_results.items() if "skipped" not in peer}
            for run, figures in ours.items()}


OURS_LABELS = {"adapters": "ours through Triton, {n} adapters", "base": "ours through Triton, base model"}


def format_w1_table(report: dict) -> str:
    """One row per system (ours through Triton, each peer): useful tokens/s, wall s, and one ratio column per run of
    ours (ours / that row); a skipped peer's reason follows the table."""
    ours = report["ours"]
    systems = [(OURS_LABELS[run].format(n=len(report["adapters"])), figures) for run, figures in ours.items()]
    systems += [(PEERS[name].format(b=report["workload"]["peer_batch"]), figures)
                for name, figures in report["peers"].items()]
    header = ["system", "useful out tok/s", "wall s", *(f"ours {run} / it" for run in ours)]
    rows = [[label, *measured_cells(f), *(ratio(ours[run]["output_tokens_per_s"], f.get("output_tokens_per_s"))
                                          for run in ours)]
            for label, f in systems]
    notes = [f"{name}: skipped: {f['skipped']}" for name, f in report["peers"].items() if "skipped" in f]
    return "\n".join([aligned([header, *rows]), *notes])


def measured_cells(figures: dict) -> tuple[str, str]:
    """(useful tokens/s, wall s) of one system: AIPerf's benchmark duration for ours, the peer's own clock for a
    peer; dashes for a skipped peer."""
    if "skipped" in figures:
        return "-", "-"
    return f"{figures['output_tokens_per_s']:.1f}", f"{figures.get('benchmark_duration_s', figures.get('seconds')):.1f}"


def chosen_peers(args: argparse.Namespace) -> list[str]:
    """The peers --peers names, in order."""
    names = args.peers.split(",") if args.peers else []
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise SystemExit(f"serving.py: unknown peer(s) {', '.join(unknown)}; choices: {', '.join(PEERS)}")
    return names


def main_w1(args: argparse.Namespace, run_dir: Path) -> int:
    """--workload w1: ours through Triton, then the peers; one table of ratios."""
    [(name, knobs)] = chosen_configs(args).items()
    peer_names = chosen_peers(args)
    w1 = QUICK_W1_WORKLOAD if args.quick else W1_WORKLOAD
    w1 = dataclasses.replace(w1, seed=args.seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"serving.py: W1: {w1.summary}; artifacts {run_dir}", flush=True)
    started = time.monotonic()
    report = measure_w1(w1, name, knobs, peer_names, args, run_dir)
    print()
    print(format_w1_table(report))
    print(f"\nuseful output tokens/s = the {report['ours']['adapters']['output_tokens_asked']} tokens the requests "
          f"asked for / wall time (ours: AIPerf's benchmark duration, prefill included); peers in-process with "
          f"{report['torch_threads']} torch thread(s), as many as the server's native loops. "
          f"Wall time {time.monotonic() - started:.0f} s.")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    args = build_parser().parse_args(argv)
    if not Path(args.aiperf).exists():
        print(f"serving.py: no aiperf at {args.aiperf}; `make bench` installs it", file=sys.stderr)
        return 2
    run_dir = Path(args.artifacts) if args.artifacts else ROOT / ".cache" / "serving" / f"run-{os.getpid()}"
    if args.api_keys:
        use_api_keys(run_dir)
    if args.workload == "w1":
        return main_w1(args, run_dir)
    configs = chosen_configs(args)
    workload = workload_from(args)
    model_flags, tokenizer, adapters = model_and_adapters(args)
    print(f"serving.py: {workload.requests} requests at {workload.rate:g}/s (Poisson) per configuration, "
          f"adapters {','.join(adapters)}, artifacts {run_dir}", flush=True)
    started = time.monotonic()
    results = [measure(name, knobs, model_flags, tokenizer, adapters, workload, args, run_dir)
               for name, knobs in configs.items()]
    print()
    print(format_table(results))
    print(f"\noutput tokens: counted by the server; AIPerf's client-side count was "
          f"{results[0]['aiperf_output_tokens']} for {results[0]['output_tokens']} ({results[0]['config']}). "
          f"Wall time {time.monotonic() - started:.0f} s.")
    if args.json:
        report = {"workload": asdict(workload), "model": model_flags, "adapters": adapters,
                  "baseline": results[0]["config"], "results": results}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
