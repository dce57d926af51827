"""Serving benchmark: `loraplex-serve` under NVIDIA AIPerf load, one server per configuration.

    python benchmarks/serving.py [--quick] [--configs continuous,static,no-prefix-cache] [--json PATH]

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
  static           {"batching": "static"}: a new batch is admitted only once the running
                   one has finished, as a request-level (static) batching server does
  no-prefix-cache  {"enable_prefix_caching": false}

Token counts: AIPerf counts output tokens by re-tokenizing the streamed text on the
client. The tiny model's byte tokenizer and random weights stream invalid UTF-8 that
re-tokenizes to ~1.8x the real count, so output tokens come from the server instead: the
`loraplex_generation_tokens_total` counter (Triton's metrics endpoint) before and after
the run, checked against the sum of the requests' `max_tokens` (exact under
`ignore_eos`). Output tokens/s = that count / AIPerf's benchmark duration; ITL per request
= (e2e latency - TTFT) / (max_tokens - 1). Request throughput, TTFT and e2e latency are
AIPerf's own figures (TTFT: the first streamed chunk with text).

AIPerf runs from its own virtualenv (default .cache/aiperf-venv, `make bench` creates
it): its dependencies would change pinned packages of the serving environment.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
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
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from loraplex.processes import answers_ok, start_in_session  # noqa: E402
from loraplex.tritonserver import free_ports  # noqa: E402

CONFIGURATIONS = {
    "continuous": {},
    "static": {"batching": "static"},
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


DEFAULT_WORKLOAD = Workload(requests=200, rate=4.0, input_tokens=64, input_stddev=16, output_tokens=48,
                            output_stddev=16, prefix_prompts=4, prefix_tokens=128, seed=0)
QUICK_WORKLOAD = Workload(requests=8, rate=8.0, input_tokens=32, input_stddev=8, output_tokens=16,
                          output_stddev=4, prefix_prompts=2, prefix_tokens=32, seed=0)
# One configuration: a smoke run checks the harness (server, warm-up, AIPerf, the server's token count),
# and each further configuration only repeats it on another server (~40 s each on 2 cores).
QUICK_CONFIGS = "continuous"


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke run: {QUICK_WORKLOAD.requests} requests, configuration {QUICK_CONFIGS} "
                         "(unless --configs is given); the workload flags below are ignored")
    ap.add_argument("--configs", default=None,
                    help=f"comma-separated configurations, the first is the baseline of the ratios "
                         f"(default: {','.join(CONFIGURATIONS)}); choices: {', '.join(CONFIGURATIONS)}")
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
    ap.add_argument("--prefix-prompts", type=int, default=d.prefix_prompts,
                    help="distinct shared prompt prefixes, one prepended to each prompt (0: none)" + default)
    ap.add_argument("--prefix-tokens", type=int, default=d.prefix_tokens,
                    help="length of each prefix (tokens)" + default)
    ap.add_argument("--seed", type=int, default=d.seed,
                    help="AIPerf's random seed (prompts, lengths, arrivals)" + default)
    ap.add_argument("--aiperf", default=str(DEFAULT_AIPERF),
                    help="the aiperf executable (`make bench` installs it into .cache/aiperf-venv)" + default)
    ap.add_argument("--artifacts", default=None,
                    help="folder for AIPerf's exports and the launcher logs, one subfolder per configuration "
                         "(default: .cache/serving/run-<pid>)")
    ap.add_argument("--ready-timeout", type=float, default=300.0,
                    help="seconds to wait for the server" + default)
    ap.add_argument("--json", default=None, help="write the results here")
    return ap


def workload_from(args: argparse.Namespace) -> Workload:
    """The workload the flags ask for (--quick: the smoke workload)."""
    if args.quick:
        return QUICK_WORKLOAD
    return Workload(args.requests, args.rate, args.input_tokens, args.input_stddev, args.output_tokens,
                    args.output_stddev, args.prefix_prompts, args.prefix_tokens, args.seed)


def chosen_configs(args: argparse.Namespace) -> dict[str, dict]:
    """name -> engine knobs of each configuration asked for, in order, the common knobs merged under."""
    names = (args.configs or (QUICK_CONFIGS if args.quick else ",".join(CONFIGURATIONS))).split(",")
    unknown = [n for n in names if n not in CONFIGURATIONS]
    if unknown:
        raise SystemExit(f"serving.py: unknown configuration(s) {', '.join(unknown)}; "
                         f"choices: {', '.join(CONFIGURATIONS)}")
    common = json.loads(args.engine_config)
    return {name: {**common, **CONFIGURATIONS[name]} for name in names}


def model_and_adapters(args: argparse.Namespace) -> tuple[list[str], Path, list[str]]:
    """(launcher flags naming the model, checkpoint folder for AIPerf's tokenizer, adapter names)."""
    if args.model_dir:
        names = args.adapters.split(",") if args.adapters else [BASE_MODEL]
        return ["--model-dir", args.model_dir], Path(args.model_dir), names
    from loraplex.serve import builtin_model

    checkpoint, adapters_dir, _ = builtin_model(args.model)
    names = args.adapters.split(",") if args.adapters else sorted(p.name for p in adapters_dir.iterdir() if p.is_dir())
    return ["--model", args.model], checkpoint, names


class Launcher:
    """One `loraplex-serve` in its own process group, on free ports, with a private adapter store."""

    def __init__(self, model_flags: list[str], engine_config: dict, store: Path, log_path: Path):
        self.http_port, self.grpc_port, self.metrics_port = free_ports(3)
        self.command = [str(Path(sys.executable).with_name("loraplex-serve")), *model_flags, "--quiet",
                        "--address", "127.0.0.1", "--http-port", str(self.http_port),
                        "--grpc-port", str(self.grpc_port), "--metrics-port", str(self.metrics_port),
                        "--adapter-store", str(store), "--engine-config", json.dumps(engine_config)]
        self.log_path = log_path
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
            self.proc = start_in_session(self.command, stdout=log, stderr=subprocess.STDOUT)
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


def aiperf_command(aiperf: str, http_url: str, workload: Workload, adapters: list[str], template: Path,
                   tokenizer: Path, out_dir: Path) -> list[str]:
    """`aiperf profile` for one configuration: template endpoint, streaming, Poisson arrivals, fixed seed."""
    w = workload
    command = [
        aiperf, "profile", "--endpoint-type", "template", "--streaming",
        "--url", f"{http_url}/v2/models/lora_llm/generate_stream",
        "--extra-inputs", f"payload_template:{template}", "--extra-inputs", "response_field:text_output",
        "--tokenizer", str(tokenizer), "--model-names", ",".join(adapters),
        "--model-selection-strategy", "round-robin",
        "--request-count", str(w.requests), "--request-rate", str(w.rate), "--arrival-pattern", "poisson",
        "--isl", str(w.input_tokens), "--isl-stddev", str(w.input_stddev),
        "--osl", str(w.output_tokens), "--osl-stddev", str(w.output_stddev),
        "--random-seed", str(w.seed), "--artifact-dir", str(out_dir),
        "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry", "--workers-max", "1", "--record-processors", "1",
    ]
    if w.prefix_prompts:
        command += ["--prefix-prompt-pool-size", str(w.prefix_prompts), "--prefix-prompt-length", str(w.prefix_tokens)]
    return command


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


def measure(name: str, engine_config: dict, model_flags: list[str], tokenizer: Path, adapters: list[str],
            workload: Workload, args: argparse.Namespace, run_dir: Path) -> dict:
    """Serve one configuration, load it with AIPerf, and return its figures."""
    out_dir = run_dir / name
    out_dir.mkdir(parents=True, exist_ok=True)
    template = out_dir / "payload_template.json"
    template.write_text(PAYLOAD_TEMPLATE)
    print(f"serving.py: {name}: engine {json.dumps(engine_config)}", flush=True)
    with (tempfile.TemporaryDirectory(prefix="loraplex-bench-store-") as store,
          Launcher(model_flags, engine_config, Path(store), out_dir / "loraplex-serve.log") as server):
        server.start(args.ready_timeout)
        before = wait_for_tokens(server.metrics_url, 0.0, warm_up(server.http_url, adapters))
        prefill_before = prefill_computed(server.metrics_url)
        run_aiperf(aiperf_command(args.aiperf, server.http_url, workload, adapters, template, tokenizer, out_dir),
                   out_dir)
        asked = sum(n for _, n in completed_requests(out_dir)[0])
        generated = wait_for_tokens(server.metrics_url, before, asked)
        prefill = prefill_computed(server.metrics_url) - prefill_before
    figures = {"config": name, "engine_config": engine_config, **summarize(out_dir, generated),
               "prefill_tokens": prefill}
    if figures["output_tokens"] != figures["output_tokens_asked"]:
        print(f"serving.py: {name}: warning: the server generated {figures['output_tokens']} tokens, "
              f"the requests asked for {figures['output_tokens_asked']}", file=sys.stderr)
    return figures


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
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in [header, *rows]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    args = build_parser().parse_args(argv)
    if not Path(args.aiperf).exists():
        print(f"serving.py: no aiperf at {args.aiperf}; `make bench` installs it", file=sys.stderr)
        return 2
    configs = chosen_configs(args)
    workload = workload_from(args)
    model_flags, tokenizer, adapters = model_and_adapters(args)
    run_dir = Path(args.artifacts) if args.artifacts else ROOT / ".cache" / "serving" / f"run-{os.getpid()}"
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
